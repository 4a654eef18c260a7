#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs the real data the
# tests use and a Vulkan driver (Mesa's software one where there is no GPU),
# then runs every test of the workspace in release mode (burn's kernels are
# far too slow unoptimised; one release build serves both the quickstart and
# the tests), with the wgpu backend compiled in so that our CubeCL kernels are
# tested on it, and with the MPI transport (OpenMPI, installed here too) so
# that multi-process runs are tested through mpirun; before that, a type
# check of the CUDA build (beside the setup) and two of the three library
# examples (the third, custom_zoo, runs inside the tests).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Where the time goes, in the log (CI keeps only the output).
phase() { echo "test.sh: $* (${SECONDS}s in, $(date -u +%H:%M:%S) UTC)" >&2; }
# A first build (no target folder yet: a fresh clone, CI) gains nothing from
# incremental compilation, which the release profile turns on for the edit-
# build cycle; without it the engine's crates compile about 15% faster.
if [ -z "${CARGO_INCREMENTAL:-}" ] && [ ! -d "${CARGO_TARGET_DIR:-target}/release" ]; then
  export CARGO_INCREMENTAL=0
fi
# One feature set for every build below, so that they share one build.
features="wgpu,mpi"
# Mesa complains when XDG_RUNTIME_DIR is unset or unusable.
if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -w "${XDG_RUNTIME_DIR}" ]; then
  XDG_RUNTIME_DIR="$(mktemp -d)"
  export XDG_RUNTIME_DIR
fi
# The CUDA build must not rot: type-check it (no GPU or driver needed;
# cudarc loads the driver at run time). It needs none of the setup below,
# which mostly waits on downloads and apt: the two run side by side.
cuda_log="$(mktemp)"
phase "type-checking the CUDA build (cargo check --features cuda) while the setup runs"
CUDARC_CUDA_VERSION=13000 cargo check --release --features cuda >"$cuda_log" 2>&1 &
cuda_check=$!
trap 'kill "$cuda_check" 2>/dev/null || true' EXIT
bash scripts/setup-data.sh
bash scripts/setup-python.sh
bash scripts/setup-vulkan.sh
bash scripts/setup-mpi.sh
phase "setup done; waiting for the CUDA type check"
if ! wait "$cuda_check"; then
  cat "$cuda_log"
  echo "test.sh: ERROR: the CUDA build (cargo check --release --features cuda) failed; its output is above" >&2
  exit 1
fi
tail -n 3 "$cuda_log"
phase "CUDA type check passed; building and running the examples"
# The library examples, at smoke sizes, run as a user would run them.
cargo run --release --features "$features" --example custom_student -- --train-limit 1280 2>&1
cargo run --release --features "$features" --example custom_teacher -- --train-limit 3000 2>&1
# (A user's own zoo behind the whole command line, examples/custom_zoo:
# check, run, eval and resume, is driven by the integration test zoo::,
# through the example's binary that `cargo test` builds.)
phase "examples ran; building and running the tests"
cargo test --release --workspace --features "$features" 2>&1
phase "all tests passed"
