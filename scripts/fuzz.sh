#!/usr/bin/env bash
# Fuzzes every reader of pipe-bd (configs, sweeps, GGUF, IDX, run folders,
# checkpoints, wire frames) with mutated copies of valid inputs, for
# --minutes N in all (default 10), and prints per target the inputs tried,
# distinct errors seen, panics, crashes (aborts: an allocation past the
# ceiling), hangs (an input over 2 s) and peak memory. Then the command line
# end to end: the pipebd binary under CLI_INPUTS random argument vectors
# (default 1000; mutated configs and run folders: exit 0, 1 or 2 with one
# message, never a panic or a crash) and KILLS runs stopped at random points
# by SIGKILL, SIGTERM or SIGINT (default 20), each resumed to the weights of
# the uninterrupted run. Findings (the inputs, replayable by their number
# and --seed), summary.json, cli.json and kills.json go to runs/fuzz. Extra
# arguments go to the readers' pipebd-fuzz (see --help), e.g.
#   CLI_INPUTS=5000 KILLS=100 bash scripts/fuzz.sh --minutes 60 --targets gguf,config --seed 7
# The data the configs name comes from scripts/setup-data.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
args=("$@")
if [[ " ${args[*]-} " != *" --minutes "* && " ${args[*]-} " != *" --inputs "* ]]; then
  args+=(--minutes 10)
fi
cargo build --release -p pipebd-fuzz -p pipebd-zoo --bin pipebd-fuzz --bin pipebd
target/release/pipebd-fuzz --out runs/fuzz "${args[@]}"
exec target/release/pipebd-fuzz --out runs/fuzz --cli "${CLI_INPUTS:-1000}" --kills "${KILLS:-20}"
