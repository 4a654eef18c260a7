#!/usr/bin/env bash
# Installs the peers' Python environment into bench/peers/.venv: PyTorch
# and HF tokenizers (the MiniLM peer tokenises with the model's own
# tokenizer.json, as pipe-bd does through the Rust crate), pinned, from PyPI (its Linux wheel pulls the CUDA libraries too, about
# 4 GB, even where only the CPU is used). Safe to re-run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
TORCH_VERSION=2.15.0
TOKENIZERS_VERSION=0.22.1
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  .venv/bin/pip install --quiet "torch==$TORCH_VERSION"
fi
if ! .venv/bin/python -c "import tokenizers, sys; sys.exit(tokenizers.__version__ != '$TOKENIZERS_VERSION')" 2>/dev/null; then
  .venv/bin/pip install --quiet "tokenizers==$TOKENIZERS_VERSION"
fi
.venv/bin/python -c "import torch, tokenizers; print('peers: torch', torch.__version__, 'tokenizers', tokenizers.__version__)"
