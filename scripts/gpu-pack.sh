#!/usr/bin/env bash
# Packs what scripts/gpu-bench.sh needs on a GPU machine that has no Rust and
# no internet into .gpu/ (git-ignored, under 60 MiB), to be carried there:
#   .gpu/pipebd.xz                  pipebd built with --features cuda, stripped, xz -9
#   .gpu/data/mnist/*.gz            the four MNIST IDX files, gzipped
#   .gpu/data/teachers/mnist-cnn.pth
#   .gpu/data/smollm2/smollm2-135m-first-4.gguf
#                                   SmolLM2-135M's first 4 layers at Q4_1 (the
#                                   whole file, 98 MB, is over what a call
#                                   carries), written by the packed binary
#                                   itself (`pipebd export --teacher ...
#                                   --first-layers 4 --type q4_1`)
#   .gpu/data/brown.tar.gz          the Brown corpus
#   .gpu/py.tar.gz                  llama.cpp's gguf reader (pure Python, with
#                                   PyYAML's pure-Python part) for the SmolLM2
#                                   peer, from data/venv-gguf
#   .gpu/LLM                        the cut teacher's path and layer count
#   .gpu/SHA256SUMS                 of the unpacked files, checked there
#   .gpu/BUILD                      the commit and the build the binary comes from
#
#   bash scripts/gpu-pack.sh                # builds: cargo build --release --features cuda
#   bash scripts/gpu-pack.sh --bin PATH     # packs a binary built elsewhere (with --features cuda)
#   bash scripts/gpu-pack.sh PATH           # the same
#
# The build uses its own target folder, target/cuda, so that it and the
# default build (other features) each stay incremental. cudarc loads the CUDA
# driver at run time, so the build needs no GPU; CUDARC_CUDA_VERSION=13000
# picks the CUDA API it binds to. The data comes from scripts/setup-data.sh.
# Then, on the GPU machine: `bash scripts/gpu-bench.sh`, carrying `.gpu`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { echo "gpu-pack: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

LIMIT_MIB=60
MNIST=(train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte)
TEACHER=data/teachers/mnist-cnn.pth
# The decoder LLM (gpu-bench.sh's llm-* steps), when setup-data.sh installed it.
LLM_CONFIG=experiments/smollm2-chosen.toml
LLM=data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
LLM_LAYERS=4
LLM_CUT=data/smollm2/smollm2-135m-first-$LLM_LAYERS.gguf

bin=""
case "${1:-}" in
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  --bin) [ $# -ge 2 ] || die "--bin needs a path"; bin="$2" ;;
  --*) die "unknown option $1 (try --help)" ;;
  "") ;;
  *) bin="$1" ;;
esac

git check-ignore -q .gpu/ || die ".gpu/ is not git-ignored: add '/.gpu/' to .gitignore (it travels as a carried path)"

if [ -z "$bin" ]; then
  command -v cargo >/dev/null 2>&1 || die "no cargo here: install Rust (https://rustup.rs) or pass a binary built with --features cuda (--bin PATH)"
  say "building: CUDARC_CUDA_VERSION=13000 CARGO_TARGET_DIR=target/cuda cargo build --release --features cuda --bin pipebd"
  export CUDARC_CUDA_VERSION=13000
  export CARGO_TARGET_DIR="$root/target/cuda"
  cargo build --release --features cuda --bin pipebd || die "the cuda build failed (see cargo's messages above)"
  bin="$CARGO_TARGET_DIR/release/pipebd"
fi
[ -f "$bin" ] || die "no file at $bin"
[ -x "$bin" ] || die "$bin is not executable"
if ! grep -q cudarc "$bin"; then
  say "warning: $bin does not look like a --features cuda build (no cudarc in it); packing it anyway"
fi

for stem in "${MNIST[@]}"; do
  [ -f "data/mnist/$stem" ] || [ -f "data/mnist/$stem.gz" ] ||
    die "data/mnist/$stem (or .gz) is missing: run bash scripts/setup-data.sh"
done
[ -f "$TEACHER" ] || die "$TEACHER is missing: run bash scripts/setup-data.sh"

stage="$(mktemp -d "${TMPDIR:-/tmp}/gpu-pack.XXXXXX")"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/data/mnist" "$stage/data/teachers" "$stage/plain"

# The binary: stripped (debug symbols are most of its size), then xz -9.
cp "$bin" "$stage/plain/pipebd"
chmod u+w "$stage/plain/pipebd"
if command -v strip >/dev/null 2>&1; then
  strip "$stage/plain/pipebd" 2>/dev/null || say "warning: strip failed on $bin (not an ELF binary?): packing it as it is"
else
  say "warning: no strip here (binutils): packing the binary with its symbols"
