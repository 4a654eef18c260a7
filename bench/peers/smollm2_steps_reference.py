"""Reference losses of 10 Adam steps on SmolLM2-135M-Instruct decoder layers,
for a Rust test that runs the same protocol with pipe-bd's decoder layer and
losses and compares each loss to 1e-5 relative.

Everything is float32 on the CPU, one thread (torch.set_num_threads(1)),
torch.backends at their defaults. The model and the layer code are
smollm2_torch.py's (imported): the GGUF file's tensors dequantized to float32
with `gguf.dequantize`, projections as torch `[out, in]` (burn's `[in, out]`
transposed), the query/key rows kept in the GGUF file's (interleaved) order.

Protocol (written into the JSON under "protocol" too):

ids, mask: the 8 probe SENTENCES of smollm2_reference.py, tokenized by its
  pure-Python tokenizer (no BOS), each truncated to 16 tokens and
  right-padded to 16 with id 0; mask [8, 16] is 1.0 for real tokens, 0.0 for
  padding. Both are stored in the JSON.
x: token_embd (dequantized, [49152, 576]) rows of those ids, [8, 16, 576];
  padding positions get the row of id 0.
Decoder layer (pre-norm Llama, no biases):
  n(x) = x / sqrt(mean(x^2 over hidden) + eps) * gamma   (eps from the GGUF
         metadata llama.attention.layer_norm_rms_epsilon)
  q = Wq n1(x), k = Wk n1(x), v = Wv n1(x) split into heads of 64 (9 query
  heads, 3 kv heads; query head h uses kv head h // 3); RoPE on q and k turns
  the ADJACENT pairs (x[2i], x[2i+1]) of each head by angle
  pos * base^(-2i/64), base = llama.rope.freq_base, pos = 0..15:
  (a, b) -> (a cos - b sin, a sin + b cos); cos/sin tables computed in
  float64, cast to float32.
  scores = q k^T / sqrt(64) + bias, bias = -1e30 for keys after the query
  (pipe-bd's FUTURE_SCORE) plus -1e9 for padding keys (mask 0; pipe-bd's
  MASKED_SCORE); softmax over keys; context = probs v, heads concatenated.
  h = x + Wo context
  out = h + Wdown (SiLU(Wgate n2(h)) * Wup n2(h))
Narrowed SwiGLU: neurons 0..767 of 1536 kept: Wgate and Wup output rows
  0..767 (in burn's [in, out] layout, columns 0..767 of the [576, 1536]
  weight), Wdown input columns 0..767 (burn: rows 0..767 of [1536, 576]);
  every other weight identical to the teacher layer.
Adam: torch.optim.Adam(lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
  weight_decay=0, amsgrad=False), no lr schedule, no gradient clipping; the
  update is p -= lr * m_hat / (sqrt(v_hat) + eps) with the usual bias
  corrections (identical to burn's Adam; burn's default eps is 1e-5, so the
  Rust side must set 1e-8). Each step: zero grads, forward, loss, backward,
  optimizer step; the recorded loss is the one of that forward, i.e. BEFORE
  the step's update. 10 steps on the same batch.
(A) blockwise: teacher = layer 12 (0-based, blk.12.*) of the GGUF model,
  dense, frozen; target = teacher(x) (no grad). Student = copy of layer 12
  with the narrowed SwiGLU; all its 9 tensors trained (attn_norm, q, k, v,
  o, ffn_norm, gate, up, down). Loss = pipe-bd's masked_mse:
    real_b = max(sum_t mask[b, t], 1)
    loss = (1/B) sum_b [ sum_t mask[b, t] * sum_h (s - t)^2[b, t, h] / real_b ] / H
  with B = 8, H = 576 (equivalently mse(s*w, t*w) * T, w = mask/sqrt(real_b),
  mse averaged over all B*T*H elements, T = 16).
(B) stitched: teacher = layers 0 and 1 (dense), then output_norm (RMSNorm,
  same eps) and the LM head tied to token_embd (logits = norm(h) E^T,
  E = token_embd [49152, 576]), all frozen. Student = copy of layer 0 (dense)
  then copy of layer 1 with the narrowed SwiGLU, both trained (18 tensors,
  one Adam), then the SAME frozen output_norm and head. Counted rows:
  (b, i) with i < 15 and mask[b, i + 1] == 1, in row-major order, weight 1
  each. Loss = mean over counted rows of
    KL(softmax(t) || softmax(s)) = sum_v p_t (log p_t - log p_s),
  temperature 1, t/s the teacher/student logits of that row (log_softmax in
  float32); the teacher side carries no gradient.

Writes tests/data/smollm2-steps-reference.json: "losses" are the float32
run's values (stored as float64 copies of the float32 scalars). It also runs
the same protocol once in float64 ("losses_float64_shadow", with the rotary
tables left in float64) as a gauge of how much float32 rounding alone moves
each loss; that shadow is not the reference. Takes well under a minute at one thread.

    bench/peers/.venv/bin/python bench/peers/smollm2_steps_reference.py \
        data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf tests/data/smollm2-steps-reference.json
"""

