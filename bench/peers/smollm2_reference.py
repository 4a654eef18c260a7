"""An independent float64 reference for SmolLM2-135M-Instruct read from its GGUF
file: a pure-Python byte-level BPE tokenizer (GPT-2's algorithm with SmolLM2's
pre-tokenization: every digit its own piece, then GPT-2's regex) and a numpy
Llama decoder written in Hugging Face's convention (the GGUF converter's
interleaved q/k row order is undone, then rotate_half RoPE is applied). For
eight probe sentences it records the token ids, the logits of 32 fixed vocab
ids, the logsumexp and argmax at every position and the top 20 logits at the
last one; it also records the next-token perplexity on the first 64 sentences
of Brown ca01. `pipebd_teachers::smollm2` must agree with
tests/data/smollm2-reference.json.

Pinned packages: gguf==0.19.0 (llama.cpp's reader), numpy==2.4.6, regex==2026.11.19.
Takes about 90 s on two CPU cores. `--probe <file.gguf> <out.json>` writes only the
eight sentences' probes, for any llama or deci file (an exported student: the
per-layer heads and SwiGLU widths, the linear mixer, removed attention or SwiGLU).

    python -m venv .venv-gguf && .venv-gguf/bin/pip install gguf==0.19.0 numpy==2.4.6 regex==2026.11.19
    .venv-gguf/bin/python bench/peers/smollm2_reference.py \
        data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf data/brown \
        tests/data/smollm2-reference.json
"""

import hashlib
import json
import os
import sys
import time
from importlib import metadata

import gguf
import numpy as np

try:
    import regex

    GPT2_PATTERN = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )
    DIGITS = regex.compile(r"\p{Nd}|[^\p{Nd}]+")
except ImportError:
    # Where only the standard library is at hand (the GPU machine of
    # scripts/gpu-bench.sh): the same pattern in `re`'s terms, letters as
    # `[^\W\d_]` and numbers as `\d`. It splits alike any text whose numerals
    # are decimal digits (Brown's ASCII included); the tokenizer test runs
    # with `regex`.
    import re

    GPT2_PATTERN = re.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
    )
    DIGITS = re.compile(r"\d|\D+")
SENTENCES = [
    "It's late, and they'll say we'd've known.",
    "In 1984, 3.5 million people paid $12,000 each.",
    "Wait... what?!? No -- really?! (Yes!!!)",
    "  Two  spaces  here, and a leading one.",
    "The café served a naïve crème brûlée.",
    "The quick brown fox jumps over the lazy dog while the sun sets slowly behind "
    "the distant mountains, painting the sky in shades of orange, pink and purple "
    "as the birds return to their nests.",
    "Good morning",
    "def f(x): return x**2",
]
PROBE_IDS = list(range(0, 49152, 1536))
PPL_SENTENCES, PPL_MAX_TOKENS = 64, 64


def field(reader, key):
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]].tolist()[0]


def string_array(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode() for i in f.data]


def bytes_to_unicode():
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class Tokenizer:
    def __init__(self, reader):
        self.tokens = string_array(reader, "tokenizer.ggml.tokens")
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(string_array(reader, "tokenizer.ggml.merges"))}
        self.byte_enc = bytes_to_unicode()
        self.byte_dec = {c: b for b, c in self.byte_enc.items()}
        self.cache = {}

    def bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = {(a, b) for a, b in zip(parts, parts[1:])}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self.cache[word] = parts
        return parts

    def encode(self, text):
        ids = []
        for piece in DIGITS.findall(text):
            for word in GPT2_PATTERN.findall(piece):
                mapped = "".join(self.byte_enc[b] for b in word.encode("utf-8"))
                ids.extend(self.ids[t] for t in self.bpe(mapped))
        return ids

    def decode(self, ids):
        return bytes(self.byte_dec[c] for i in ids for c in self.tokens[i]).decode("utf-8")


