"""Prefix caching pays through the job runner: prompts sharing a 1,500-token system prompt with
200-token questions skip at least 85% of prompt tokens, as the job summary shows."""
import random

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.tokenizer import Tokenizer
from jobutil import WORDS, cli, counts, last_json, write_job


def test_shared_system_prompt_skips_85_percent_of_prompt_tokens(tmp_path):
    from batchrun.demo import write_demo_model
    model = write_demo_model(str(tmp_path / "model"), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=128, vocab_size=512, max_position_embeddings=2048)
    tok = Tokenizer.from_dir(model)
    rng = random.Random(0)

    def text_of(n_tokens):
        words = []
        while len(tok.encode(" ".join(words), add_special_tokens=False)) < n_tokens:
            words.append(rng.choice(WORDS))
        return " ".join(words)

    system = text_of(1500)
    rows = [{"id": i, "text": text_of(200)} for i in range(120)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "q.parquet")
    job = write_job(str(tmp_path / "job.yaml"), model, str(tmp_path / "q.parquet"), str(tmp_path / "out"),
                    input__prompt_template=system + "\nQuestion: {text}", input__passthrough=[],
                    sampling__max_tokens=4, plan__unit_rows=40)
    summary = last_json(cli("submit", job, "--json", "--quiet", check=True).stdout)
    prompt_tokens = summary["prompt_tokens"]
    assert prompt_tokens >= 120 * 1700
    assert summary["engine"]["prefix_cache_hit_rate"] >= 0.85, summary["engine"]
    assert counts(str(tmp_path / "out")) == (120, 120)
