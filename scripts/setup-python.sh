#!/usr/bin/env bash
# Installs the small Python environment the export tests read GGUF files
# with, into data/venv-gguf (git-ignored): llama.cpp's own reader (PyPI
# gguf), numpy and regex, pinned, for bench/peers/smollm2_reference.py
# (the independent numpy decoder the exported students are held to).
# About 30 MB from PyPI. Safe to re-run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${PIPEBD_DATA:-$root/data}/venv-gguf"
GGUF_VERSION=0.19.0
NUMPY_VERSION=2.4.6
REGEX_VERSION=2026.11.19
want="gguf==$GGUF_VERSION numpy==$NUMPY_VERSION regex==$REGEX_VERSION"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$GGUF_VERSION" "$NUMPY_VERSION" "$REGEX_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as m, sys
sys.exit([m.version(p) for p in ("gguf", "numpy", "regex")] != sys.argv[1:])
PY
then
  echo "setup-python: $venv has $want" >&2
  exit 0
fi
python3 -m venv "$venv"
# shellcheck disable=SC2086
"$venv/bin/pip" install --quiet $want
echo "setup-python: installed $want into $venv" >&2
