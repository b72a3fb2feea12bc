"""Train a small Llama on a synthetic extraction task whose answers copy spans of the prompt.

Random-init weights never copy from their prompt, so prompt-lookup speculation accepts nothing on
them. This model learns to: a document of "sentences" (random words, each ended by ".") is followed
by `<q> a b c <a>`, where `a b c` opens one of the sentences; the answer is that whole sentence, its
"." and `</s>`. Copying needs an induction head (find `a b c` in the document, continue from there),
which a two-layer model learns in minutes on a CPU. Prompt lookup then finds most of each answer in
the prompt, but not all of it: right after the anchor the most recent match is the question itself,
so acceptance is realistic rather than perfect.

    python scripts/train_copy_model.py --out /tmp/copy-model [--minutes 8] [--target-accuracy 0.995]

Writes config.json, model.safetensors (HF names) and a word-level tokenizer.json; prints one JSON line
with the steps, the loss and the teacher-forced answer-token accuracy on held-out documents.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch

PAD, BOS, EOS, Q, A, DOT = 0, 1, 2, 3, 4, 5
SPECIALS = ["<pad>", "<s>", "</s>", "<q>", "<a>", "."]
NUM_WORDS = 250
VOCAB = len(SPECIALS) + NUM_WORDS


def sample(rng: random.Random, sentences: tuple[int, int] = (2, 4), words: tuple[int, int] = (8, 24),
           questions: int = 1) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of one example; each anchor (first three words) is unique in the document.

    questions > 1 (training only): further `<q> anchor <a> sentence . </s>` pairs follow the first answer
    on the same document, for more copying signal per forward pass.
    """
    while True:
        doc = [[rng.randrange(len(SPECIALS), VOCAB) for _ in range(rng.randint(*words))]
               for _ in range(rng.randint(*sentences))]
        flat = [t for s in doc for t in s + [DOT]]
        unique = [s for s in doc if sum(flat[i:i + 3] == s[:3] for i in range(len(flat) - 2)) == 1]
        if unique:
            break
    pairs = [rng.choice(unique) for _ in range(questions)]
    prompt = [BOS, *flat, Q, *pairs[0][:3], A]
    answer = [*pairs[0], DOT, EOS]
    for s in pairs[1:]:
        answer += [Q, *s[:3], A, *s, DOT, EOS]
    return prompt, answer


def batch(rng: random.Random, size: int, questions: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask, and labels that score only the answer tokens."""
    examples = [sample(rng, questions=questions) for _ in range(size)]
    length = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((size, length), PAD)
    mask = torch.zeros((size, length), dtype=torch.long)
    labels = torch.full((size, length), -100)
    for i, (p, a) in enumerate(examples):
        seq = p + a
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, len(p):len(seq)] = torch.tensor(a)
    return ids, mask, labels


def write_tokenizer(out: str) -> None:
    """A word-level tokenizer over the task's vocabulary: ids are the training ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{j}": len(SPECIALS) + j for j in range(NUM_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")        # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "add_bos_token": True}, f, indent=1)


@torch.no_grad()
def accuracy(model, rng: random.Random, batches: int = 4, size: int = 64) -> float:
    """Teacher-forced accuracy of the next-token argmax over answer tokens of held-out examples."""
    model.eval()
    right = total = 0
    for _ in range(batches):
        ids, mask, labels = batch(rng, size)
        pred = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)
        gold = labels[:, 1:]
        scored = gold != -100
        right += int((pred[scored] == gold[scored]).sum())
        total += int(scored.sum())
    model.train()
    return right / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=8.0, help="training time limit")
    ap.add_argument("--target-accuracy", type=float, default=0.995, help="stop once held-out accuracy reaches it")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import transformers as tf

    torch.manual_seed(args.seed)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=1024, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                         tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train_rng, eval_rng = random.Random(args.seed), random.Random(args.seed + 1_000_003)
    budget = args.minutes * 60
    t0 = time.perf_counter()
    step, acc, loss = 0, 0.0, float("nan")
    while time.perf_counter() - t0 < budget:
        # warm up, then a cosine over the time budget (steps per second are unknown up front)
        frac = (time.perf_counter() - t0) / budget
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        ids, mask, labels = batch(train_rng, args.batch_size, questions=3)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss = out.loss.item()
        if step % 100 == 0:
            acc = accuracy(model, eval_rng)
            print(json.dumps({"step": step, "loss": round(loss, 4), "answer_token_accuracy": round(acc, 4),
                              "elapsed_s": round(time.perf_counter() - t0, 1)}), flush=True)
            if acc >= args.target_accuracy:
                break
    acc = accuracy(model, eval_rng, batches=8)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    write_tokenizer(args.out)
    print(json.dumps({"out": args.out, "steps": step, "loss": round(loss, 4), "answer_token_accuracy": round(acc, 4),
                      "train_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
