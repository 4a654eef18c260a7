"""Writes tests/data/minilm-reference-curves.json: the loss curve PyTorch
computes, independently of pipe-bd, for one encoder student block, for
tests/integration/reference.rs to check pipe-bd's transformer path against.

A narrow encoder student (2 heads of 8, feed-forward 32) for MiniLM's second
layer, from weights both sides compute from one integer pattern (see
`pattern`: no weights in the file), trains 20 Adam steps (lr 1e-3, eps 1e-8,
cosine to 0 over the 20 steps) on batches of 8 real Brown sentences
(tokenised by MiniLM's tokenizer, padded to 32 tokens, so every batch has
padding in it), on the teacher's own input to the layer (embeddings, then
layer 1) against the layer's output, with the masked MSE of the MiniLM
recipe. The file holds the token ids of each batch and the loss of every
step: the masked attention, both layer norms, GELU, the loss and Adam all
show in it.

    bench/peers/.venv/bin/python bench/peers/reference_curves_minilm.py
"""

import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import minilm_torch as peer  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
STEPS, BATCH, TOKENS, LR, EPS = 20, 8, 32, 1e-3, 1e-8
BLOCK, HEADS, HEAD_DIM, FFN = 2, 2, 8, 32


def pattern(tensor, index):
    """Element `index` (row-major, PyTorch's layouts) of tensor number
    `tensor`, in [-0.5, 0.5): integer arithmetic, so both sides get the
    same bits."""
    return ((index * 7919 + tensor * 104729) % 20011) / 20011.0 - 0.5


def patterned_student():
    """The student layer with its weights from `pattern`, tensors numbered in
    the layer's order: query, key, value, attention output (weight then
    bias), the attention layer norm (gamma then beta), the feed-forward in
    and out, the last layer norm. Weights span +-1/sqrt(fan_in), biases
    +-0.05, gammas 1 +- 0.1, betas +-0.05."""
    layer = peer.EncoderLayer(FFN, HEADS, HEAD_DIM)
    modules = [layer.query, layer.key, layer.value, layer.attn_out, layer.attn_norm, layer.ffn_in,
               layer.ffn_out, layer.ffn_norm]
    tensor = 0
    with torch.no_grad():
        for module in modules:
            norm = isinstance(module, torch.nn.LayerNorm)
            for name in ("weight", "bias"):
                p = getattr(module, name)
                values = torch.tensor([pattern(tensor, i) for i in range(p.numel())], dtype=torch.float64)
                if norm:
                    values = 1.0 + 0.2 * values if name == "weight" else 0.1 * values
                elif name == "weight":
                    values = values * 2.0 / math.sqrt(p.shape[1])
                else:
                    values = 0.1 * values
                p.copy_(values.reshape(p.shape).float())
                tensor += 1
    return layer


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    weights = peer.read_safetensors(os.path.join(ROOT, "data/minilm/model.safetensors"))
    sentences = peer.brown_sentences(os.path.join(ROOT, "data/brown"), STEPS * BATCH, 42)
    ids, mask = peer.tokenize(os.path.join(ROOT, "data/minilm/tokenizer.json"), sentences, TOKENS)
    embeddings = peer.Embeddings(weights).eval().requires_grad_(False)
    teacher = [peer.EncoderLayer(1536).load_teacher(weights, k).eval().requires_grad_(False)
               for k in range(BLOCK)]
    student = patterned_student()
    optimizer = torch.optim.Adam(student.parameters(), lr=LR, eps=EPS)
    batches, losses = [], []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        m = mask[rows]
        with torch.no_grad():
            x = embeddings(ids[rows])
            for layer in teacher[:-1]:
                x = layer(x, m)
            y = teacher[-1](x, m)
        for group in optimizer.param_groups:
            group["lr"] = 0.5 * LR * (1 + math.cos(math.pi * step / STEPS))
        loss = peer.masked_mse(student(x, m), y, m)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        batches.append([seq[: int(n)] for seq, n in zip(ids[rows].tolist(), m.sum(1).tolist())])
        losses.append(loss.item())
    out = {
        "steps": STEPS,
        "lr": LR,
        "epsilon": EPS,
        "block": BLOCK,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "ffn": FFN,
        "max_tokens": TOKENS,
        "batches": batches,
        "losses": losses,
        "peer": f"pytorch {torch.__version__}",
    }
    path = os.path.join(ROOT, "tests/data/minilm-reference-curves.json")
    with open(path, "w") as f:
        json.dump(out, f)
    print(f"wrote {path}: losses {losses[0]:.6f} ... {losses[-1]:.6f}")


if __name__ == "__main__":
    main()
