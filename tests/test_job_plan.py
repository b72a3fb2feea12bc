"""Planning: prompt rendering (template, chat, messages, per-row errors), window order, fingerprint."""
from __future__ import annotations

import os
import random
import shutil

import pyarrow as pa
import pytest

from batchrun.job.plan import length_order, make_plan, render, windows
from batchrun.job.spec import parse_job
from batchrun.tokenizer import Tokenizer
from test_job_common import job_dict, tiny_model, write_prompt_files  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def tok(tiny_model):  # noqa: F811
    return Tokenizer.from_dir(tiny_model)


def spec_for(model, **inp):
    return parse_job(job_dict(model, "in.parquet", "out", input={"passthrough": [], **inp}), "<t>", "/")


def test_template_rows_and_per_row_errors(tiny_model, tok):  # noqa: F811
    spec = spec_for(tiny_model, prompt_column=None, prompt_template="Q{n}: {text[3]} / {text}")
    table = pa.table({"text": ["abcdef", "ab", None, ""], "n": [1, 2, 3, 4]})
    r = render(spec, table, tok)
    assert r.prompts[0] == "Q1: d / abcdef"
    assert r.errors[0] is None and r.token_ids[0] == tok.encode("Q1: d / abcdef")
    assert r.prompts[1] is None and "IndexError" in r.errors[1]          # the template fails on this row only
    assert r.errors[2] == "input.prompt_template: column 'text' is null in this row"
    assert "IndexError" in r.errors[3]


def test_plain_column_null_and_empty(tiny_model, tok):  # noqa: F811
    spec = spec_for(tiny_model)
    r = render(spec, pa.table({"id": ["a", "b", "c"], "text": ["hello there", None, ""]}), tok)
    assert r.token_ids[0] == tok.encode("hello there")          # add_special_tokens as LLM.generate does
    assert r.errors[1] == "null prompt (column 'text')"
    assert r.errors[2] is None and r.token_ids[2] == []          # the engine turns this into an error row


def test_chat_wrapping_uses_the_model_template_without_a_second_bos(tiny_model, tok):  # noqa: F811
    spec = spec_for(tiny_model, chat=True, system_prompt="Be brief.")
    r = render(spec, pa.table({"id": ["a"], "text": ["Name a river."]}), tok)
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Name a river."}])
    assert r.prompts[0] == want
    assert r.token_ids[0] == tok.encode(want, add_special_tokens=False)
    assert r.token_ids[0].count(tok.bos_token_id) == 1


def test_messages_column_with_a_row_the_template_rejects(tiny_model, tok):  # noqa: F811
    spec = spec_for(tiny_model, prompt_column=None, messages_column="messages")
    convs = [[{"role": "user", "content": "hi"}], [{"role": "wizard", "content": "boo"}], None]
    r = render(spec, pa.table({"id": ["a", "b", "c"], "messages": convs}), tok)
    assert r.prompts[0] == tok.apply_chat_template(convs[0])
    assert r.errors[0] is None
    assert "Unknown role wizard" in r.errors[1]
    assert r.errors[2] == "null messages (column 'messages')"


def test_length_order_properties():
    rng = random.Random(0)
    prefixes = [[rng.randrange(500) for _ in range(16)] for _ in range(5)]
    seqs = []
    for _ in range(300):
        p = rng.choice(prefixes) if rng.random() < 0.6 else [rng.randrange(500) for _ in range(16)]
        seqs.append(p[: rng.randint(1, 16)] if rng.random() < 0.1 else p + [rng.randrange(500)] * rng.randint(0, 80))
    order = length_order(seqs, max_tokens=8, block_size=16)
    assert sorted(order) == list(range(len(seqs)))
    keys = [tuple(seqs[i][:16]) for i in order]
    # identical first blocks are adjacent: each key occupies one contiguous run
    runs = [k for j, k in enumerate(keys) if j == 0 or keys[j - 1] != k]
    assert len(runs) == len(set(keys))
    # inside a run longest first; runs ordered by their longest member
    lens = [len(seqs[i]) for i in order]
    starts = [j for j in range(len(keys)) if j == 0 or keys[j - 1] != keys[j]] + [len(keys)]
    for a, b in zip(starts, starts[1:]):
        assert lens[a:b] == sorted(lens[a:b], reverse=True)
    heads = [lens[a] for a in starts[:-1]]
    assert heads == sorted(heads, reverse=True)


def test_length_order_without_shared_prefixes_is_longest_first_stable():
    seqs = [[i] * n for i, n in enumerate([3, 9, 1, 9, 4])]
    assert length_order(seqs, 4, 16) == [1, 3, 4, 0, 2]


def test_windows_are_consecutive_chunks():
    assert windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_fingerprint_changes_with_what_changes_results(tmp_path, tiny_model):  # noqa: F811
    model = str(tmp_path / "model")
    shutil.copytree(tiny_model, model)
    write_prompt_files(str(tmp_path / "in"), 40, files=2)
    base = job_dict(model, str(tmp_path / "in"), str(tmp_path / "out"))

    def fp(**sections):
        job = job_dict(model, str(tmp_path / "in"), str(tmp_path / "out"), **sections)
        return make_plan(parse_job(job, "<t>", "/"), load_tokenizer=False).fingerprint

    ref = fp()
    assert fp(engine={"max_num_seqs": 7}, plan={"window_units": 5, "order": "input"}) == ref
    assert fp(sampling={"max_tokens": 9}) != ref
    assert fp(input={"prompt_template": "Say: {text}"})["prompt"] != ref["prompt"]
    assert fp(plan={"unit_rows": 10})["units"] != ref["units"]
    assert fp(output={"include_prompt": True})["prompt"] != ref["prompt"]
    changed = fp(model={"dtype": "bfloat16"})
    assert changed["model"] != ref["model"] and changed["input"] == ref["input"]
    os.utime(tmp_path / "in" / "prompts-01.parquet", (1, 1))
    assert fp()["input"] != ref["input"]
    with open(os.path.join(model, "config.json"), "a") as f:
        f.write("\n")
    assert fp()["model"] != ref["model"]
    assert "storage_options" not in repr(ref) and base["name"] not in repr(ref)
