#!/usr/bin/env bash
# Builds llama.cpp's `llama-perplexity`, `llama-bench`, `llama-quantize` and
# `llama-completion` (CPU only) from the copy inside the PyPI sdist
# `llama-cpp-python==0.3.36` (folder vendor/llama.cpp), with CMake from PyPI.
# Everything lands outside the repository, in $LLAMA_CPP_HOME (default
# ~/.cache/pipe-bd/llama-cpp): the build takes 10-20 minutes on 2 cores, so
# it is not part of the tests. Safe to re-run: a finished build is reused.
#
#   bash bench/llama-cpp/build.sh        # prints the folder of the binaries
set -euo pipefail
HOME_DIR="${LLAMA_CPP_HOME:-$HOME/.cache/pipe-bd/llama-cpp}"
VERSION=0.3.36
SDIST="llama_cpp_python-$VERSION.tar.gz"
URL="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/$SDIST"
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CMAKE_VERSION=4.2.1
mkdir -p "$HOME_DIR"
cd "$HOME_DIR"
bin="$HOME_DIR/build/bin"
if [ -x "$bin/llama-perplexity" ] && [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-quantize" ] && [ -x "$bin/llama-completion" ]; then
  echo "$bin"
  exit 0
fi
if ! echo "$SHA256  $SDIST" | sha256sum -c --quiet 2>/dev/null; then
  echo "build.sh: downloading $SDIST" >&2
  curl -fsSL --retry 3 -o "$SDIST.part" "$URL"
  mv "$SDIST.part" "$SDIST"
  echo "$SHA256  $SDIST" | sha256sum -c --quiet || { echo "build.sh: ERROR: sha256 of $SDIST differs from $SHA256" >&2; exit 1; }
fi
if [ ! -d "llama_cpp_python-$VERSION/vendor/llama.cpp" ]; then
  tar xzf "$SDIST"
fi
if [ ! -x venv/bin/cmake ]; then
  python3 -m venv venv
  venv/bin/pip install --quiet "cmake==$CMAKE_VERSION" || venv/bin/pip install --quiet cmake
fi
src="llama_cpp_python-$VERSION/vendor/llama.cpp"
echo "build.sh: configuring and building llama.cpp (CPU) in $HOME_DIR/build: 10-20 minutes on 2 cores" >&2
venv/bin/cmake -S "$src" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >&2
venv/bin/cmake --build build -j "$(nproc)" --target llama-perplexity llama-bench llama-quantize llama-completion >&2
echo "$bin"
