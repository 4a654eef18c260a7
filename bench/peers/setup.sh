#!/usr/bin/env bash
# Installs the peers' Python environment into bench/peers/.venv: PyTorch
# and HF tokenizers (the MiniLM peer tokenises with the model's own
# tokenizer.json, as pipe-bd does through the Rust crate), pinned, from PyPI (its Linux wheel pulls the CUDA libraries too, about
# 4 GB, even where only the CPU is used); gguf, numpy and regex for the
# SmolLM2 peer (llama.cpp's GGUF reader and its dequantizers, and the
# pre-tokenizer regex of smollm2_reference.py's BPE, which it imports).
# Safe to re-run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
TORCH_VERSION=2.15.0
TOKENIZERS_VERSION=0.22.1
GGUF_VERSION=0.19.0
NUMPY_VERSION=2.4.6
REGEX_VERSION=2026.11.19
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  .venv/bin/pip install --quiet "torch==$TORCH_VERSION"
fi
if ! .venv/bin/python -c "import tokenizers, sys; sys.exit(tokenizers.__version__ != '$TOKENIZERS_VERSION')" 2>/dev/null; then
  .venv/bin/pip install --quiet "tokenizers==$TOKENIZERS_VERSION"
fi
if ! .venv/bin/python -c "import numpy, sys; sys.exit(numpy.__version__ != '$NUMPY_VERSION')" 2>/dev/null; then
  .venv/bin/pip install --quiet "numpy==$NUMPY_VERSION"
fi
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('gguf') != '$GGUF_VERSION')" 2>/dev/null; then
  .venv/bin/pip install --quiet "gguf==$GGUF_VERSION" "numpy==$NUMPY_VERSION"
fi
if ! .venv/bin/python -c "import regex, sys; sys.exit(regex.__version__ != '$REGEX_VERSION')" 2>/dev/null; then
  .venv/bin/pip install --quiet "regex==$REGEX_VERSION"
fi
.venv/bin/python -c "import torch, tokenizers; print('peers: torch', torch.__version__, 'tokenizers', tokenizers.__version__)"
.venv/bin/python -c "import gguf, numpy, regex, importlib.metadata as m; print('peers: gguf', m.version('gguf'), 'numpy', numpy.__version__, 'regex', regex.__version__)"
