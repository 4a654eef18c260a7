"""The SmolLM2 recipes (experiments/smollm2-quick.toml, experiments/smollm2-chosen.toml) as a short PyTorch script.

The peer pipe-bd's decoder path is timed against: what a user of this field
would write by hand with plain `torch.nn` ops, float32 on the CPU. Same
teacher (SmolLM2-135M-Instruct from its Q4_1 GGUF file, dequantized to
float32 with `gguf`'s quant helpers; the query/key rows stay in the file's
interleaved order and the rotary positions turn adjacent pairs
`(x[2i], x[2i+1])` by `pos * base^(-2i/head_dim)`, as pipe-bd does; the rope
base and RMSNorm epsilon come from the file's metadata), same data (Brown
sentences from data/brown: a fixed seeded shuffle, one in ten held out, not
pipe-bd's order; tokenised by smollm2_reference.py's pure-Python byte-level
BPE without BOS, truncated and right-padded to `--max-tokens`, mask 1 for
real tokens), batch 16.

`--mode blockwise`, smollm2-quick.toml's blockwise epoch: 30 students, each
a copy of its teacher layer, the SwiGLU of layers 13-24 (1-based) cut to
`--ffn` neurons (ranked as pipe-bd ranks them, on the first 64 sentences;
the values do not change the speed). A step runs the teacher's 30 layers
under no_grad, recording each layer's input and output; then each
student layer takes the teacher's input to it and steps on the masked MSE to
the teacher's output (pipe-bd's `masked_mse`: per sequence the squared error
summed over its real tokens and divided by their number, averaged over
sequences and hidden units), each layer with its own torch.optim.Adam (lr
5e-5, eps 1e-8, a per-step cosine decay to 0 over the run).

`--mode stitched`, smollm2-chosen.toml's stitched pass: the 0.74x student
(layers 1-7, 11 and 25 whole, the SwiGLU of the 21 others cut to `--ffn`
neurons, ranked the same way but without the least-squares refit of
pipe-bd's `init = "teacher"`, so its KL starts higher; the values do not
change the speed). A step embeds the batch
(frozen token embeddings), runs the student end to end through its 30 layers
and the teacher's 30 under no_grad, puts both final states through the
frozen final RMSNorm and tied LM head, and takes the weighted mean over rows
of KL(softmax(teacher) || softmax(student)) at temperature 1 (position i
counts when token i + 1 is real, as pipe-bd's `NextTokenHead`); backward
through the head (input gradients only) and the 30 student layers, one
torch.optim.Adam over all of them (lr 2e-4, eps 1e-8, cosine decay).

    bash bench/peers/setup.sh         # once: torch, gguf, numpy, regex into bench/peers/.venv
    bench/peers/.venv/bin/python bench/peers/smollm2_torch.py --mode blockwise --steps 20 --threads 2
    bench/peers/.venv/bin/python bench/peers/smollm2_torch.py --mode stitched --steps 20 --threads 2

`--device cuda` runs it on the GPU, with the step clock read after the GPU
is done (scripts/gpu-bench.sh). `--model` may be a file of SmolLM2's first
layers (`pipebd export --teacher ... --first-layers N`): the teacher is
then those N layers, each with its student (widths as the recipe gives its
layer).

Runs `--warmup` (2) steps, then `--steps` timed ones, logging each step's
time and loss to stderr. Prints one JSON object on the last line of stdout:
steady-state samples/s and median seconds per step (warm-up skipped), the
rate over every step (warm-up included, as pipe-bd's report times its whole
loop), the FLOPs of a step and the GFLOP/s achieved, the first and last
losses. `--check` first scores the teacher as smollm2_reference.py does: the
next-token perplexity of the first 64 sentences of Brown ca01 at 64 tokens
(178.75 in tests/data/smollm2-reference.json).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import gguf
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from minilm_torch import brown_sentences  # noqa: E402  (the same Brown reading and split)
import smollm2_reference as reference  # noqa: E402  (the GGUF tokenizer and metadata reader)

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 576, 30, 9, 3, 64, 1536, 49152
# Added to the attention scores of masked keys (pipe-bd's MASKED_SCORE).
MASKED_SCORE = -1.0e9
# smollm2-quick.toml: the 1-based layers whose SwiGLU is cut to `--ffn`.
BLOCKWISE_PRUNED = set(range(13, 25))
# smollm2-chosen.toml: the 1-based layers kept whole (the others' SwiGLU cut).
STITCHED_WHOLE = {1, 2, 3, 4, 5, 6, 7, 11, 25}
# Calibration sentences that rank the SwiGLU neurons (the first ones of the data).
CALIBRATION = 64
# The recipes' learning rates.
LR = {"blockwise": 5e-5, "stitched": 2e-4}


def load_teacher_weights(path):
    """The GGUF file's tensors as float32 torch tensors by name (`[out, in]`
    for projections) and its hyper-parameters, checked against SmolLM2-135M's."""
    reader = gguf.GGUFReader(path)
    # `llama`, or `deci` (pipe-bd's exports: per-layer sizes, here all alike).
    arch = reference.field(reader, "general.architecture")

    def size(key):
        f = reader.fields[f"{arch}.{key}"]
        values = {f.parts[i].tolist()[0] for i in f.data}
        if len(values) != 1:
            sys.exit(f"{path}: {arch}.{key} differs from layer to layer ({sorted(values)}): not SmolLM2's layers")
        return values.pop()

    meta = {
        "layers": size("block_count"),
        "hidden": size("embedding_length"),
        "heads": size("attention.head_count"),
        "kv_heads": size("attention.head_count_kv"),
        "ffn": size("feed_forward_length"),
        "rope_base": float(size("rope.freq_base")),
        "eps": float(size("attention.layer_norm_rms_epsilon")),
    }
    expected = {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS, "ffn": FFN}
    for key, value in expected.items():
        if meta[key] != value:
            sys.exit(f"{path}: {key} is {meta[key]}, SmolLM2-135M has {value}")
    # SmolLM2-135M's 30 layers, or its first ones (the cut teacher scripts/gpu-pack.sh writes).
    if not 1 <= meta["layers"] <= LAYERS:
        sys.exit(f"{path}: {meta['layers']} layers, expected SmolLM2-135M's {LAYERS} or its first ones")
    weights = {}
    for t in reader.tensors:
        values = np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32, order="C", copy=True)
        weights[t.name] = torch.from_numpy(values)
    if "output.weight" in weights:
        sys.exit(f"{path}: expected the LM head tied to token_embd (found output.weight)")
    if tuple(weights["token_embd.weight"].shape) != (VOCAB, HIDDEN):
        sys.exit(f"{path}: token_embd is {tuple(weights['token_embd.weight'].shape)}, expected {(VOCAB, HIDDEN)}")
    return reader, meta, weights


