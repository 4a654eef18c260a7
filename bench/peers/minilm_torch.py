"""The MiniLM recipe (experiments/minilm-quick.toml) as a short PyTorch script.

The peer pipe-bd's transformer path is compared against: what a user of this
field would write by hand with plain `torch.nn` ops. Same data (Brown
sentences from data/brown, tokenised by the model's own tokenizer.json with
HF `tokenizers`, [CLS] ... [SEP], truncated and padded to `--max-tokens`),
same frozen teacher (all-MiniLM-L6-v2 from data/minilm/model.safetensors:
the embeddings are input preparation, the six post-LN encoder layers the
blocks), same students (post-LN encoder layers with 12 heads of 32 and a
feed-forward of `--ffn`, started from the teacher layer with its
feed-forward cut to the `--ffn` neurons with the largest output weights:
which neurons are kept does not change the speed), same loss (MSE over the
real tokens: per sequence the sum over its real tokens divided by their
number, averaged over sequences and hidden units), Adam (lr 1e-3, eps 1e-8)
with a per-step cosine decay to 0, batch 32. Each block trains on the
teacher's own input to it (blockwise distillation, pipe-bd's `ideal`
schedule). With `--stitched-epochs N`, N epochs of the stitched student
follow (end-to-end: the six student layers chained, every block's loss
against its teacher layer summed, one backward through the chain, lr 3e-4).

    bash bench/peers/setup.sh                   # once: torch and tokenizers into bench/peers/.venv
    bench/peers/.venv/bin/python bench/peers/minilm_torch.py --epochs 1 --train-limit 1024 --threads 2

Prints one JSON object: samples/s of the blockwise training (and of the
stitched pass when run), per-block final losses (mean of the last 20
steps, as pipe-bd reports them) and per-block median times (ms) of the
teacher layer's forward and the student's step.
"""

import argparse
import json
import math
import os
import random
import statistics
import struct
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, HEADS, HEAD_DIM, LAYERS = 384, 12, 32, 6
# Added to the attention scores of padding keys (pipe-bd's MASKED_SCORE).
MASKED_SCORE = -1.0e9
LAYER_NORM_EPS = 1e-12
# pipe-bd's Brown split: one sentence in ten held out.
HELDOUT_EVERY = 10


