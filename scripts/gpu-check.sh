#!/usr/bin/env bash
# Checks and times our CubeCL kernels on a CUDA GPU and prints the tables:
#   1. every fused op and its gradients against burn's ops (on the CPU), with
#      NaN-poisoned outputs: one line per op and quantity, failures in full;
#   2. fused against unfused timings at the MNIST workload's sizes.
#
#   bash scripts/gpu-check.sh              # builds with --features cuda (offline)
#   bash scripts/gpu-check.sh path/pipebd  # uses a binary built elsewhere with
#                                          # `cargo build --release --features cuda`
#
# Needs nothing from the internet: the build is --offline (crates must be in
# cargo's cache) and the checks draw their own random inputs. CUDA is loaded
# at run time (libcuda from the driver, libnvrtc from the CUDA toolkit or pip's
# nvidia-cuda-nvrtc wheel). Ends within a few minutes after the build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
say() { echo "gpu-check: $*" >&2; }

bin="${1:-}"
if [ -z "$bin" ]; then
  command -v cargo >/dev/null 2>&1 || {
    say "no cargo on this machine: build elsewhere (cargo build --release --features cuda) and pass the binary"
    exit 2
  }
  say "building with --features cuda"
  cargo build --release --offline --features cuda --bin pipebd
  bin="$root/target/release/pipebd"
fi
[ -x "$bin" ] || { say "no executable at $bin"; exit 2; }

# Where libnvrtc may live: the CUDA toolkit, or pip's nvidia wheels.
extra=""
for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$dir" ] && extra="$extra:$dir"
done
if command -v python3 >/dev/null 2>&1; then
  for dir in $(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    for d in glob.glob(os.path.join(r, "nvidia", "*", "lib")) + glob.glob(os.path.join(r, "nvidia", "cu*", "lib")):
        print(d)
PY
  ); do extra="$extra:$dir"; done
fi
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}$extra"

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
timeout 480 "$bin" kernels --device cuda --check --bench --repeats 30
