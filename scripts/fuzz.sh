#!/usr/bin/env bash
# Fuzzes every reader of pipe-bd (configs, sweeps, GGUF, IDX, run folders,
# checkpoints, wire frames) with mutated copies of valid inputs, for
# --minutes N in all (default 10), and prints per target the inputs tried,
# distinct errors seen, panics, crashes (aborts: an allocation past the
# ceiling), hangs (an input over 2 s) and peak memory. Findings (the
# inputs, replayable by their number and --seed) and summary.json go to
# runs/fuzz. Extra arguments go to pipebd-fuzz (see --help), e.g.
#   bash scripts/fuzz.sh --minutes 60 --targets gguf,config --seed 7
# The data the configs name comes from scripts/setup-data.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
args=("$@")
if [[ " ${args[*]-} " != *" --minutes "* && " ${args[*]-} " != *" --inputs "* ]]; then
  args+=(--minutes 10)
fi
cargo build --release -p pipebd-fuzz
exec target/release/pipebd-fuzz --out runs/fuzz "${args[@]}"
