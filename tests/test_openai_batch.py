"""OpenAI Batch API input files and the OpenAI-format output file.

Per-row sampling from each request body is checked against the oracle LLM.chat with those
SamplingParams; the output JSONL against the job's own Parquet (same ids, texts, reasons, token
counts) and against the Batch API's line shape; exactly-once across a real SIGKILL and a resume.
"""
from __future__ import annotations

import json
import os

import pytest

from batchrun.api import LLM
from batchrun.connectors import ROW_ERROR, ROW_SAMPLING, InputError, OpenAIBatchSource
from batchrun.connectors.openai_output import OPENAI_OUTPUT
from batchrun.job.plan import make_plan
from batchrun.job.run import JobRunner
from batchrun.job.spec import JobError, parse_job
from batchrun.outputs import SamplingParams
from test_job_common import cli, counts, job_dict, results, tiny_model, write_job  # noqa: F401

URL = "/v1/chat/completions"
JOB_SAMPLING = {"max_tokens": 8, "temperature": 0.0}


def req(cid, body, url=URL, method="POST") -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body})


def msgs(text: str, system: bool = False) -> list[dict]:
    m = [{"role": "user", "content": text}]
    return ([{"role": "system", "content": "Answer briefly."}] + m) if system else m


def batch_job(model: str, uri: str, out: str, **output) -> dict:
    job = job_dict(model, uri, out, sampling=JOB_SAMPLING, plan={"unit_rows": 4, "window_units": 2},
                   output={"uri": out, **output})
    job["input"] = {"uri": uri, "format": "openai_batch", "passthrough": ["model"]}
    return job