def unpermute(w, n_head):
    """Undo llama.cpp's per-head interleaving of q/k rows, back to HF's rotate_half layout."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def per_layer(reader, key, n_layer):
    """A per-layer array of a deci file, or one value for every layer."""
    f = reader.fields[key]
    values = [f.parts[i].tolist()[0] for i in f.data]
    return values if len(values) == n_layer else values * n_layer


class Llama:
    """A `llama` file, or a `deci` one (per-layer heads and SwiGLU widths:
    0 query heads = no attention, query heads without key/value heads = the
    linear mixer x + W rms(x), 0 width = no SwiGLU), as `pipebd export` writes."""

    def __init__(self, reader):
        arch = field(reader, "general.architecture")
        key = lambda name: f"{arch}.{name}"
        self.n_layer = field(reader, key("block_count"))
        self.heads = per_layer(reader, key("attention.head_count"), self.n_layer)
        self.kv_heads = per_layer(reader, key("attention.head_count_kv"), self.n_layer)
        self.ffn = per_layer(reader, key("feed_forward_length"), self.n_layer)
        self.base = field(reader, key("rope.freq_base"))
        self.eps = field(reader, key("attention.layer_norm_rms_epsilon"))
        if key("attention.key_length") in reader.fields:
            self.head_dim = field(reader, key("attention.key_length"))
        else:
            self.head_dim = field(reader, key("embedding_length")) // self.heads[0]
        w = {t.name: gguf.dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors}
        assert "output.weight" not in w, "expected tied embeddings"
        self.embed, self.final_norm = w["token_embd.weight"], w["output_norm.weight"]
        self.layers = []
        for n in range(self.n_layer):
            p = {k: w[f"blk.{n}.{k}.weight"] for k in
                 ["attn_norm", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
                 if f"blk.{n}.{k}.weight" in w}
            if self.kv_heads[n] > 0:
                p["attn_q"] = unpermute(w[f"blk.{n}.attn_q.weight"], self.heads[n])
                p["attn_k"] = unpermute(w[f"blk.{n}.attn_k.weight"], self.kv_heads[n])
            p["n_head"], p["n_kv"], p["n_ff"] = self.heads[n], self.kv_heads[n], self.ffn[n]
            self.layers.append(p)

    def rms(self, x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def rope(self, x):
        """HF rotate_half RoPE on (heads, T, head_dim), positions from 0."""
        d = self.head_dim
        angles = np.arange(x.shape[1])[:, None] * self.base ** (-np.arange(0, d, 2) / d)[None, :]
        angles = np.concatenate([angles, angles], axis=-1)
        rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
        return x * np.cos(angles) + rotated * np.sin(angles)

    def attention(self, x, p):
        t, d, n_head, n_kv = x.shape[0], self.head_dim, p["n_head"], p["n_kv"]
        heads = lambda y, n: y.reshape(t, n, d).transpose(1, 0, 2)
        q = self.rope(heads(x @ p["attn_q"].T, n_head))
        k = np.repeat(self.rope(heads(x @ p["attn_k"].T, n_kv)), n_head // n_kv, axis=0)
        v = np.repeat(heads(x @ p["attn_v"].T, n_kv), n_head // n_kv, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)
        scores = np.where(np.tril(np.ones((t, t), dtype=bool)), scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        return (scores @ v).transpose(1, 0, 2).reshape(t, -1) @ p["attn_output"].T

    def logits(self, ids):
        x = self.embed[ids]
        for p in self.layers:
            if p["n_head"] > 0 and p["n_kv"] == 0:
                x = x + self.rms(x, p["attn_norm"]) @ p["attn_output"].T
            elif p["n_head"] > 0:
                x = x + self.attention(self.rms(x, p["attn_norm"]), p)
            if p["n_ff"] > 0:
                hn = self.rms(x, p["ffn_norm"])
                gate = hn @ p["ffn_gate"].T
                x = x + (gate / (1 + np.exp(-gate)) * (hn @ p["ffn_up"].T)) @ p["ffn_down"].T
        return self.rms(x, self.final_norm) @ self.embed.T


def logsumexp(logits):
    m = logits.max(axis=-1)
    return m + np.log(np.exp(logits - m[:, None]).sum(axis=-1))


def r6(v):
    return float(f"{float(v):.6g}")


def brown_sentences(path, count):
    """Tag-stripped sentences: word before the last '/', `` and '' become "."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            words = [pair.rsplit("/", 1)[0] for pair in line.split()]
            text = " ".join('"' if w in ("``", "''") else w for w in words)
            if text:
                out.append(text)
                if len(out) == count:
                    break
    return out