import hashlib
import json
import os
import sys
import time
from importlib import metadata

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smollm2_reference as reference  # noqa: E402  (the tokenizer and the probe sentences)
import smollm2_torch as peer  # noqa: E402  (the GGUF reader and the decoder layer)

TOKENS = 16
KEEP = 768
LR, BETAS, EPS_ADAM = 1e-4, (0.9, 0.999), 1e-8
STEPS = 10
BLOCKWISE_LAYER = 12
STITCHED_LAYERS = (0, 1)
# pipe-bd's FUTURE_SCORE (kernels/src/llama.rs): added to keys after the query.
FUTURE_SCORE = -1.0e30

PROTOCOL = {
    "dtype": "float32, CPU, torch.set_num_threads(1), torch.backends defaults",
    "ids": "the 8 SENTENCES of bench/peers/smollm2_reference.py tokenized by its tokenizer (no BOS), "
           "truncated to 16 tokens, right-padded to 16 with id 0",
    "mask": "[8, 16], 1.0 for real tokens, 0.0 for padding",
    "x": "token_embd rows (dequantized to float32) of ids, [8, 16, 576]; padding gets the row of id 0",
    "decoder_layer": "pre-norm Llama, no biases: h = x + Wo attn(RoPE(Wq n1(x)), RoPE(Wk n1(x)), Wv n1(x)); "
                     "out = h + Wdown (SiLU(Wgate n2(h)) * Wup n2(h)); n(x) = x / sqrt(mean(x^2) + eps) * gamma, "
                     "eps = llama.attention.layer_norm_rms_epsilon",
    "attention": "9 query heads, 3 kv heads (query head h uses kv head h // 3), head_dim 64, scores / sqrt(64), "
                 "-1e30 added to keys after the query, -1e9 added to padding keys, softmax over keys",
    "rope": "q/k rows in GGUF order; adjacent pairs (x[2i], x[2i+1]) of each head turned by "
            "pos * base^(-2i/64), base = llama.rope.freq_base, pos 0..15; tables in float64 cast to float32",
    "narrowed_swiglu": "neurons 0..767 kept: gate and up output neurons 0..767 (first 768 columns of burn's "
                       "[576, 1536]), down input neurons 0..767 (first 768 rows of burn's [1536, 576]); "
                       "everything else identical to the teacher layer",
    "optimizer": "torch.optim.Adam(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False), "
                 "constant lr, no clipping; p -= lr * m_hat / (sqrt(v_hat) + eps)",
    "steps": "10 steps on the same batch; each: forward, loss, backward, Adam step; "
             "the recorded loss is the forward's, before that step's update",
    "blockwise": "teacher = layer 12 (0-based), dense, frozen; target = teacher(x). Student = layer 12 with the "
                 "narrowed SwiGLU, all 9 tensors trained. Loss = masked_mse: real_b = max(sum_t mask[b,t], 1); "
                 "loss = mean_b(sum_t mask[b,t] * sum_h (s-t)^2 / real_b) / 576",
    "stitched": "teacher = layers 0, 1 (dense), output_norm, LM head tied to token_embd, all frozen. Student = "
                "layer 0 (dense) then layer 1 with the narrowed SwiGLU, both trained (one Adam over 18 tensors), "
                "then the same frozen output_norm and head. Counted rows: (b, i), i < 15, mask[b, i+1] == 1, "
                "weight 1 each. Loss = mean over counted rows of KL(softmax(teacher logits) || "
                "softmax(student logits)), temperature 1, no gradient into the teacher",
}