def test_request_lines_parse_and_bad_requests_name_line_and_key(tmp_path):
    lines = [
        req("a", {"model": "gpt-4o-mini", "messages": [
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}],
            "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "stop": "END", "seed": 3, "user": "u1",
            "presence_penalty": 0, "n": 1}),
        req("b", {"messages": msgs("hi"), "max_completion_tokens": 4, "stop": ["x", "y"], "ignore_eos": True}),
        "{not json",
        req("c", {"messages": msgs("hi"), "tool_choice": "auto"}),
        req("d", {"messages": msgs("hi"), "stream": True}),
        req("e", {"messages": msgs("hi"), "frobnicate": True}),
        req("f", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        req("g", {"messages": msgs("hi")}, url="/v1/embeddings"),
        json.dumps({"method": "POST", "url": URL, "body": {"messages": msgs("hi")}}),
        req("h", {"messages": msgs("hi"), "temperature": "hot"}),
        req("i", {"messages": []}),
        req("j", {"messages": msgs("hi"), "max_tokens": 3, "max_completion_tokens": 4}),
    ]
    p = tmp_path / "batch.jsonl"
    p.write_text("\n".join(lines) + "\n")
    src = OpenAIBatchSource(str(p))
    t = src.read(src.units(100)[0], ["custom_id", "messages", "model"])
    rows = t.to_pylist()
    assert [r["custom_id"] for r in rows] == ["a", "b", None, "c", "d", "e", "f", "g", None, "h", "i", "j"]
    assert rows[0]["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "one\ntwo"}]
    assert rows[0]["model"] == "gpt-4o-mini"
    assert json.loads(rows[0][ROW_SAMPLING]) == {"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "stop": ["END"],
                                                 "seed": 3, "presence_penalty": 0, "n": 1}
    assert json.loads(rows[1][ROW_SAMPLING]) == {"max_tokens": 4, "stop": ["x", "y"], "ignore_eos": True}
    err = {r["custom_id"] or i: r[ROW_ERROR] for i, r in enumerate(rows)}
    assert err["a"] is None and err["b"] is None
    where = f"{p}: line"
    assert err[2].startswith(f"{where} 3: not valid JSON")
    assert err["c"] == f"{where} 4: custom_id 'c': body.tool_choice=\"auto\": not supported by batchrun (only \"none\")"
    assert "body.stream=true" in err["d"] and err["d"].startswith(f"{where} 5:")
    assert "body.frobnicate: unsupported key" in err["e"]
    assert "body.messages[0].content[0]: only text parts" in err["f"] and "'image_url'" in err["f"]
    assert "url '/v1/embeddings': only /v1/chat/completions" in err["g"]
    assert err[8] == f"{where} 9: custom_id: a non-empty string is required"
    assert "body.temperature: expected int or float, found str" in err["h"]
    assert "body.messages: a non-empty list" in err["i"]
    assert "both set" in err["j"]
    # a JSONL file that is not a Batch API file at all is refused before any weight loads
    (tmp_path / "plain.jsonl").write_text('{"id": 1, "text": "x"}\n')
    with pytest.raises(InputError, match=r"plain\.jsonl: not an OpenAI Batch input file"):
        OpenAIBatchSource(str(tmp_path / "plain.jsonl"))
    with pytest.raises(JobError, match="prompt_column does not apply to format openai_batch"):
        parse_job({"name": "x", "model": {"path": "m"}, "output": {"uri": "o"},
                   "input": {"uri": "b.jsonl", "format": "openai_batch", "prompt_column": "text"}}, "<t>", "/")


def test_per_row_sampling_applies_and_output_file_matches_parquet(tmp_path, tiny_model):  # noqa: F811
    llm = LLM(tiny_model, dtype="float32", max_num_seqs=32, kv_cache_memory=32 << 20, swap_space=0)
    m1, m2, m3 = msgs("river stone cloud"), msgs("paper engine garden window", system=True), msgs("music table")
    # a stop string taken from the middle of m3's greedy output, so stopping really happens
    free = llm.chat([m3], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    assert stop.strip() and stop in free.text
    good = {  # custom_id -> (messages, body sampling keys)
        "short": (m1, {"max_tokens": 3, "ignore_eos": True}),
        "long": (m1, {"max_tokens": 7, "ignore_eos": True}),
        "seed11": (m2, {"temperature": 0.9, "seed": 11, "max_tokens": 6, "ignore_eos": True}),
        "seed11-again": (m2, {"temperature": 0.9, "seed": 11, "max_tokens": 6, "ignore_eos": True}),
        "seed12": (m2, {"temperature": 0.9, "seed": 12, "max_tokens": 6, "ignore_eos": True}),
        "defaults": (m3, {}),
        "stopped": (m3, {"stop": stop, "max_tokens": 12, "ignore_eos": True}),
        "completion-tokens": (m1, {"max_completion_tokens": 2, "ignore_eos": True}),
    }
    bad = {"neg-temp": (m1, {"temperature": -1.0}), "too-long": (m1, {"max_tokens": 5000}),
           "logprobs": (m1, {"top_logprobs": 2}), "top-too-many": (m1, {"logprobs": True, "top_logprobs": 21}),
           "n0": (m1, {"n": 0}), "penalty": (m1, {"presence_penalty": 2.5})}
    lines = [req(cid, {"model": "gpt-4o", "messages": m, **kw}) for cid, (m, kw) in {**good, **bad}.items()]
    lines.insert(5, "not json")
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    s = JobRunner(make_plan(parse_job(batch_job(tiny_model, str(tmp_path / "batch.jsonl"), out, openai_jsonl=True),
                                      "<t>", "/")), progress_bar=False).run()
    assert s["rows"] == len(lines) and s["error_rows"] == len(bad) + 1
    got = {g[0]: g for g in results(out)}          # id -> (id, output, finish_reason, error, ptok, otok)
    # the oracle: LLM.chat with each row's own SamplingParams (job sampling overridden by the body)
    want = llm.chat([m for m, _ in good.values()],
                    [SamplingParams(**{**JOB_SAMPLING, **{("max_tokens" if k == "max_completion_tokens" else k): v
                                                          for k, v in kw.items()}})
                     for _, kw in good.values()], use_tqdm=False)
    for cid, w in zip(good, want):
        assert got[cid][1:3] == (w.text, w.finish_reason) and got[cid][5] == len(w.token_ids), cid
    assert [got[c][5] for c in ("short", "long", "completion-tokens", "defaults")] == [3, 7, 2, got["defaults"][5]]
    assert got["defaults"][5] <= JOB_SAMPLING["max_tokens"]
    assert got["long"][1].startswith(got["short"][1])                    # greedy: the shorter is a prefix
    assert got["seed11"][1] == got["seed11-again"][1]
    assert got["stopped"][2] == "stop" and stop not in got["stopped"][1]
    assert "temperature must be >= 0" in got["neg-temp"][3]
    assert "max_tokens=5000 exceeds max_model_len" in got["too-long"][3]
    assert "body.top_logprobs: needs body.logprobs: true" in got["logprobs"][3]
    assert "body.top_logprobs=21: must be in [0, 20]" in got["top-too-many"][3]
    assert "n must be an integer >= 1" in got["n0"][3]
    assert "presence_penalty must be in [-2, 2]" in got["penalty"][3]
    assert "line 6: not valid JSON" in got[None][3]

    # the OpenAI output file: one line per row, shaped like the Batch API's, equal to the Parquet
    parsed = [json.loads(x) for x in open(os.path.join(out, OPENAI_OUTPUT))]
    assert len(parsed) == len(lines) and len({x["id"] for x in parsed}) == len(lines)
    assert sorted((x["custom_id"] or "") for x in parsed) == sorted((k or "") for k in got)
    for x in parsed:
        assert set(x) == {"id", "custom_id", "response", "error"} and x["id"].startswith("batch_req_")
        row = got[x["custom_id"]]
        if row[2] == "error":
            assert x["response"] is None and x["error"] == {"code": "invalid_request", "message": row[3]}
            continue
        assert x["error"] is None and x["response"]["status_code"] == 200
        body = x["response"]["body"]
        assert body["object"] == "chat.completion" and isinstance(body["created"], int)
        (choice,) = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": row[1]}
        assert choice["finish_reason"] == row[2] and choice["index"] == 0
        assert body["usage"] == {"prompt_tokens": row[4], "completion_tokens": row[5],
                                 "total_tokens": row[4] + row[5]}


def test_openai_output_exactly_once_across_sigkill_and_resume(tmp_path, tiny_model):  # noqa: F811
    lines = [req(f"q{i:02d}", {"messages": msgs(" ".join(["river", "stone", "cloud", "paper"][: 1 + i % 4]) + f" {i}"),
                                "max_tokens": 1 + i % 5, "ignore_eos": True}) for i in range(22)]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    ref = str(tmp_path / "ref")
    JobRunner(make_plan(parse_job(batch_job(tiny_model, str(tmp_path / "batch.jsonl"), ref, openai_jsonl=True),
                                  "<t>", "/")), progress_bar=False).run()
    out = str(tmp_path / "out")
    job = write_job(str(tmp_path / "job.yaml"),
                    batch_job(tiny_model, str(tmp_path / "batch.jsonl"), out, openai_jsonl=True))
    p = cli("submit", job, "--json", "--no-progress", env={"BATCHRUN_TEST_CRASH_AT": "after_done:2"})
    assert p.returncode == -9, p.stderr
    assert not os.path.exists(os.path.join(out, OPENAI_OUTPUT)) and 0 < counts(out)[0] < len(lines)
    p = cli("submit", job, "--json", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["openai_output"].endswith(OPENAI_OUTPUT)

    def load(d):
        rows = [json.loads(x) for x in open(os.path.join(d, OPENAI_OUTPUT))]
        for r in rows:
            r["response"]["body"].pop("created")      # the commit time of the row's unit
        return sorted(rows, key=lambda r: r["custom_id"])
    got = load(out)
    assert [r["custom_id"] for r in got] == [f"q{i:02d}" for i in range(22)]     # each exactly once
    assert got == load(ref)                                                      # as the uninterrupted run
    assert results(out) == results(ref)
    assert [r["response"]["body"]["usage"]["completion_tokens"] for r in got] == [1 + i % 5 for i in range(22)]


def test_n_logprobs_and_penalties_in_and_openai_shaped_out(tmp_path, tiny_model):  # noqa: F811
    """n, logprobs/top_logprobs, the penalties and logit_bias from request bodies: the rows equal LLM.chat with
    those SamplingParams (the oracle), the output line has n choices with OpenAI's logprobs.content."""
    m1, m2 = msgs("river stone cloud"), msgs("paper engine garden window")
    bodies = {
        "n3": (m1, {"n": 3, "temperature": 0.9, "seed": 5, "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
                    "ignore_eos": True}),
        "pen": (m2, {"presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {"300": 5, "77": -100},
                     "repetition_penalty": 1.3, "max_tokens": 6, "ignore_eos": True, "logprobs": True}),
        "plain": (m2, {"max_tokens": 3, "ignore_eos": True}),
    }
    sp = {"n3": SamplingParams(**{**JOB_SAMPLING, "n": 3, "temperature": 0.9, "seed": 5, "max_tokens": 4,
                                  "logprobs": 2, "ignore_eos": True}),
          "pen": SamplingParams(**{**JOB_SAMPLING, "presence_penalty": 1.0, "frequency_penalty": 0.5,
                                   "logit_bias": {300: 5, 77: -100}, "repetition_penalty": 1.3, "max_tokens": 6,
                                   "ignore_eos": True, "logprobs": 0}),
          "plain": SamplingParams(**{**JOB_SAMPLING, "max_tokens": 3, "ignore_eos": True})}
    (tmp_path / "batch.jsonl").write_text("\n".join(req(c, {"messages": m, **kw}) for c, (m, kw) in bodies.items()))
    out = str(tmp_path / "out")
    s = JobRunner(make_plan(parse_job(batch_job(tiny_model, str(tmp_path / "batch.jsonl"), out, openai_jsonl=True),
                                      "<t>", "/")), progress_bar=False).run()
    assert s["rows"] == 3 and s["error_rows"] == 0
    llm = LLM(tiny_model, dtype="float32", max_num_seqs=32, kv_cache_memory=32 << 20, swap_space=0)
    want = dict(zip(bodies, llm.chat([m for m, _ in bodies.values()], list(sp.values()), use_tqdm=False)))
    import duckdb
    rows = duckdb.connect().execute(f"SELECT id, sample_index, output, logprobs FROM read_parquet('{out}/*.parquet') "
                                    "ORDER BY id, sample_index").fetchall()
    assert [(r[0], r[1]) for r in rows] == [("n3", 0), ("n3", 1), ("n3", 2), ("pen", 0), ("plain", 0)]
    lines = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, open(os.path.join(out, OPENAI_OUTPUT)))}
    for cid, w in want.items():
        choices = lines[cid]["choices"]
        assert [c["index"] for c in choices] == list(range(sp[cid].n))
        for c, comp in zip(choices, w.outputs):
            assert c["message"]["content"] == comp.text
            if sp[cid].logprobs is None:
                assert c["logprobs"] is None
                continue
            content = c["logprobs"]["content"]
            assert len(content) == len(comp.token_ids)
            for e, t, d in zip(content, comp.token_ids, comp.logprobs):
                assert e["token"] == d[t].decoded_token and e["bytes"] == list(e["token"].encode())
                assert abs(e["logprob"] - d[t].logprob) < 1e-4       # float32, other batch shapes
                top = sorted(d.items(), key=lambda kv: kv[1].rank)[:sp[cid].logprobs]
                assert [x["token"] for x in e["top_logprobs"]] == [lp.decoded_token for _, lp in top]
        assert lines[cid]["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in w.outputs)
    assert len({c["message"]["content"] for c in lines["n3"]["choices"]}) > 1
