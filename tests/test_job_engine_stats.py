"""The job runner with every throughput feature on (swap preemption under a tight KV budget, prefix
caching, prompt-lookup speculation) writes exactly the rows of a run with all of them off, and its
summary reports their counters."""
import pyarrow as pa
import pyarrow.parquet as pq

from jobutil import WORDS, cli, counts, last_json, results, write_job


def test_job_summary_counts_swap_prefix_and_speculation(tmp_path, job_model):
    import random
    rng = random.Random(3)
    shared = " ".join(rng.choice(WORDS) for _ in range(40))
    rows = [{"id": i, "text": shared + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))),
             "topic": "t"} for i in range(48)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    base = dict(sampling__max_tokens=24, plan__unit_rows=16, plan__window_units=3)
    plain = write_job(str(tmp_path / "plain.yaml"), job_model, str(tmp_path / "in.parquet"), str(tmp_path / "plain"),
                      engine__enable_prefix_caching=False, **base)
    # ~80 blocks of 16 tokens (512 B a token in this model) against a working set of ~250 blocks
    tight = write_job(str(tmp_path / "tight.yaml"), job_model, str(tmp_path / "in.parquet"), str(tmp_path / "tight"),
                      engine__kv_cache_memory=80 * 16 * 512, engine__swap_space=0.05, engine__swap_min_tokens=0,
                      engine__speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1},
                      **base)
    a = last_json(cli("submit", plain, "--json", "--quiet", check=True).stdout)
    b = last_json(cli("submit", tight, "--json", "--quiet", check=True).stdout)

    assert results(str(tmp_path / "tight")) == results(str(tmp_path / "plain"))
    assert counts(str(tmp_path / "tight")) == (48, 48)
    e = b["engine"]
    assert e["preemptions"] > 0 and e["swapped_out_blocks"] > 0
    assert e["swapped_in_blocks"] == e["swapped_out_blocks"]          # every swapped sequence came back
    assert e["prefix_cache_queries"] > 0 and 0 < e["prefix_cache_hits"] <= e["prefix_cache_queries"]
    assert e["spec_proposed"] > 0 and 0 <= e["spec_accepted"] <= e["spec_proposed"]
    assert e["spec_acceptance_rate"] == e["spec_accepted"] / e["spec_proposed"]
    assert a["engine"]["preemptions"] == 0 and a["engine"]["spec_proposed"] == 0
    assert a["engine"]["prefix_cache_hits"] == 0