def attention_bias(mask):
    """`[batch, 1, tokens, tokens]`: FUTURE_SCORE for keys after the query plus
    MASKED_SCORE for padding keys (as pipe-bd's causal_attention_reference)."""
    tokens = mask.shape[1]
    causal = torch.full((tokens, tokens), FUTURE_SCORE).triu(1)
    return causal.view(1, 1, tokens, tokens) + ((1.0 - mask) * peer.MASKED_SCORE).view(-1, 1, 1, tokens)


def adam(params):
    return torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS_ADAM, weight_decay=0.0, amsgrad=False)


def layer(weights, eps, index, narrow, trainable):
    keep = torch.arange(KEEP) if narrow else None
    module = peer.DecoderLayer(KEEP if narrow else peer.FFN, eps).load_teacher(weights, index, keep)
    return module.to(x_dtype(weights)).requires_grad_(trainable)


def x_dtype(weights):
    return weights["token_embd.weight"].dtype


def blockwise(weights, eps, x, mask, bias, cos, sin):
    teacher = layer(weights, eps, BLOCKWISE_LAYER, narrow=False, trainable=False)
    student = layer(weights, eps, BLOCKWISE_LAYER, narrow=True, trainable=True)
    params = list(student.parameters())
    assert len(params) == 9 and all(p.dtype == x.dtype for p in params)
    with torch.no_grad():
        target = teacher(x, bias, cos, sin)
    opt = adam(params)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = peer.masked_mse(student(x, bias, cos, sin), target, mask)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def stitched(weights, eps, x, mask, bias, cos, sin):
    teacher = [layer(weights, eps, k, narrow=False, trainable=False) for k in STITCHED_LAYERS]
    student = [layer(weights, eps, STITCHED_LAYERS[0], narrow=False, trainable=True),
               layer(weights, eps, STITCHED_LAYERS[1], narrow=True, trainable=True)]
    head = peer.LmHead(weights, eps).to(x.dtype).requires_grad_(False)
    batch, tokens = mask.shape
    # Row b * tokens + i counts when i + 1 < tokens and token i + 1 is real.
    counted = [b * tokens + i for b in range(batch) for i in range(tokens - 1) if mask[b, i + 1] > 0.5]
    rows = torch.tensor(counted, dtype=torch.long)

    def logits(layers):
        h = x
        for m in layers:
            h = m(h, bias, cos, sin)
        return head(h.reshape(batch * tokens, peer.HIDDEN).index_select(0, rows))

    with torch.no_grad():
        teacher_logits = logits(teacher)
    params = [p for m in student for p in m.parameters()]
    assert len(params) == 18
    opt = adam(params)
    weights_1 = torch.ones(len(counted), dtype=x.dtype)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = peer.weighted_kl(logits(student), teacher_logits, weights_1)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, len(counted)