def read_safetensors(path):
    """The F32 tensors of a safetensors file, by name (the format is an
    8-byte header length, a JSON header, then the raw data)."""
    with open(path, "rb") as f:
        blob = f.read()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    data = memoryview(blob)[8 + size :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        start, end = info["data_offsets"]
        tensors[name] = torch.frombuffer(bytearray(data[start:end]), dtype=torch.float32).reshape(info["shape"])
    return tensors


def strip_tags(line):
    """`The/at jury/nn said/vbd ./.` -> `The jury said .` (pipe-bd's strip_tags)."""
    words = []
    for pair in line.split():
        word = pair.rsplit("/", 1)[0] if "/" in pair else pair
        words.append('"' if word in ("``", "''") else word)
    return " ".join(words)


def brown_sentences(dir_, limit, seed):
    """Training sentences of the Brown corpus: every non-empty line of the
    files ca01 ... cr09, shuffled, one in ten held out, cut to `limit`."""
    try:
        names = sorted(n for n in os.listdir(dir_) if len(n) == 4 and n[0] == "c" and "a" <= n[1] <= "r"
                       and n[2:].isdigit())
    except FileNotFoundError:
        names = []
    if not names:
        sys.exit(f"{dir_}: no Brown corpus files (run scripts/setup-data.sh)")
    sentences = []
    for name in names:
        with open(os.path.join(dir_, name)) as f:
            sentences.extend(s for s in map(strip_tags, f) if s)
    random.Random(seed).shuffle(sentences)
    train = [s for i, s in enumerate(sentences) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    return train[:limit] if limit else train


def tokenize(tokenizer_path, sentences, max_tokens):
    """Padded ids and mask `[n, max_tokens]`: [CLS] ... [SEP], truncated
    with [SEP] kept last (as sentence-transformers and pipe-bd truncate)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    sep = tokenizer.token_to_id("[SEP]")
    ids = torch.zeros(len(sentences), max_tokens, dtype=torch.long)
    mask = torch.zeros(len(sentences), max_tokens)
    for i, encoding in enumerate(tokenizer.encode_batch(sentences)):
        seq = encoding.ids
        if len(seq) > max_tokens:
            seq = seq[: max_tokens - 1] + [sep]
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1.0
    return ids, mask


class Embeddings(nn.Module):
    """BERT's input embeddings: word + position + token type 0, LayerNorm."""

    def __init__(self, weights):
        super().__init__()
        prefix = "embeddings."
        self.word = nn.Embedding.from_pretrained(weights[prefix + "word_embeddings.weight"])
        self.position = nn.Embedding.from_pretrained(weights[prefix + "position_embeddings.weight"])
        self.token_type = nn.Embedding.from_pretrained(weights[prefix + "token_type_embeddings.weight"])
        self.norm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.norm.weight.data.copy_(weights[prefix + "LayerNorm.weight"])
        self.norm.bias.data.copy_(weights[prefix + "LayerNorm.bias"])

    def forward(self, ids):
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        return self.norm(self.word(ids) + self.position(positions) + self.token_type(torch.zeros_like(positions)))


class EncoderLayer(nn.Module):
    """A post-LN BERT encoder layer: multi-head attention over the real
    tokens, then a GELU feed-forward, each with a residual and a LayerNorm."""

    def __init__(self, ffn, heads=HEADS, head_dim=HEAD_DIM):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.query, self.key, self.value = (nn.Linear(HIDDEN, inner) for _ in range(3))
        self.attn_out = nn.Linear(inner, HIDDEN)
        self.attn_norm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.ffn_in = nn.Linear(HIDDEN, ffn)
        self.ffn_out = nn.Linear(ffn, HIDDEN)
        self.ffn_norm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)

    def load_teacher(self, weights, layer, keep=None):
        """Copies teacher layer `layer`; `keep` (indices of feed-forward
        neurons) cuts the feed-forward to those neurons."""
        p = f"encoder.layer.{layer}."
        pairs = [
            (self.query, p + "attention.self.query"),
            (self.key, p + "attention.self.key"),
            (self.value, p + "attention.self.value"),
            (self.attn_out, p + "attention.output.dense"),
            (self.attn_norm, p + "attention.output.LayerNorm"),
            (self.ffn_in, p + "intermediate.dense"),
            (self.ffn_out, p + "output.dense"),
            (self.ffn_norm, p + "output.LayerNorm"),
        ]
        with torch.no_grad():
            for module, name in pairs:
                weight, bias = weights[name + ".weight"], weights[name + ".bias"]
                if keep is not None and module is self.ffn_in:
                    weight, bias = weight[keep], bias[keep]
                elif keep is not None and module is self.ffn_out:
                    weight = weight[:, keep]
                module.weight.copy_(weight)
                module.bias.copy_(bias)
        return self

    def forward(self, x, mask):
        batch, tokens, _ = x.shape
        split = lambda t: t.view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        bias = ((1.0 - mask) * MASKED_SCORE).view(batch, 1, 1, tokens)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + bias
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, tokens, self.heads * self.head_dim)
        h = self.attn_norm(self.attn_out(context) + x)
        return self.ffn_norm(self.ffn_out(F.gelu(self.ffn_in(h))) + h)


def masked_mse(student, teacher, mask):
    """Per sequence the squared error summed over its real tokens and divided
    by their number; averaged over sequences and hidden units."""
    real = mask.sum(1).clamp_min(1.0)
    per_token = ((student - teacher) ** 2).sum(2) * mask
    return (per_token.sum(1) / real).mean() / student.shape[2]


