#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs the real data the
# tests use and a Vulkan driver (Mesa's software one where there is no GPU),
# then runs every test of the workspace in release mode (burn's kernels are
# far too slow unoptimised; one release build serves both the quickstart and
# the tests), with the wgpu backend compiled in so that our CubeCL kernels are
# tested on it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-data.sh
bash scripts/setup-vulkan.sh
# Mesa complains when XDG_RUNTIME_DIR is unset or unusable.
if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -w "${XDG_RUNTIME_DIR}" ]; then
  XDG_RUNTIME_DIR="$(mktemp -d)"
  export XDG_RUNTIME_DIR
fi
cargo test --release --workspace --features wgpu 2>&1