def falls(losses):
    return losses[-1] < losses[0] and all(b <= a for a, b in zip(losses, losses[1:]))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    model, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    start = time.perf_counter()
    with open(model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    reader, meta, weights = peer.load_teacher_weights(model)
    tokenizer = reference.Tokenizer(reader)
    sequences = [tokenizer.encode(s) for s in reference.SENTENCES]
    # The same ids as tests/data/smollm2-reference.json (which pipe-bd's tokenizer matches).
    ref_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../tests/data/smollm2-reference.json")
    if os.path.exists(ref_path):
        with open(ref_path) as f:
            ref = json.load(f)["sentences"]
        assert [r["ids"] for r in ref] == sequences, "tokenizer disagrees with tests/data/smollm2-reference.json"
    ids, mask = peer.pad(sequences, TOKENS)
    x = weights["token_embd.weight"][ids]
    assert x.shape == (8, TOKENS, peer.HIDDEN) and x.dtype == torch.float32
    bias = attention_bias(mask)
    cos, sin = peer.rope_tables(TOKENS, meta["rope_base"])
    eps = meta["eps"]
    real_tokens = int(mask.sum())

    a = blockwise(weights, eps, x, mask, bias, cos, sin)
    print("blockwise (layer 12, masked MSE):", " ".join(f"{v:.9g}" for v in a), file=sys.stderr)
    b, counted = stitched(weights, eps, x, mask, bias, cos, sin)
    print("stitched (layers 0-1, KL):", " ".join(f"{v:.9g}" for v in b), file=sys.stderr)

    # A float64 shadow of the same protocol (not the reference: a gauge of how
    # far float32 rounding alone moves each loss; an independent float32
    # implementation should differ from the float32 losses by about as much).
    needed = ("token_embd.", "output_norm.", "blk.0.", "blk.1.", f"blk.{BLOCKWISE_LAYER}.")
    w64 = {k: v.double() for k, v in weights.items() if k.startswith(needed)}
    i64 = torch.arange(peer.HEAD_DIM // 2, dtype=torch.float64)
    angles = torch.arange(TOKENS, dtype=torch.float64)[:, None] * meta["rope_base"] ** (-2.0 * i64 / peer.HEAD_DIM)
    shadow = (x.double(), mask.double(), attention_bias(mask).double(), angles.cos(), angles.sin())
    a64 = blockwise(w64, eps, *shadow)
    b64, _ = stitched(w64, eps, *shadow)
    rel = lambda u, v: max(abs(p - q) / abs(q) for p, q in zip(u, v))
    print(f"float32 vs float64 shadow, max relative difference: blockwise {rel(a, a64):.2e}, "
          f"stitched {rel(b, b64):.2e}", file=sys.stderr)

    ok = True
    for name, losses in (("blockwise", a), ("stitched", b)):
        if not losses[0] > 0:
            print(f"CHECK FAILED: {name} step-0 loss {losses[0]} is not > 0", file=sys.stderr)
            ok = False
        if not falls(losses):
            print(f"CHECK FAILED: {name} losses do not fall monotonically at lr {LR}", file=sys.stderr)
            ok = False

    result = {
        "model": os.path.basename(model),
        "model_sha256": sha,
        "produced_by": f"bench/peers/smollm2_steps_reference.py (torch {torch.__version__}, "
                       f"gguf {metadata.version('gguf')}, numpy {metadata.version('numpy')}, float32, 1 thread)",
        "torch": torch.__version__,
        "protocol": PROTOCOL,
        "rope_base": meta["rope_base"],
        "rms_eps": eps,
        "tokens": TOKENS,
        "ffn_kept": KEEP,
        "lr": LR,
        "betas": list(BETAS),
        "adam_eps": EPS_ADAM,
        "steps": STEPS,
        "ids": ids.tolist(),
        "mask": mask.tolist(),
        "blockwise": {
            "layer": BLOCKWISE_LAYER,
            "real_tokens": real_tokens,
            "first_loss": a[0],
            "losses": a,
            "losses_float64_shadow": a64,
            "max_relative_difference_float32_vs_float64": rel(a, a64),
        },
        "stitched": {
            "layers": list(STITCHED_LAYERS),
            "narrowed_layer": STITCHED_LAYERS[1],
            "counted_rows": counted,
            "first_loss": b[0],
            "losses": b,
            "losses_float64_shadow": b64,
            "max_relative_difference_float32_vs_float64": rel(b, b64),
        },
        "checks_passed": ok,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s; checks {'passed' if ok else 'FAILED'}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
