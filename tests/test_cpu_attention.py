"""The compiled CPU paged-attention op (batchrun.kernels.cpu_attention) against a float64 oracle written as
plain per-sequence, per-token loops over the block table, on the batches the engine builds: ragged contexts
of 1..2000 tokens, GQA 1/3/8, head_dim 64 and 128 (and 80, the generic path), sliding windows, decodes,
speculative verification (2..8 tokens), mixed decode + prefill chunks, block tables with holes, out-of-order
block ids and garbage past each sequence's last block."""
import logging
import random
import shutil

import pytest
import torch

from batchrun.kernels import cpu_attention as ca

if shutil.which("c++") is None and shutil.which("g++") is None:     # no compiler: the torch path is tested
    pytest.skip("no C++ compiler to build the CPU attention op", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert ca.load(), ca.status()["error"]        # a compiler exists, so the op must build


def oracle(q, k_cache, v_cache, qsl, lens, tables, scale, window, magnitude=False):
    """float64, one sequence and one query token at a time, keys found through the block table. With
    magnitude, also softmax(s) @ |v| per output element (what bounds the error of rounding p)."""
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    Hq = q.shape[1]
    G = Hq // Hkv
    out = torch.zeros(q.shape, dtype=torch.float64)
    mag = torch.zeros(q.shape, dtype=torch.float64)
    for b, ctx in enumerate(lens):
        ql = qsl[b + 1] - qsl[b]
        keys = torch.stack([k_cache[tables[b][p // bs], p % bs] for p in range(ctx)]).double()    # [ctx, Hkv, D]
        vals = torch.stack([v_cache[tables[b][p // bs], p % bs] for p in range(ctx)]).double()
        for t in range(ql):
            pos = ctx - ql + t
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(Hq):
                k, v = keys[lo:pos + 1, h // G], vals[lo:pos + 1, h // G]
                s = (k @ q[qsl[b] + t, h].double()) * scale
                out[qsl[b] + t, h] = torch.softmax(s, 0) @ v
                mag[qsl[b] + t, h] = torch.softmax(s, 0) @ v.abs()
    return (out, mag) if magnitude else out


def make_batch(seed, qlens, ctxs, Hq, Hkv, D, dtype, bs=16, strided_q=False):
    """A paged cache with every sequence's blocks scattered out of order among unused (random) blocks;
    block table entries past a sequence's last block hold garbage ids the op must not read."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // bs) for c in ctxs]
    N = sum(need) * 2 + 3                          # half the blocks unused: holes between a sequence's blocks
    ids = list(range(N))
    rng.shuffle(ids)
    tables = [[ids.pop() for _ in range(n)] for n in need]
    width = max(need) + 2
    garbage = [-1, N, 10 ** 6, -(2 ** 31)]
    bt = torch.tensor([t + [rng.choice(garbage) for _ in range(width - len(t))] for t in tables], dtype=torch.int32)
    k_cache = torch.randn(N, bs, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(N, bs, Hkv, D, generator=g).to(dtype)
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    T = qsl[-1]
    if strided_q:   # as the model passes it: a view of the fused qkv projection
        q = (torch.randn(T, Hq + 2 * Hkv, D, generator=g) * 2).to(dtype)[:, :Hq]
    else:
        q = (torch.randn(T, Hq, D, generator=g) * 2).to(dtype)
    return q, k_cache, v_cache, qsl, bt, tables


def run(q, k_cache, v_cache, qsl, ctxs, bt, scale, window, **kw):
    return ca.paged_attention(q, k_cache, v_cache, torch.tensor(qsl, dtype=torch.int32),
                              torch.tensor(ctxs, dtype=torch.int32), bt, scale, window, **kw)


# (query lengths, context lengths): the runner's orders, decodes first
SCENARIOS = {
    "decode": ([1] * 9, [1, 2, 15, 16, 17, 150, 600, 1024, 2000]),
    "verify": ([1, 1, 2, 3, 5, 8, 4, 6], [9, 700, 2, 64, 333, 2000, 17, 8]),
    "mixed": ([1, 1, 1, 3, 40, 300, 5, 130], [1, 1500, 77, 40, 1999, 300, 5, 800]),
}
HEADS = [(4, 4, 64), (9, 3, 64), (8, 1, 128), (6, 2, 128), (6, 3, 80)]     # (Hq, Hkv, D): GQA 1, 3, 8, 3, ...


# Tolerances. float32: the op accumulates in float32 over at most 2000 keys, ~1e-6 from float64.
# bfloat16: the inputs are the same bf16 values for both, and where the op keeps scores, probabilities and
# the accumulator in float32 (the generic loops) the error is the final rounding of the output to bf16 (at most
# 2^-9 relative) plus float32 noise: rtol 2^-8 with a small atol for outputs near 0. float16 likewise at its
# 2^-11. The AVX-512 BF16 paths also round p to bf16 for p @ V: assert_close_p_rounded.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-4, rtol=2 ** -8),
       torch.float16: dict(atol=1e-4, rtol=2 ** -10)}


def assert_close_p_rounded(out, ref, mag):
    """bfloat16: on AVX-512 BF16 CPUs the op rounds p to bf16 for p @ V (as torch's CPU flash attention does),
    which moves an output element by at most 2^-9 of softmax(s) @ |v| (mag): TOL's bound plus 2^-8 of mag (a
    factor 2 for float noise). Which keys each row reads is checked at TOL's own bound by
    test_uniform_attention_is_the_mean_of_the_visible_values, where every p is exactly 1."""
    err = (out.double() - ref).abs()
    bound = TOL[torch.bfloat16]["atol"] + TOL[torch.bfloat16]["rtol"] * ref.abs() + 2 ** -8 * mag
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound, {(err > bound).sum().item()} of {err.numel()} elements"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("window", [None, 300])
def test_op_matches_oracle(dtype, heads, scenario, window):
    Hq, Hkv, D = heads
    qlens, ctxs = SCENARIOS[scenario]
    q, kc, vc, qsl, bt, tables = make_batch(len(scenario) * 100 + Hq * 10 + Hkv, qlens, ctxs, Hq, Hkv, D, dtype,
                                            strided_q=scenario == "mixed")
    scale = D ** -0.5
    out = run(q, kc, vc, qsl, ctxs, bt, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    ref, mag = oracle(q, kc, vc, qsl, ctxs, tables, scale, window, magnitude=True)
    if dtype == torch.bfloat16:
        assert_close_p_rounded(out, ref, mag)
    else:
        torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("heads", HEADS[:4], ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("window", [None, 300, 7])
def test_uniform_attention_is_the_mean_of_the_visible_values(heads, window):
    """q = 0: every score is 0 and every p is exactly 1 (also in bfloat16, where the prefill path rounds p),
    so each output is the mean of the values its query sees: which keys each row reads (causal offsets,
    windows, block tables with holes, partitions) is checked at TOL's tight bound on every path."""
    Hq, Hkv, D = heads
    qlens, ctxs = SCENARIOS["mixed"]
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, qsl, bt, tables = make_batch(Hq + D, qlens, ctxs, Hq, Hkv, D, dtype)
        q = torch.zeros_like(q)
        out = run(q, kc, vc, qsl, ctxs, bt, D ** -0.5, window)
        torch.testing.assert_close(out.double(), oracle(q, kc, vc, qsl, ctxs, tables, D ** -0.5, window),
                                   **TOL[dtype])


@pytest.mark.parametrize("window", [1, 7, 16, 33])
@pytest.mark.parametrize("bs", [16, 8, 5])
def test_windows_and_block_sizes(window, bs):
    qlens, ctxs = [1, 1, 4, 8, 50], [3, 200, 40, 9, 180]
    q, kc, vc, qsl, bt, tables = make_batch(window * 10 + bs, qlens, ctxs, 8, 2, 64, torch.float32, bs=bs)
    out = run(q, kc, vc, qsl, ctxs, bt, 0.3, window)
    torch.testing.assert_close(out.double(), oracle(q, kc, vc, qsl, ctxs, tables, 0.3, window), **TOL[torch.float32])


def test_float16():
    qlens, ctxs = [1, 1, 5, 40], [30, 900, 60, 40]
    q, kc, vc, qsl, bt, tables = make_batch(5, qlens, ctxs, 9, 3, 64, torch.float16)
    out = run(q, kc, vc, qsl, ctxs, bt, 0.125, None)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), oracle(q, kc, vc, qsl, ctxs, tables, 0.125, None), **TOL[torch.float16])


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_lower_instruction_sets_agree(isa):
    """Every build of the kernel (AVX-512 with its bfloat16 path, AVX-512, AVX2, baseline) gives the same answer
    up to float rounding (isa caps at the machine's: on a CPU without a level, that case compares a path
    with itself)."""
    qlens, ctxs = [1, 1, 3, 8, 70], [5, 1000, 30, 2000, 300]
    for dtype, heads in [(torch.float32, (9, 3, 64)), (torch.bfloat16, (8, 1, 128)), (torch.float32, (6, 3, 80))]:
        q, kc, vc, qsl, bt, _ = make_batch(11, qlens, ctxs, *heads, dtype)
        best = run(q, kc, vc, qsl, ctxs, bt, 0.1, None)
        low = run(q, kc, vc, qsl, ctxs, bt, 0.1, None, isa=isa)
        torch.testing.assert_close(low.float(), best.float(), atol=2e-6 if dtype == torch.float32 else 1e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 128), (6, 2, 128)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
def test_prefetch_distance_changes_no_bit(heads):
    """Decode prefetches a bfloat16 cache one or two tiles ahead (set_kv_prefetch): the same bits either way,
    on scattered blocks, short and ragged tiles, and a cache whose rows do not start on a cache line."""
    qlens, ctxs = [1] * 8 + [3], [1, 15, 16, 17, 33, 150, 600, 2000, 70]
    q, kc, vc, qsl, bt, tables = make_batch(21, qlens, ctxs, *heads, torch.bfloat16)
    off = torch.empty(kc.numel() + 16, dtype=torch.bfloat16)[16:].view(kc.shape)   # 32 bytes off a line
    off.copy_(kc)
    old = ca.set_kv_prefetch(2)
    try:
        for k in (kc, off):
            far = run(q, k, vc, qsl, ctxs, bt, 0.1, None)
            ca.set_kv_prefetch(1)
            near = run(q, k, vc, qsl, ctxs, bt, 0.1, None)
            ca.set_kv_prefetch(2)
            assert torch.equal(far, near)
        assert_close_p_rounded(far, *oracle(q, kc, vc, qsl, ctxs, tables, 0.1, None, magnitude=True))
        with pytest.raises(RuntimeError, match="1 or 2 tiles"):
            ca.set_kv_prefetch(3)
    finally:
        ca.set_kv_prefetch(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_partitions_across_threads(dtype):
    """Few sequences with long contexts and several threads: contexts are split and the parts merged (bf16:
    also on the VDPBF16PS path where the CPU has it, whose partial results go through the same merge)."""
    old = torch.get_num_threads()
    qlens, ctxs = [1, 3], [2000, 1700]
    q, kc, vc, qsl, bt, tables = make_batch(3, qlens, ctxs, 8, 1, 64, dtype)
    want = {w: oracle(q, kc, vc, qsl, ctxs, tables, 0.2, w, magnitude=True) for w in (None, 1100)}
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            for window in (None, 1100):
                out = run(q, kc, vc, qsl, ctxs, bt, 0.2, window)
                ref, mag = want[window]
                if dtype == torch.bfloat16:
                    assert_close_p_rounded(out, ref, mag)
                else:
                    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    finally:
        torch.set_num_threads(old)


def test_torch_reference_matches_oracle():
    qlens, ctxs = [1, 1, 4, 30], [1, 500, 20, 64]
    q, kc, vc, qsl, bt, tables = make_batch(8, qlens, ctxs, 9, 3, 64, torch.float32)
    ref = ca.paged_attention_ref(q, kc, vc, torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctxs, dtype=torch.int32),
                                 bt, 0.125, 9)
    torch.testing.assert_close(ref.double(), oracle(q, kc, vc, qsl, ctxs, tables, 0.125, 9), **TOL[torch.float32])


def test_empty_and_zero_length_queries():
    q, kc, vc, qsl, bt, _ = make_batch(1, [1], [5], 4, 2, 64, torch.float32)
    empty = run(q[:0], kc, vc, [0], [], bt[:0], 0.1, None)
    assert empty.shape == (0, 4, 64)
    # a sequence scheduled with no query tokens contributes nothing
    out = run(q, kc, vc, [0, 0, 1], [7, 5], torch.cat([bt, bt]), 0.1, None)
    torch.testing.assert_close(out, run(q, kc, vc, [0, 1], [5], bt, 0.1, None))


def test_rejects_bad_inputs():
    q, kc, vc, qsl, bt, _ = make_batch(2, [1, 2], [20, 30], 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="is not a block of the cache"):
        bad = bt.clone()
        bad[1, 0] = kc.shape[0]
        run(q, kc, vc, qsl, [20, 30], bad, 0.1, None)
    with pytest.raises(RuntimeError, match="shorter than its"):
        run(q, kc, vc, qsl, [20, 1], bt, 0.1, None)
    with pytest.raises(RuntimeError, match="needs more than"):
        run(q, kc, vc, qsl, [20, bt.shape[1] * 16 + 1], bt, 0.1, None)
    with pytest.raises(RuntimeError, match="multiple of num KV heads"):
        run(q[:, :3], kc, vc, qsl, [20, 30], bt, 0.1, None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        run(q.bfloat16(), kc, vc, qsl, [20, 30], bt, 0.1, None)
    with pytest.raises(RuntimeError, match="int32"):
        ca.paged_attention(q, kc, vc, torch.tensor(qsl), torch.tensor([20, 30], dtype=torch.int32), bt, 0.1)
    for scale in (0.0, -0.1, float("nan")):     # the kernels take the scaled scores' max as scale x their max
        with pytest.raises(RuntimeError, match="scale must be positive"):
            run(q, kc, vc, qsl, [20, 30], bt, scale, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_copy(dtype):
    g = torch.Generator().manual_seed(0)
    N, bs, H, D = 40, 16, 3, 64
    kc, vc = torch.randn(N, bs, H, D, generator=g).to(dtype), torch.randn(N, bs, H, D, generator=g).to(dtype)
    for T in (1, 7, 300):     # 300 tokens: the threaded path
        qkv = torch.randn(T, (9 + 2 * H) * D, generator=g).to(dtype)    # k, v as views of a fused projection
        k, v = qkv[:, 9 * D:(9 + H) * D].view(T, H, D), qkv[:, (9 + H) * D:].view(T, H, D)
        slots = torch.randperm(N * bs, generator=g)[:T]
        want_k, want_v = kc.clone(), vc.clone()
        want_k.view(-1, H, D).index_copy_(0, slots, k)
        want_v.view(-1, H, D).index_copy_(0, slots, v)
        ca.store_kv(k, v, kc, vc, slots)
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    before = kc.clone()
    ca.store_kv(k[:2], v[:2], kc, vc, torch.tensor([-1, 5]))          # -1: padding, skipped
    assert torch.equal(kc.view(-1, H, D)[5], k[1]) and torch.equal(kc.view(-1, H, D)[:5], before.view(-1, H, D)[:5])
    with pytest.raises(RuntimeError, match="past the cache"):
        ca.store_kv(k[:1], v[:1], kc, vc, torch.tensor([N * bs]))


def test_failed_build_warns_once_and_reports(monkeypatch, tmp_path, caplog):
    bad = tmp_path / "bad.cpp"
    bad.write_text("#error this source does not compile\n")
    monkeypatch.setattr(ca, "SOURCE", bad)
    monkeypatch.setattr(ca, "_state", {"tried": False, "ok": False, "error": None, "build_s": None, "path": None})
    monkeypatch.setenv("BATCHRUN_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with caplog.at_level(logging.WARNING, logger=ca.__name__):
        assert ca.load() is False
        assert ca.load() is False
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "torch attention path" in warnings[0].getMessage()
    assert ca.status()["error"]
    with pytest.raises(RuntimeError, match="unavailable"):
        ca.paged_attention(torch.zeros(1, 1, 8), torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8),
                           torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                           torch.zeros(1, 1, dtype=torch.int32), 1.0)


def test_build_directory_is_keyed_and_portable(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHRUN_EXTENSIONS_DIR", str(tmp_path))
    d = ca.build_dir()
    assert d.parent == tmp_path and d.name.startswith(ca.NAME + "-")
    assert not any("march" in f or "mcpu" in f for f in ca._CFLAGS)     # a moved cache stays valid
    assert ca.cpu_isa() in ("avx512", "avx2", "baseline")
    assert ca.attention_isa() in (ca.cpu_isa(), "avx512_bf16")
