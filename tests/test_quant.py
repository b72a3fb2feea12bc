"""Weight-only int8/int4 linear layers (batchrun.models.quant) against their dequantised reference, the
quantizers against their error bound, and engines whose greedy tokens match the dequantised-weights model.

Tolerances: in float32 the kernel and the reference sum the same products in another order, so they agree
to float32 rounding over K terms (rtol 1e-5 of the output's scale). In bfloat16 each side rounds its output
to bfloat16 (a relative step of 2^-8) and the kernels accumulate in float32 while F.linear may round
partial sums, so they agree to 2^-6 of the output's scale."""
import pytest
import torch

from batchrun.models.quant import (INT4_KERNEL_ROWS, INT8_KERNEL_ROWS, QUANT_KERNELS_ENV, Int4Weight,
                                   check_group_size, quantize_int4, quantize_int8)
from conftest import assert_same_greedy_with_env_off
from test_job_common import tiny_model  # noqa: F401 - fixture

TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}


def reference(x, qw, b=None):
    """Dequantise-then-matmul in float32 on the same (rounded) inputs."""
    y = x.float() @ qw.dequantize(torch.float32).T
    return y if b is None else y + b.float()


def check_close(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, rtol=TOL[dtype], atol=TOL[dtype] * scale)


# rows on both sides of the thresholds: int8's kernel / cast-and-matmul, int4's one call / chunks
ROWS = sorted({1, 3, INT8_KERNEL_ROWS, INT8_KERNEL_ROWS + 1, INT4_KERNEL_ROWS + 1, 64})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_int8_linear_equals_dequantised_reference(dtype, rows):
    torch.manual_seed(rows)
    qw = quantize_int8(torch.randn(96, 160), dtype)
    x, b = torch.randn(rows, 160).to(dtype), torch.randn(96).to(dtype)
    check_close(qw.linear(x, b), reference(x, qw, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_linear_equals_dequantised_reference(dtype, rows, group):
    torch.manual_seed(rows + group)
    qw = quantize_int4(torch.randn(200, 256), group, dtype)       # 200 rows: padded to 256 in the packing
    x = torch.randn(rows, 256).to(dtype)
    check_close(qw.linear(x), reference(x, qw), dtype)


def test_int8_round_trip_error_is_at_most_half_a_step():
    w = torch.randn(64, 128) * torch.rand(64, 1) * 3
    qw = quantize_int8(w, torch.float32)
    err = (qw.dequantize() - w).abs()
    assert (err <= qw.scales[:, None] / 2 * (1 + 1e-6)).all()
    assert qw.q.abs().max() == 127            # the largest weight of each row uses the full range


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_error_is_at_most_half_a_step(group):
    w = torch.randn(128, 256)
    qw = quantize_int4(w, group, torch.float32)
    step = qw.scales_and_zeros[..., 0].T.repeat_interleave(group, dim=1)      # [N, K]
    assert ((qw.dequantize() - w).abs() <= step / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("n", [64, 96, 200])
def test_int4_codes_survive_the_packed_layout(n):
    codes = torch.randint(0, 16, (n, 64))
    scales, zeros = torch.rand(n, 2), torch.randn(n, 2)
    qw = Int4Weight(codes, scales, zeros, 32, torch.float32)
    assert torch.equal(qw.codes(), codes.to(torch.int32))
    want = (codes.view(n, 2, 32) - 8) * scales[..., None] + zeros[..., None]
    assert torch.equal(qw.dequantize(), want.view(n, 64))


def test_group_size_must_divide_every_layer():
    cfg = {"hidden_size": 576, "num_attention_heads": 9, "intermediate_size": 1536}     # SmolLM2-135M
    check_group_size(cfg, 64)
    with pytest.raises(ValueError, match=r"quantization_group_size: 128 .*\[576\].*\[32, 64\]"):
        check_group_size(cfg, 128)


def _theoretical_bytes(path, mode, group):
    """Weights in memory from config.json alone: quantized projections (codes and their scales, float32),
    the rest (embedding, norms, biases, an untied head) in float32."""
    import json
    import os
    cfg = json.load(open(os.path.join(path, "config.json")))
    H, I, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    mats = [(q + 2 * kv, H), (H, q), (2 * I, H), (H, I)]
    per_mat = (lambda n, k: n * k + 4 * n) if mode == "int8" else \
        (lambda n, k: -(-n // 64) * 64 * (k // 2 + 8 * (k // group)))     # rows padded to 64, (scale, zero)
    qk_norms = 2 * L * D if cfg["model_type"] == "qwen3" else 0
    dense = V * H * (1 if cfg.get("tie_word_embeddings") else 2) + (2 * L + 1) * H + qk_norms
    return L * sum(per_mat(n, k) for n, k in mats) + 4 * dense


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engine_matches_the_dequantised_weights_model(hf_models, monkeypatch, arch, mode):
    """float32: kernels (and the paths for many rows, which prefill takes) against dequantise-then-F.linear
    for every product; the ledger counts the real bytes."""
    path = hf_models[arch][0]
    kw = {"quantization": mode, "quantization_group_size": 64}
    assert_same_greedy_with_env_off(path, monkeypatch, QUANT_KERNELS_ENV, "quant_kernels", "float32", **kw)
    from batchrun import LLM
    monkeypatch.delenv(QUANT_KERNELS_ENV)
    ledger = LLM(path, dtype="float32", max_num_seqs=4, **kw).engine.memory_ledger
    assert ledger["quantization"] == mode
    assert ledger["weights_bytes"] == _theoretical_bytes(path, mode, 64)


def test_group_size_that_does_not_divide_is_refused_before_loading(hf_models):
    from batchrun import LLM
    from batchrun.models.loader import ModelError
    with pytest.raises(ModelError, match="quantization_group_size: 128 does not divide"):
        LLM(hf_models["llama"][0], dtype="float32", quantization="int4")       # hidden 64


def test_gguf_needs_a_gguf_model(hf_models):
    from batchrun import LLM
    from batchrun.models.loader import ModelError
    with pytest.raises(ModelError, match="quantization: 'gguf' keeps"):
        LLM(hf_models["llama"][0], dtype="float32", quantization="gguf")


@pytest.mark.parametrize("engine,needles", [
    ({"quantization": "int3"}, ["quantization", "int3"]),
    ({"quantization_group_size": 48}, ["quantization_group_size", "48"]),
    ({"quantization": 8}, ["engine.quantization"]),
])
def test_job_file_rejects_bad_quantization_values(tmp_path, tiny_model, engine, needles):  # noqa: F811
    from hostile_util import fails, invoke, job
    from test_job_common import write_prompt_files
    write_prompt_files(str(tmp_path / "in"), 4, files=1)
    fails(invoke("validate", job(tmp_path, tiny_model, "in", engine=engine)), 2, "job.yaml", *needles)


def test_job_file_accepts_the_quantization_keys(tmp_path, tiny_model):  # noqa: F811
    from batchrun.job.spec import load_job
    from hostile_util import job
    spec = load_job(job(tmp_path, tiny_model, "in", engine={"quantization": "int4", "quantization_group_size": 32,
                                                             "quantize_lm_head": True}))
    kw = spec.engine_kwargs()
    assert (kw["quantization"], kw["quantization_group_size"], kw["quantize_lm_head"]) == ("int4", 32, True)


def test_validate_refuses_a_group_the_model_cannot_take(tmp_path, tiny_model):  # noqa: F811
    """Checked at planning, before any weight loads or the output is touched: exit 2 naming the key."""
    from hostile_util import fails, invoke, job
    from test_job_common import write_prompt_files
    write_prompt_files(str(tmp_path / "in"), 4, files=1)
    hidden = __import__("json").load(open(f"{tiny_model}/config.json"))["hidden_size"]
    bad = next(g for g in (128, 64, 32) if hidden % g)
    fails(invoke("validate", job(tmp_path, tiny_model, "in", engine={"quantization": "int4",
                                                                       "quantization_group_size": bad})),
          2, "engine.quantization_group_size", str(bad))


def test_quantization_is_part_of_the_job_fingerprint(tmp_path, tiny_model):  # noqa: F811
    """Quantized outputs differ from dense ones: an output holding one is not resumed by the other."""
    from batchrun.job.plan import make_plan
    from batchrun.job.spec import load_job
    from hostile_util import job
    from test_job_common import write_prompt_files
    write_prompt_files(str(tmp_path / "in"), 4, files=1)
    a = make_plan(load_job(job(tmp_path, tiny_model, "in")), load_tokenizer=False).fingerprint
    b = make_plan(load_job(job(tmp_path, tiny_model, "in", engine={"quantization": "int8"})),
                  load_tokenizer=False).fingerprint
    assert "quantization" not in a["model"] and b["model"]["quantization"] == "int8"
    assert {k: v for k, v in b.items() if k != "model"} == {k: v for k, v in a.items() if k != "model"}


def test_the_group_is_part_of_the_fingerprint_where_it_changes_the_outputs(tmp_path, tiny_model):  # noqa: F811
    """An unset w8a8 quantization_group_size is its default (64): the same fingerprint as the default written
    out, so manifests from before the knob took w8a8 stay valid; another group is another fingerprint, and
    int4's group is always in it."""
    from batchrun.job.plan import make_plan
    from batchrun.job.spec import load_job
    from hostile_util import job
    from test_job_common import write_prompt_files
    write_prompt_files(str(tmp_path / "in"), 4, files=1)

    def model_fp(**engine):
        spec = load_job(job(tmp_path, tiny_model, "in", engine=engine))
        return make_plan(spec, load_tokenizer=False).fingerprint["model"]
    w8 = {"quantization": "w8a8", "quantization_calibration": 2}
    assert model_fp(**w8) == model_fp(**w8, quantization_group_size=64)
    assert "quantization_group_size" not in model_fp(**w8)
    assert len({str(model_fp(**w8, quantization_group_size=g)) for g in (0, 32, 64, 128)}) == 4
    assert model_fp(quantization="int4", quantization_group_size=32)["quantization_group_size"] == 32
