#!/usr/bin/env bash
# Kernel launches and host reads per training step of the quickstart on a
# CubeCL device, counted rather than timed, and the training throughput:
#
#   bash scripts/wgpu-counts.sh                       # target/release/pipebd on wgpu
#   bash scripts/wgpu-counts.sh path/to/pipebd cuda   # another binary, or device
#   STEPS=5,15 bash scripts/wgpu-counts.sh ...        # the two run lengths
#   WORKLOAD=smollm2 bash scripts/wgpu-counts.sh      # SmolLM2's blockwise step
#
# WORKLOAD=smollm2 counts SmolLM2's blockwise step instead (batches of 16
# sentences of 32 tokens, every layer a whole student, steps 3 and 5 unless
# STEPS says otherwise) on the teacher's first 4 layers (data/smollm2's cut
# file of scripts/gpu-pack.sh, written here by the binary when missing), so
# that a step's launches are the decoder layer's times four.
#
# Launches: CubeCL's own profiling log at its `minimal` level (one line per
# kernel launch, no timing, no device syncs), switched on by a cubecl.toml in
# the folder each run starts from. Two runs of the quickstart recipe differ
# only in their number of training steps (STEPS, default 25 and 45 batches of
# 128, losses logged at the first and last step only); the difference of
# their launch counts over the difference of their steps is the launches of
# one training step between logged steps (start-up, the logged steps and the
# evaluation cancel out). The same for host reads where the binary reports
# them (`host_reads` in report.json; builds before it did not). Prints a
# table, the kernels of one step by name, and writes counts.json.
#
# Works with any pipebd binary built with the `wgpu` (or `cuda`) feature, so
# a build from before a change is measured exactly as one after it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$(realpath "${1:-$root/target/release/pipebd}")"
device="${2:-wgpu}"
workload="${WORKLOAD:-mnist}"
case "$workload" in
  mnist) default_steps=25,45 ;;
  smollm2) default_steps=3,5 ;;
  *) echo "wgpu-counts: WORKLOAD=$workload: expected mnist or smollm2" >&2; exit 2 ;;
esac
IFS=, read -r short long <<<"${STEPS:-$default_steps}"
say() { echo "wgpu-counts: $*" >&2; }
[ -x "$bin" ] || { say "no pipebd binary at $bin (cargo build --release --features wgpu)"; exit 2; }
if [ "$workload" = mnist ]; then
  [ -f "$root/data/mnist/train-images-idx3-ubyte" ] || [ -f "$root/data/mnist/train-images-idx3-ubyte.gz" ] ||
    { say "MNIST is missing under $root/data/mnist: bash scripts/setup-data.sh"; exit 2; }
  batch=128
else
  [ -f "$root/data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] && [ -d "$root/data/brown" ] ||
    { say "SmolLM2 or Brown is missing under $root/data: bash scripts/setup-data.sh"; exit 2; }
  cut="$root/data/smollm2/smollm2-135m-first-4.gguf"
  if [ ! -f "$cut" ]; then
    say "writing $cut (SmolLM2's first 4 layers)"
    (cd "$root" && "$bin" export --teacher experiments/smollm2-chosen.toml --first-layers 4 --type q4_1 \
      --out "$cut" --quiet) || { say "could not cut the SmolLM2 teacher"; exit 1; }
  fi
  batch=16
fi
if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -w "${XDG_RUNTIME_DIR}" ]; then
  XDG_RUNTIME_DIR="$(mktemp -d)"
  export XDG_RUNTIME_DIR
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