def pad(sequences, max_tokens):
    """Ids and mask `[n, max_tokens]`: each sequence truncated, padded with 0
    on the right; mask 1 for real tokens."""
    ids = torch.zeros(len(sequences), max_tokens, dtype=torch.long)
    mask = torch.zeros(len(sequences), max_tokens)
    for i, seq in enumerate(sequences):
        seq = seq[:max_tokens]
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, : len(seq)] = 1.0
    return ids, mask


def rope_tables(tokens, base):
    """Cosines and sines of the rotary angles `pos * base^(-2i/head_dim)`, `[tokens, head_dim / 2]`."""
    i = torch.arange(HEAD_DIM // 2, dtype=torch.float64)
    angles = torch.arange(tokens, dtype=torch.float64)[:, None] * base ** (-2.0 * i / HEAD_DIM)[None, :]
    return angles.cos().float(), angles.sin().float()


def rotate(x, cos, sin):
    """Turns the adjacent pairs `(x[2i], x[2i+1])` of `x` `[batch, heads, tokens, head_dim]`."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def attention_bias(mask):
    """`[batch, 1, tokens, tokens]`: 0 where query i may see key j (j <= i and
    j real), MASKED_SCORE elsewhere."""
    tokens = mask.shape[1]
    causal = torch.full((tokens, tokens), MASKED_SCORE, device=mask.device).triu(1)
    return causal.view(1, 1, tokens, tokens) + ((1.0 - mask) * MASKED_SCORE).view(-1, 1, 1, tokens)


class DecoderLayer(nn.Module):
    """A pre-norm Llama layer: RMSNorm, grouped-query causal attention with
    rotary positions, a residual; RMSNorm, SwiGLU, a residual. No biases."""

    def __init__(self, ffn, eps):
        super().__init__()
        self.attn_norm = nn.RMSNorm(HIDDEN, eps=eps)
        self.query = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.key = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.value = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.attn_out = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.ffn_norm = nn.RMSNorm(HIDDEN, eps=eps)
        self.gate = nn.Linear(HIDDEN, ffn, bias=False)
        self.up = nn.Linear(HIDDEN, ffn, bias=False)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)

    def load_teacher(self, weights, layer, keep=None):
        """Copies teacher layer `layer` (0-based); `keep` (indices of SwiGLU
        neurons) cuts the feed-forward to those neurons."""
        p = f"blk.{layer}."
        pairs = [(self.attn_norm, "attn_norm"), (self.query, "attn_q"), (self.key, "attn_k"),
                 (self.value, "attn_v"), (self.attn_out, "attn_output"), (self.ffn_norm, "ffn_norm"),
                 (self.gate, "ffn_gate"), (self.up, "ffn_up"), (self.down, "ffn_down")]
        with torch.no_grad():
            for module, name in pairs:
                weight = weights[p + name + ".weight"]
                if keep is not None and module in (self.gate, self.up):
                    weight = weight[keep]
                elif keep is not None and module is self.down:
                    weight = weight[:, keep]
                module.weight.copy_(weight)
        return self

    def forward(self, x, bias, cos, sin):
        h = self.after_attention(x, bias, cos, sin)
        return h + self.down(self.activations(h))

    def activations(self, h):
        """The SwiGLU's hidden activations `SiLU(gate * n2(h)) * up * n2(h)`."""
        n = self.ffn_norm(h)
        return F.silu(self.gate(n)) * self.up(n)

    def after_attention(self, x, bias, cos, sin):
        """The residual stream after the attention half."""
        batch, tokens, _ = x.shape
        split = lambda y, heads: y.view(batch, tokens, heads, HEAD_DIM).transpose(1, 2)
        n = self.attn_norm(x)
        q = rotate(split(self.query(n), HEADS), cos, sin)
        k = rotate(split(self.key(n), KV_HEADS), cos, sin)
        v = split(self.value(n), KV_HEADS)
        # Each key/value head serves HEADS / KV_HEADS consecutive query heads.
        group = HEADS // KV_HEADS
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(HEAD_DIM) + bias
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, tokens, HEADS * HEAD_DIM)
        return x + self.attn_out(context)


