"""The n-gram proposer against a naive backwards scan, and its adaptive switch (plain Python)."""
import random

import pytest

from batchrun.engine.speculative import NgramProposer, SeqSpecState, SpecConfig


def naive(tokens, k, n_max, n_min):
    L = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if L < n + 1:
            continue
        suffix = tokens[L - n:]
        for end in range(L - 2, n - 2, -1):          # most recent earlier occurrence first
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_examples():
    p = NgramProposer(SpecConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1))
    st = SeqSpecState()
    assert p.propose(st, [1, 2, 3, 4, 1, 2], 10) == [3, 4, 1]          # "1 2" recurs: copy what followed
    st = SeqSpecState()
    assert p.propose(st, [1, 2, 9, 5, 2, 8, 1, 2], 10) == [9, 5, 2]    # most recent match of the longest n
    st = SeqSpecState()
    assert p.propose(st, [1, 2, 3], 10) == []                          # nothing recurs
    st = SeqSpecState()
    assert p.propose(st, [7, 8, 7, 8, 7], 1) == [8]                    # capped by the room left


@pytest.mark.parametrize("seed", range(5))
def test_incremental_index_equals_naive_scan(seed):
    rng = random.Random(seed)
    k, n_max, n_min = rng.randint(1, 5), rng.randint(1, 4), 1
    n_min = rng.randint(1, n_max)
    p = NgramProposer(SpecConfig(num_speculative_tokens=k, prompt_lookup_max=n_max, prompt_lookup_min=n_min))
    st = SeqSpecState()
    tokens = [rng.randrange(6) for _ in range(rng.randint(1, 30))]
    for _ in range(300):
        assert p.propose(st, tokens, 100) == naive(tokens, k, n_max, n_min)
        tokens.extend(rng.randrange(6) for _ in range(rng.randint(1, 3)))


def test_low_acceptance_switches_a_sequence_off():
    p = NgramProposer(SpecConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1,
                                 min_acceptance=0.25, warmup_proposals=8))
    st = SeqSpecState()
    p.record(st, 4, 0)
    assert st.enabled                      # still warming up
    p.record(st, 4, 1)
    assert not st.enabled                  # 1 of 8 < 25%
    assert p.propose(st, [1, 1, 1, 1], 10) == []


def test_config_validation():
    assert SpecConfig.from_dict(None) is None
    cfg = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                "prompt_lookup_min": 2})
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 4, 2)
    with pytest.raises(ValueError, match="only 'ngram'"):
        SpecConfig.from_dict({"method": "eagle", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="unknown keys"):
        SpecConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpecConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_max": 1, "prompt_lookup_min": 2})
