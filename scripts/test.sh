#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs the real data the
# tests use, then runs every test of the workspace in release mode (burn's
# kernels are far too slow unoptimised; one release build serves both the
# quickstart and the tests).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup-data.sh
cargo test --release --workspace 2>&1