def cosine_lr(base, step, total):
    return 0.5 * base * (1 + math.cos(math.pi * step / total))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/brown")
    parser.add_argument("--model", default="data/minilm", help="folder with model.safetensors and tokenizer.json")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--stitched-epochs", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--stitched-lr", type=float, default=3e-4)
    parser.add_argument("--train-limit", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    weights = read_safetensors(os.path.join(args.model, "model.safetensors"))
    sentences = brown_sentences(args.data, args.train_limit, args.seed)
    ids, mask = tokenize(os.path.join(args.model, "tokenizer.json"), sentences, args.max_tokens)
    embeddings = Embeddings(weights).eval().requires_grad_(False)
    teacher = [EncoderLayer(1536).load_teacher(weights, k).eval().requires_grad_(False) for k in range(LAYERS)]
    students = []
    for k in range(LAYERS):
        strength = weights[f"encoder.layer.{k}.output.dense.weight"].norm(dim=0)
        keep = strength.argsort(descending=True)[: args.ffn].sort().values
        students.append(EncoderLayer(args.ffn).load_teacher(weights, k, keep))
    optimizers = [torch.optim.Adam(s.parameters(), lr=args.lr, eps=1e-8) for s in students]

    per_epoch = len(ids) // args.batch_size
    if per_epoch == 0:
        sys.exit(f"{len(ids)} sentences: fewer than one batch of {args.batch_size}")
    total = per_epoch * args.epochs
    history = [[] for _ in students]
    timings = [([], []) for _ in students]  # per block: teacher forward, student step (seconds)
    start = time.perf_counter()
    step = 0
    for _ in range(args.epochs):
        order = torch.randperm(len(ids))
        for b in range(per_epoch):
            rows = order[b * args.batch_size : (b + 1) * args.batch_size]
            m = mask[rows]
            with torch.no_grad():
                x = embeddings(ids[rows])
            lr = cosine_lr(args.lr, step, total)
            for k, (t, s, opt) in enumerate(zip(teacher, students, optimizers)):
                t0 = time.perf_counter()
                with torch.no_grad():
                    y = t(x, m)
                t1 = time.perf_counter()
                for group in opt.param_groups:
                    group["lr"] = lr
                loss = masked_mse(s(x, m), y, m)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                history[k].append(loss.item())
                timings[k][0].append(t1 - t0)
                timings[k][1].append(time.perf_counter() - t1)
                x = y
            step += 1
    seconds = time.perf_counter() - start
    result = {
        "peer": f"pytorch {torch.__version__} eager",
        "threads": args.threads,
        "epochs": args.epochs,
        "train_samples": len(ids),
        "max_tokens": args.max_tokens,
        "steps": total,
        "train_seconds": seconds,
        "samples_per_second": total * args.batch_size / seconds,
        "final_losses": [sum(h[-20:]) / len(h[-20:]) for h in history],
        "block_ms": [
            {"teacher_forward": 1e3 * statistics.median(f), "student_step": 1e3 * statistics.median(s)}
            for f, s in timings
        ],
    }
    if args.stitched_epochs:
        result.update(stitched(args, embeddings, teacher, students, ids, mask))
    print(json.dumps(result))


def stitched(args, embeddings, teacher, students, ids, mask):
    """End-to-end epochs of the chained students: each block's loss against
    its teacher layer's output, summed, one backward through the chain."""
    params = [p for s in students for p in s.parameters()]
    opt = torch.optim.Adam(params, lr=args.stitched_lr, eps=1e-8)
    per_epoch = len(ids) // args.batch_size
    total = per_epoch * args.stitched_epochs
    start = time.perf_counter()
    step = 0
    for _ in range(args.stitched_epochs):
        order = torch.randperm(len(ids))
        for b in range(per_epoch):
            rows = order[b * args.batch_size : (b + 1) * args.batch_size]
            m = mask[rows]
            with torch.no_grad():
                targets = [embeddings(ids[rows])]
                for t in teacher:
                    targets.append(t(targets[-1], m))
            for group in opt.param_groups:
                group["lr"] = cosine_lr(args.stitched_lr, step, total)
            x, loss = targets[0], 0.0
            for k, s in enumerate(students):
                x = s(x, m)
                loss = loss + masked_mse(x, targets[k + 1], m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    seconds = time.perf_counter() - start
    return {"stitched_seconds": seconds, "stitched_samples_per_second": total * args.batch_size / seconds}


if __name__ == "__main__":
    main()