class LmHead(nn.Module):
    """The final RMSNorm and the LM head tied to the token embeddings (frozen)."""

    def __init__(self, weights, eps):
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN, eps=eps)
        with torch.no_grad():
            self.norm.weight.copy_(weights["output_norm.weight"])
        self.embed = nn.Parameter(weights["token_embd.weight"], requires_grad=False)

    def forward(self, hidden):
        return F.linear(self.norm(hidden), self.embed)


def masked_mse(student, teacher, mask):
    """Per sequence the squared error summed over its real tokens and divided
    by their number; averaged over sequences and hidden units (pipe-bd's
    masked_mse)."""
    real = mask.sum(1).clamp_min(1.0)
    per_token = ((student - teacher) ** 2).sum(2) * mask
    return (per_token.sum(1) / real).mean() / student.shape[2]


def next_token_weights(mask):
    """`[batch * tokens]`: 1 where position i has a real next token i + 1."""
    return torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1).reshape(-1)


def weighted_kl(student, teacher, weights):
    """Weighted mean over rows of KL(softmax(teacher) || softmax(student)) at
    temperature 1 (pipe-bd's weighted_kl); no gradient into the teacher."""
    student = F.log_softmax(student, -1)
    teacher = F.log_softmax(teacher.detach(), -1)
    per_row = (teacher.exp() * (teacher - student)).sum(-1)
    return (per_row * weights).sum() / weights.sum().clamp_min(1e-12)