run() { # run NAME STEPS: the quickstart on STEPS batches from its own folder
  local name="$1" steps="$2" dir="$work/$1"
  mkdir -p "$dir"
  cat >"$dir/cubecl.toml" <<EOF
[profiling.logger]
level = "minimal"
file = "$dir/launches.log"
append = false
EOF
  if [ "$workload" = mnist ]; then
    sed -e "s|^device = .*|device = \"$device\"|" \
        -e "s|^dir = \"data/mnist\"|dir = \"$root/data/mnist\"\ntrain_limit = $((steps * 128))\ntest_limit = 256|" \
        -e "s|^weights = \"data/|weights = \"$root/data/|" \
        -e "s|^epochs = .*|epochs = 1|" \
        -e "s|^log_every = .*|log_every = 1000000|" \
        "$root/experiments/mnist-cnn.toml" >"$dir/config.toml"
  else
    printf '%s\n' 'name = "wgpu-counts-smollm2"' "device = \"$device\"" '[data]' 'dataset = "brown"' \
      "dir = \"$root/data/brown\"" "train_limit = $((steps * 16))" 'test_limit = 16' 'max_tokens = 32' \
      '[teacher]' 'kind = "smollm2-135m"' "weights = \"$cut\"" '[train]' 'epochs = 1' 'batch_size = 16' \
      'log_every = 1000000' '[optimizer]' 'kind = "adam"' 'lr = 5e-5' >"$dir/config.toml"
    for _ in 1 2 3 4; do printf '[[students]]\nkind = "decoder"\n' >>"$dir/config.toml"; done
  fi
  say "$name: $steps steps on $device"
  (cd "$dir" && "$bin" run config.toml --out "$dir/run" --quiet >"$dir/stdout.log" 2>"$dir/stderr.log") || {
    cat "$dir/stderr.log" >&2
    say "$name: the run failed (its output is above)"
    exit 1
  }
  # The logger writes from its own thread: give it a moment to drain.
  sleep 1
}

run short "$short"
run long "$long"

python3 - "$work" "$short" "$long" "$bin" "$device" "$workload" "$batch" <<'PY'
import collections, json, os, re, sys
work, short, long_, binary, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
workload, batch = sys.argv[6], int(sys.argv[7])
def kernels(name):
    counts = collections.Counter()
    with open(os.path.join(work, name, "launches.log")) as f:
        for line in f:
            if line.startswith("Executing "):
                # The kernel's name without its generic arguments.
                counts[re.sub(r"<.*", "", line[len("Executing "):].strip())] += 1
    return counts
def report(name):
    with open(os.path.join(work, name, "run", "report.json")) as f:
        return json.load(f)
a, b = kernels("short"), kernels("long")
ra, rb = report("short"), report("long")
steps = long_ - short
per_step = (sum(b.values()) - sum(a.values())) / steps
reads = None
if "host_reads" in ra and "host_reads" in rb:
    reads = (rb["host_reads"] - ra["host_reads"]) / steps
result = {
    "binary": binary,
    "device": device,
    "workload": workload,
    "steps": [short, long_],
    "launches_per_step": per_step,
    "host_reads_per_step": reads,
    "host_reads_per_run": [ra.get("host_reads"), rb.get("host_reads")],
    "samples_per_second": rb["samples_per_second"],
    "kernels_per_step": {k: (b[k] - a[k]) / steps for k in sorted(set(a) | set(b)) if b[k] != a[k]},
}
print(f"binary        {binary}")
print(f"device        {device}")
print(f"launches/step {per_step:.1f}   (runs of {short} and {long_} steps: {sum(a.values())} and {sum(b.values())} launches)")
print(f"host reads    {'not reported by this build' if reads is None else f'{reads:.2f} per step between logged steps'}"
      + ("" if reads is None else f" ({ra['host_reads']} and {rb['host_reads']} in the two runs)"))
print(f"samples/s     {rb['samples_per_second']:.1f}   (training, {long_} steps at batch {batch})")
print("kernels of one step:")
for name, count in sorted(result["kernels_per_step"].items(), key=lambda kv: -kv[1]):
    print(f"  {count:6.1f}  {name}")
out = os.environ.get("COUNTS_JSON", "counts.json")
with open(out, "w") as f:
    json.dump(result, f, indent=2)
print(f"(written to {out})")
PY
