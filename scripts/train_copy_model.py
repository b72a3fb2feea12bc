"""Train a small Llama that copies spans of its prompt, for measuring prompt-lookup speculation.

Random-init weights never repeat their prompt, so n-gram drafts would never be accepted. This script trains
(CPU, a few minutes) a LlamaForCausalLM on a synthetic extraction task over raw token ids:

    <s> k3 v v v ; k7 v v v v v ; k1 v v ; ... Q k7 k3 A  ->  k7 v v v v v ; k3 v v v ; </s>

The prompt is a record of fields (a key token, a value span of word tokens, a separator), then a query
listing some of its keys (all of them, shuffled, makes it a reorder rewrite). The answer repeats each
requested field, value span copied verbatim, in query order, then EOS. Loss is on the answer tokens only.
The held-out greedy exact-match accuracy is printed and saved with the task settings in
DIR/copy_task.json, which scripts/bench_spec.py reads to draw prompts of the same task.

The tokenizer (batchrun.demo.build_tokenizer, same vocab size) is there so the engine can load the
directory; prompts are token ids, their decoded text is meaningless.

    python scripts/train_copy_model.py --out /tmp/copy-model [--steps 600] [--max-seconds 300]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass

import torch

BOS, EOS, SEP, QUERY, ANSWER = 1, 2, 3, 4, 5
KEY0 = 8          # key tokens are KEY0 .. KEY0 + num_keys - 1
WORD0 = 64        # value words are WORD0 .. vocab_size - 1


@dataclass
class CopyTask:
    """Shape of the synthetic extraction task; every prompt and answer is drawn from it."""
    vocab_size: int = 512
    num_keys: int = 24
    fields: tuple[int, int] = (4, 8)       # fields per record (inclusive range)
    value_len: tuple[int, int] = (3, 16)   # words per value span (inclusive range)
    num_words: int = 0                     # value words WORD0 .. WORD0 + num_words - 1 (0: up to vocab_size)

    def __post_init__(self) -> None:
        self.fields, self.value_len = tuple(self.fields), tuple(self.value_len)
        if self.num_words == 0:
            self.num_words = self.vocab_size - WORD0
        if not 16 <= self.num_words <= self.vocab_size - WORD0:
            raise ValueError(f"num_words={self.num_words} must lie in 16..vocab_size-{WORD0}="
                             f"{self.vocab_size - WORD0}")
        if not KEY0 + self.num_keys <= WORD0:
            raise ValueError(f"num_keys={self.num_keys} must fit in ids {KEY0}..{WORD0 - 1}")
        if not 1 <= self.fields[0] <= self.fields[1] <= self.num_keys:
            raise ValueError(f"fields={self.fields} must lie in 1..num_keys={self.num_keys}")
        if not 1 <= self.value_len[0] <= self.value_len[1]:
            raise ValueError(f"value_len={self.value_len} must be an increasing range >= 1")

    def sample(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """One (prompt, answer) pair of token ids; the answer ends with EOS."""
        keys = rng.sample(range(KEY0, KEY0 + self.num_keys), rng.randint(*self.fields))
        values = {k: [rng.randrange(WORD0, WORD0 + self.num_words) for _ in range(rng.randint(*self.value_len))]
                  for k in keys}
        asked = rng.sample(keys, rng.randint(1, len(keys)))
        prompt = [BOS]
        for k in keys:
            prompt += [k, *values[k], SEP]
        prompt += [QUERY, *asked, ANSWER]
        answer = []
        for k in asked:
            answer += [k, *values[k], SEP]
        return prompt, answer + [EOS]

    def max_len(self) -> int:
        field = self.value_len[1] + 2
        return 1 + self.fields[1] * (2 * field + 1) + 3


def batch_tensors(pairs: list[tuple[list[int], list[int]]]):
    """Right-padded input ids, attention mask and labels (-100 except on answer tokens)."""
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.zeros(len(pairs), width, dtype=torch.long)
    mask = torch.zeros(len(pairs), width, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for i, (p, a) in enumerate(pairs):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(a)   # HF shifts labels inside the loss
    return ids, mask, labels


def length_bucketed(task: CopyTask, rng: random.Random, batch_size: int, pool: int = 8) -> list:
    """`pool` batches cut from length-sorted samples, shuffled: padding stays small, so steps are cheap."""
    pairs = sorted((task.sample(rng) for _ in range(batch_size * pool)), key=lambda pa: len(pa[0]) + len(pa[1]))
    batches = [pairs[i:i + batch_size] for i in range(0, len(pairs), batch_size)]
    rng.shuffle(batches)
    return batches


@torch.no_grad()
def greedy_accuracy(model, task: CopyTask, n: int, seed: int) -> dict:
    """Greedy answers of `n` held-out prompts against the true answers (exact match and per token)."""
    rng = random.Random(seed)
    exact = tok_ok = tok_all = 0
    model.eval()
    for _ in range(n):
        prompt, answer = task.sample(rng)
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=len(answer) + 4, do_sample=False, eos_token_id=EOS, pad_token_id=0)
        got = out[0, len(prompt):].tolist()
        exact += got[:len(answer)] == answer
        tok_ok += sum(g == t for g, t in zip(got, answer))
        tok_all += len(answer)
    return {"exact_match": exact / n, "token_accuracy": tok_ok / tok_all, "eval_prompts": n,
            "mean_answer_tokens": tok_all / n}


def train(out: str, *, steps: int, batch_size: int, lr: float, layers: int, hidden: int, heads: int,
          kv_heads: int, intermediate: int, task: CopyTask, seed: int, eval_prompts: int,
          max_seconds: float, log_every: int = 50) -> dict:
    """Train, evaluate on held-out prompts, save model + tokenizer + copy_task.json to `out`; return the report."""
    import transformers as tf
    from batchrun.demo import build_tokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    max_pos = 1 << max(9, math.ceil(math.log2(task.max_len())))
    cfg = tf.LlamaConfig(vocab_size=task.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_pos, rms_norm_eps=1e-5, rope_theta=10000.0,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, min(50, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    t0 = time.perf_counter()
    model.train()
    done = 0
    batches: list = []
    for step in range(steps):
        if not batches:
            batches = length_bucketed(task, rng, batch_size)
        ids, mask, labels = batch_tensors(batches.pop())
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        done = step + 1
        elapsed = time.perf_counter() - t0
        if step % log_every == 0 or done == steps:
            print(f"step {done}/{steps} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} {elapsed:.0f}s",
                  flush=True)
        if elapsed > max_seconds:
            print(f"stopping at step {done}: --max-seconds {max_seconds:g} reached", flush=True)
            break
    train_s = time.perf_counter() - t0
    acc = greedy_accuracy(model, task, eval_prompts, seed + 1_000_003)   # a seed the training draws never use
    report = {"task": asdict(task), "train_steps": done, "train_seconds": round(train_s, 1),
              "final_loss": round(loss.item(), 4), **acc}
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(out, vocab_size=task.vocab_size)
    with open(os.path.join(out, "copy_task.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    return report


def load_task(model_dir: str) -> CopyTask:
    """The CopyTask a model directory was trained on (its copy_task.json)."""
    path = os.path.join(model_dir, "copy_task.json")
    try:
        with open(path, encoding="utf-8") as f:
            return CopyTask(**json.load(f)["task"])
    except FileNotFoundError:
        raise SystemExit(f"{path} not found: train the model with scripts/train_copy_model.py --out {model_dir}")
    except (KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"{path}: bad 'task' entry ({e})")


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--num-keys", type=int, default=24)
    ap.add_argument("--fields", type=int, nargs=2, default=[4, 8], metavar=("MIN", "MAX"))
    ap.add_argument("--value-len", type=int, nargs=2, default=[3, 16], metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-prompts", type=int, default=100)
    ap.add_argument("--max-seconds", type=float, default=300.0, help="stop training early past this")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def run_from_args(out: str, args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    task = CopyTask(args.vocab_size, args.num_keys, tuple(args.fields), tuple(args.value_len))
    return train(out, steps=args.steps, batch_size=args.batch_size, lr=args.lr, layers=args.layers,
                 hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate,
                 task=task, seed=args.seed, eval_prompts=args.eval_prompts, max_seconds=args.max_seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="model directory to write")
    add_args(ap)
    args = ap.parse_args()
    report = run_from_args(args.out, args)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