def layer_flops(tokens, ffn):
    """Forward FLOPs of one decoder layer on one sequence of `tokens` tokens,
    2 per multiply-accumulate: the q, k, v and output projections and the
    SwiGLU's gate, up and down projections on every token (padding
    included), and attention's QK^T and PV with every query against every key
    (a dense kernel: the causal mask skips no work). Norms, rotary, softmax
    and SiLU not counted. The same count as pipe-bd's DecoderLayerConfig::flops."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    projections = 2 * tokens * (HIDDEN * q + 2 * HIDDEN * kv + q * HIDDEN + 3 * HIDDEN * ffn)
    attention = 2 * 2 * tokens * tokens * q  # QK^T and PV
    return projections + attention


def step_flops(mode, widths, batch, tokens):
    """FLOPs of one training step at `batch` sequences of `tokens` tokens,
    students with SwiGLU widths `widths` (one per teacher layer):
      teacher: its layers forward (no gradients);
      students: forward, plus a backward of twice the forward (the input and
        the weight gradient of every matmul: 3x the forward in all);
      stitched only: the LM head (`2 * tokens * hidden * vocab` per sequence)
        forward on the teacher's and the student's final states, plus the
        input gradient through it on the student's side (the head is frozen:
        no weight gradient), so 3x one head forward in all."""
    teacher = len(widths) * layer_flops(tokens, FFN)
    students = sum(layer_flops(tokens, w) for w in widths)
    per_sequence = teacher + 3 * students
    if mode == "stitched":
        head = 2 * tokens * HIDDEN * VOCAB
        per_sequence += head + 2 * head
    return batch * per_sequence


def student_widths(mode, ffn, layers=LAYERS):
    """The SwiGLU width of each student layer (one per teacher layer)."""
    if mode == "blockwise":
        return [ffn if k in BLOCKWISE_PRUNED else FFN for k in range(1, layers + 1)]
    return [FFN if k in STITCHED_WHOLE else ffn for k in range(1, layers + 1)]


def ffn_importance(embedding, teacher, ids, mask, cos, sin):
    """Per teacher layer, how much each SwiGLU neuron moves the residual
    stream on the calibration sentences `ids`: the root mean square of
    `SiLU(gate) * up` over the real tokens times the norm of the neuron's
    down-projection column (pipe-bd's ffn_importance, which picks the neurons
    a pruned layer keeps; pipe-bd then refits the layer by least squares,
    which this peer does not)."""
    scores = []
    with torch.no_grad():
        x, bias = embedding(ids), attention_bias(mask)
        real = mask.unsqueeze(2)
        for layer in teacher:
            act = layer.activations(layer.after_attention(x, bias, cos, sin))
            rms = ((act ** 2 * real).sum((0, 1)) / real.sum().clamp_min(1.0)).sqrt()
            scores.append(rms * layer.down.weight.norm(dim=0))
            x = layer(x, bias, cos, sin)
    return scores


def cosine_lr(base, step, total):
    return 0.5 * base * (1 + math.cos(math.pi * step / total))


def check_teacher(reader_tok, embedding, teacher, head, rope_base, brown_dir):
    """The teacher's next-token perplexity on the first 64 sentences of Brown
    ca01 at 64 tokens (smollm2_reference.py's figure), in padded batches of 16
    (so the padding mask is exercised too)."""
    sentences = reference.brown_sentences(os.path.join(brown_dir, "ca01"), reference.PPL_SENTENCES)
    tokens = reference.PPL_MAX_TOKENS
    ids, mask = pad([reader_tok.encode(s) for s in sentences], tokens)
    cos, sin = rope_tables(tokens, rope_base)
    nll, predicted = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), 16):
            i, m = ids[start : start + 16], mask[start : start + 16]
            x, bias = embedding(i), attention_bias(m)
            for layer in teacher:
                x = layer(x, bias, cos, sin)
            logp = F.log_softmax(head(x), -1)[:, :-1]
            target = logp.gather(2, i[:, 1:].unsqueeze(2)).squeeze(2)
            nll -= float((target * m[:, 1:]).sum())
            predicted += int(m[:, 1:].sum())
    return {"file": "ca01", "sentences": len(sentences), "max_tokens": tokens, "predicted_tokens": predicted,
            "mean_nll": nll / predicted, "perplexity": math.exp(nll / predicted)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["blockwise", "stitched"], default="blockwise",
                        help="smollm2-quick.toml's blockwise epoch, or smollm2-chosen.toml's stitched pass")
    parser.add_argument("--data", default="data/brown")
    parser.add_argument("--model", default="data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=768, help="SwiGLU width of the pruned layers")
    parser.add_argument("--lr", type=float, help="Adam's peak lr (default: 5e-5 blockwise, 2e-4 stitched)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (scripts/gpu-bench.sh)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--check", action="store_true", help="first, the teacher's perplexity on Brown ca01")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        sys.exit("--steps must be >= 1 and --warmup >= 0")
    lr = args.lr if args.lr is not None else LR[args.mode]

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU")
    # Step times count the GPU's work too: wait for it before reading the clock.
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    load_start = time.perf_counter()
    reader, meta, weights = load_teacher_weights(args.model)
    tokenizer = reference.Tokenizer(reader)
    eps, rope_base = meta["eps"], meta["rope_base"]
    layers = meta["layers"]
    embedding = nn.Embedding.from_pretrained(weights["token_embd.weight"], freeze=True).to(device)
    head = LmHead(weights, eps).eval().requires_grad_(False).to(device)
    teacher = [DecoderLayer(FFN, eps).load_teacher(weights, k).eval().requires_grad_(False).to(device)
               for k in range(layers)]
    total = args.warmup + args.steps
    sentences = brown_sentences(args.data, total * args.batch_size, args.seed)
    if len(sentences) < total * args.batch_size:
        sys.exit(f"{len(sentences)} Brown sentences: fewer than {total} batches of {args.batch_size}")
    ids, mask = pad([tokenizer.encode(s) for s in sentences], args.max_tokens)
    ids, mask = ids.to(device), mask.to(device)
    cos, sin = (t.to(device) for t in rope_tables(args.max_tokens, rope_base))
    widths = student_widths(args.mode, args.ffn, layers)
    importance = ffn_importance(embedding, teacher, ids[:CALIBRATION], mask[:CALIBRATION], cos, sin)
    students = []
    for k, width in enumerate(widths):
        keep = None if width == FFN else importance[k].argsort(descending=True)[:width].sort().values
        keep = None if keep is None else keep.cpu()
        students.append(DecoderLayer(width, eps).load_teacher(weights, k, keep).to(device))
    if args.mode == "blockwise":
        # One optimizer per layer: each block trains alone (pipe-bd's blockwise epoch).
        optimizers = [torch.optim.Adam(s.parameters(), lr=lr, eps=1e-8) for s in students]
    else:
        # One optimizer over all layers: one loss, one backward through the chain.
        optimizers = [torch.optim.Adam([p for s in students for p in s.parameters()], lr=lr, eps=1e-8)]

    load_seconds = time.perf_counter() - load_start
    print(f"loaded the teacher and tokenised {len(sentences)} sentences in {load_seconds:.1f} s "
          f"(mean {mask.sum(1).mean():.1f} real tokens of {args.max_tokens})", file=sys.stderr, flush=True)

    check = None
    if args.check:
        check = check_teacher(tokenizer, embedding, teacher, head, rope_base, args.data)
        print(f"teacher on Brown ca01 ({check['sentences']} sentences at {check['max_tokens']} tokens): "
              f"perplexity {check['perplexity']:.2f} (smollm2_reference.py: 178.75)", file=sys.stderr, flush=True)

    times, losses, teacher_times = [], [], []
    for step in range(total):
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = cosine_lr(lr, step, total)
        rows = slice(step * args.batch_size, (step + 1) * args.batch_size)
        sync()
        start = time.perf_counter()
        m = mask[rows]
        with torch.no_grad():
            x = embedding(ids[rows])
            bias = attention_bias(m)
        if args.mode == "blockwise":
            with torch.no_grad():
                states = [x]
                for layer in teacher:
                    states.append(layer(states[-1], bias, cos, sin))
            sync()
            teacher_times.append(time.perf_counter() - start)
            step_losses = []
            for k, (s, opt) in enumerate(zip(students, optimizers)):
                loss = masked_mse(s(states[k], bias, cos, sin), states[k + 1], m)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step_losses.append(loss.item())
            losses.append(sum(step_losses) / len(step_losses))
        else:
            with torch.no_grad():
                t = x
                for layer in teacher:
                    t = layer(t, bias, cos, sin)
                teacher_logits = head(t).reshape(-1, VOCAB)
            sync()
            teacher_times.append(time.perf_counter() - start)
            s = x
            for layer in students:
                s = layer(s, bias, cos, sin)
            loss = weighted_kl(head(s).reshape(-1, VOCAB), teacher_logits, next_token_weights(m))
            opt = optimizers[0]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        sync()
        times.append(time.perf_counter() - start)
        label = "warm-up" if step < args.warmup else "timed"
        what = "mean block MSE" if args.mode == "blockwise" else "KL"
        print(f"step {step + 1}/{total} ({label}): {1e3 * times[-1]:.0f} ms "
              f"(teacher forward {1e3 * teacher_times[-1]:.0f} ms), {what} {losses[-1]:.4f}",
              file=sys.stderr, flush=True)

    timed = times[args.warmup :]
    median = statistics.median(timed)
    flops = step_flops(args.mode, widths, args.batch_size, args.max_tokens)
    result = {
        "peer": f"pytorch {torch.__version__} eager",
        "torch": torch.__version__,
        "mode": args.mode,
        "threads": args.threads,
        "device": str(device),
        "layers": layers,
        "batch_size": args.batch_size,
        "max_tokens": args.max_tokens,
        "mean_real_tokens": float(mask.sum(1).mean()),
        "ffn": args.ffn,
        "student_widths": widths,
        "optimizers": "one Adam per layer" if args.mode == "blockwise" else f"one Adam over all {layers} layers",
        "lr": lr,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "seconds_per_step": median,
        "mean_seconds_per_step": statistics.mean(timed),
        "samples_per_second": args.batch_size / median,
        "all_steps_seconds": sum(times),
        "all_steps_seconds_per_step": sum(times) / total,
        "all_steps_samples_per_second": total * args.batch_size / sum(times),
        "teacher_forward_seconds": statistics.median(teacher_times[args.warmup :]),
        "step_seconds": times,
        "flops_per_step": flops,
        "gflop_per_step": flops / 1e9,
        "gflops_per_second": flops / median / 1e9,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "loss_kind": "mean over layers of masked MSE" if args.mode == "blockwise" else "next-token KL (nats)",
        "load_seconds": load_seconds,
    }
    if check is not None:
        result["teacher_check"] = check
    print(f"{args.mode}: {1e3 * median:.0f} ms per step (median of {args.steps}), "
          f"{result['samples_per_second']:.2f} samples/s, {flops / 1e9:.1f} GFLOP per step, "
          f"{result['gflops_per_second']:.1f} GFLOP/s at {args.threads} thread(s)", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