fi
say "compressing the binary ($(du -h "$stage/plain/pipebd" | cut -f1) stripped) with xz -9"
if command -v xz >/dev/null 2>&1; then
  xz -9 -c "$stage/plain/pipebd" >"$stage/pipebd.xz" || die "xz -9 failed"
else
  python3 - "$stage/plain/pipebd" "$stage/pipebd.xz" <<'PY' || die "no xz here, and python3's lzma failed"
import lzma, shutil, sys
with open(sys.argv[1], "rb") as src, lzma.open(sys.argv[2], "wb", format=lzma.FORMAT_XZ, preset=9) as dst:
    shutil.copyfileobj(src, dst)
PY
fi

# Checksums of what gpu-bench.sh unpacks, by its path there (the repo root).
sha() { sha256sum "$1" | cut -d' ' -f1; }
{
  echo "$(sha "$stage/plain/pipebd")  .gpu/bin/pipebd"
  for stem in "${MNIST[@]}"; do
    if [ -f "data/mnist/$stem" ]; then
      gzip -9 -n -c "data/mnist/$stem" >"$stage/data/mnist/$stem.gz"
      echo "$(sha "data/mnist/$stem")  data/mnist/$stem"
    else
      gzip -t "data/mnist/$stem.gz" || die "data/mnist/$stem.gz is not a valid gzip file: delete it and run bash scripts/setup-data.sh"
      cp "data/mnist/$stem.gz" "$stage/data/mnist/$stem.gz"
      echo "$(gzip -dc "data/mnist/$stem.gz" | sha256sum | cut -d' ' -f1)  data/mnist/$stem"
    fi
  done
  cp "$TEACHER" "$stage/data/teachers/"
  echo "$(sha "$TEACHER")  $TEACHER"
  if [ -f "$LLM" ] && [ -d data/brown ]; then
    mkdir -p "$stage/data/smollm2"
    say "cutting SmolLM2 to its first $LLM_LAYERS layers at Q4_1 (with $bin)"
    "$bin" export --teacher "$LLM_CONFIG" --first-layers "$LLM_LAYERS" --type q4_1 --out "$stage/$LLM_CUT" \
      --quiet >&2 || die "could not cut the SmolLM2 teacher (see above)"
    echo "$(sha "$stage/$LLM_CUT")  $LLM_CUT"
    tar -czf "$stage/data/brown.tar.gz" -C data brown || die "could not pack data/brown"
    echo "$(sha "$stage/data/brown.tar.gz")  data/brown.tar.gz"
    echo "$LLM_CUT $LLM_LAYERS" >"$stage/LLM"
    site="$(ls -d data/venv-gguf/lib/python3*/site-packages 2>/dev/null | head -n 1)"
    if [ -n "$site" ] && [ -d "$site/gguf" ] && [ -d "$site/yaml" ]; then
      tar -czf "$stage/py.tar.gz" -C "$site" --exclude=__pycache__ gguf yaml || die "could not pack gguf"
    else
      say "warning: no data/venv-gguf with gguf and yaml (scripts/setup-python.sh): the SmolLM2 peer needs them there"
    fi
  else
    say "warning: no $LLM or data/brown (bash scripts/setup-data.sh): no SmolLM2 steps in this pack"
  fi
} >"$stage/SHA256SUMS"

{
  echo "binary: $bin"
  echo "packed: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  if git rev-parse --verify -q HEAD >/dev/null; then
    echo "commit: $(git rev-parse HEAD) ($(git status --porcelain --untracked-files=no | wc -l | tr -d ' ') files changed since)"
  fi
  echo "binary built: $(date -u -r "$bin" +%Y-%m-%dT%H:%M:%SZ)"
} >"$stage/BUILD"

rm -rf "$stage/plain"
bytes="$(du -sb "$stage" | cut -f1)"
limit=$((LIMIT_MIB * 1024 * 1024))
[ "$bytes" -lt "$limit" ] ||
  die "the pack is $((bytes / 1024 / 1024)) MiB, over the ${LIMIT_MIB} MiB the device tool can carry; nothing written"

rm -rf .gpu
mkdir .gpu
cp -R "$stage/." .gpu/
trap - EXIT
rm -rf "$stage"

echo "gpu-pack: wrote .gpu/ ($(awk -v b="$bytes" 'BEGIN { printf "%.1f MiB", b / 1048576 }'), limit ${LIMIT_MIB} MiB):"
(cd .gpu && find . -type f -printf '  %-40P %s bytes\n' | sort)
# What else travels: tracked files and untracked files git does not ignore.
tree_bytes="$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1 || true)"
[ -n "$tree_bytes" ] && echo "gpu-pack: the working tree adds $((tree_bytes / 1024 / 1024)) MiB (tracked + untracked-not-ignored)"
echo "gpu-pack: carry [\".gpu\"] and run: bash scripts/gpu-bench.sh"