def perplexity(model, tok, brown_dir):
    nll, predicted, used = 0.0, 0, 0
    for text in brown_sentences(os.path.join(brown_dir, "ca01"), PPL_SENTENCES):
        ids = tok.encode(text)[:PPL_MAX_TOKENS]
        if len(ids) < 2:
            continue
        logits = model.logits(ids)[:-1]
        nll += float((logsumexp(logits) - logits[np.arange(len(ids) - 1), ids[1:]]).sum())
        predicted += len(ids) - 1
        used += 1
    mean = nll / predicted
    return {"file": "ca01", "sentences": used, "max_tokens": PPL_MAX_TOKENS,
            "predicted_tokens": predicted, "mean_nll": r6(mean), "perplexity": r6(np.exp(mean))}


def probe(model, tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text, f"round trip failed for {text!r}"
    logits = model.logits(ids)
    top = np.argsort(-logits[-1], kind="stable")[:20]
    return {"text": text, "ids": ids,
            "logits_at_probe_ids": [[r6(v) for v in row] for row in logits[:, PROBE_IDS]],
            "logsumexp": [r6(v) for v in logsumexp(logits)],
            "argmax": [int(i) for i in logits.argmax(axis=-1)],
            "last_top20": [[int(i), r6(logits[-1, i])] for i in top]}


def probe_only(model_path, out_path):
    """`--probe model.gguf out.json`: only the eight sentences' probes (any
    llama or deci file, e.g. an exported student; about 20 s)."""
    reader = gguf.GGUFReader(model_path)
    tok, model = Tokenizer(reader), Llama(reader)
    result = {"model": os.path.basename(model_path), "probe_vocab_ids": PROBE_IDS,
              "layers": [[p["n_head"], p["n_kv"], p["n_ff"]] for p in model.layers],
              "sentences": [probe(model, tok, s) for s in SENTENCES]}
    with open(out_path, "w") as f:
        json.dump(result, f, separators=(",", ":"))


def main():
    if sys.argv[1] == "--probe":
        probe_only(sys.argv[2], sys.argv[3])
        return
    model_path, brown_dir, out_path = sys.argv[1:4]
    start = time.time()
    reader = gguf.GGUFReader(model_path)
    tok, model = Tokenizer(reader), Llama(reader)
    with open(model_path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    prompt = "The capital of France is"
    next_id = int(model.logits(tok.encode(prompt))[-1].argmax())
    print(f"{prompt!r} -> {tok.tokens[next_id]!r} ({next_id})")
    sentences = [probe(model, tok, s) for s in SENTENCES]
    for s in sentences:
        print(f"{len(s['ids']):3d} tokens {s['text']!r}: {s['ids']}")
    ppl = perplexity(model, tok, brown_dir)
    print(f"Brown ca01: {ppl['sentences']} sentences, {ppl['predicted_tokens']} predicted tokens, "
          f"mean nll {ppl['mean_nll']}, perplexity {ppl['perplexity']}")
    result = {"model": os.path.basename(model_path), "model_sha256": sha,
              "produced_by": f"bench/peers/smollm2_reference.py (gguf {metadata.version('gguf')}, "
                             f"numpy {np.__version__}, float64)",
              "probe_vocab_ids": PROBE_IDS, "sentences": sentences, "perplexity": ppl}
    with open(out_path, "w") as f:
        json.dump(result, f, separators=(",", ":"))
    print(f"wrote {out_path} ({os.path.getsize(out_path)} bytes) in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
