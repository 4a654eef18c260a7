#!/usr/bin/env bash
# pipe-bd against its PyTorch peer on a CUDA GPU, in one short call (under 6
# minutes) on a machine with no Rust and no internet, from what
# scripts/gpu-pack.sh packed into .gpu/ (carried there: carry [".gpu"]):
#   1. unpacks .gpu/pipebd.xz into .gpu/bin/pipebd and the MNIST files and the
#      teacher into data/ (checked against .gpu/SHA256SUMS);
#   2. `pipebd kernels --check`: our fused ops against burn's (pass / fail);
#   3. the quickstart (experiments/mnist-cnn.toml, 1 epoch) at batch 128 and
#      1024, and bench/peers/mnist_cnn_torch.py at the same batches;
#   4. `pipebd kernels --bench --repeats 30` (timings, as printed);
#   5. `pipebd profile` at batch 1024 (the spread of its repeated timings);
#   6. the batch-128 run once more: the cost of a second start;
#   7. the decoder LLM (when the pack has it): SmolLM2's blockwise step (each
#      layer a student on the teacher's states, one Adam each) and its
#      stitched pass (the student end to end, KL through the frozen LM head),
#      on the first 4 layers gpu-pack.sh cut from SmolLM2-135M, 16 sentences
#      of 32 tokens per step, against bench/peers/smollm2_torch.py on the same
#      file (with the gguf reader packed beside it);
# and ends with tables of ratios. Each step runs under `timeout`, within
# the whole budget; one that fails or runs out of time is reported and the
# next one runs, so every call ends with the table.
#
#   bash scripts/gpu-bench.sh                               # on the GPU machine
#   bash scripts/gpu-bench.sh --device cpu --train-limit 2560   # dry run, anywhere
#
# Options: --device cuda[:N] | cpu (default cuda), --train-limit N (train on N
# samples, pipe-bd and peer alike; for dry runs), --budget SECONDS (counted
# from the start: no step runs past it; default 420, so that the whole call
# ends within 8 minutes), --llm-steps N (timed steps of each SmolLM2 run
# after 5 warm-up steps; default 40). PYTHON=... picks the Python with torch (default: the
# first of bench/peers/.venv/bin/python, python3, python that imports torch).
# When $OUT is set, gpu-bench.log (what it printed) and gpu-bench.tar.gz (the
# configs, reports, peer and profile JSON and each step's output) go there.
set -uo pipefail # no -e: a step that fails is reported, and the next one runs
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2

device=cuda
train_limit=""
budget=420
BATCHES=(128 1024)
llm_steps=40
LLM_WARMUP=5
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="${2:?--device needs a value}"; shift 2 ;;
    --train-limit) train_limit="${2:?--train-limit needs a value}"; shift 2 ;;
    --budget) budget="${2:?--budget needs a value}"; shift 2 ;;
    --llm-steps) llm_steps="${2:?--llm-steps needs a value}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu-bench: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
case "$device" in
  cpu | cuda | cuda:[0-9]*) ;;
  *) echo "gpu-bench: --device $device: expected cuda[:N] or cpu" >&2; exit 2 ;;
esac
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu-bench: --budget $budget: expected whole seconds" >&2; exit 2; }
[[ "$llm_steps" =~ ^[1-9][0-9]*$ ]] || { echo "gpu-bench: --llm-steps $llm_steps: expected a positive number" >&2; exit 2; }
[[ -z "$train_limit" || "$train_limit" =~ ^[1-9][0-9]*$ ]] ||
  { echo "gpu-bench: --train-limit $train_limit: expected a positive number" >&2; exit 2; }

started="$(date +%s)"
deadline=$((started + budget))
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-bench.XXXXXX")"
bin="$root/.gpu/bin/pipebd"
status="$work/status.tsv" # step, outcome, seconds: read by the table

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
fatal() { echo "gpu-bench: ERROR: $*"; exit 2; }

# step NAME MAX_SECONDS STDOUT_FILE COMMAND...: runs COMMAND under timeout
# (at most MAX_SECONDS, and never past the deadline), stdout into the file,
# stderr into FILE.err; records the outcome; returns COMMAND's status.
step() {
  local name="$1" want="$2" out="$3"
  shift 3
  local left=$((deadline - $(date +%s)))
  local limit=$((want < left ? want : left))
  if [ "$limit" -lt 10 ]; then
    echo "== $name: skipped (the ${budget}s budget is spent)"
    printf '%s\tskipped: budget spent\t\n' "$name" >>"$status"
    return 125
  fi
  local shown="$*"
  shown="${shown//"$work/"/}"
  echo "== $name ($(date +%T), at most ${limit}s): ${shown//"$root/"/}"
  local t0 rc=0 took outcome
  t0="$(now)"
  timeout -k 5 "$limit" "$@" >"$out" 2>"$out.err" || rc=$?
  took="$(since "$t0")"
  case "$rc" in
    0) outcome="ok" ;;
    124 | 137) outcome="timed out (limit ${limit}s)" ;;
    *) outcome="failed (exit $rc)" ;;
  esac
  printf '%s\t%s\t%s\n' "$name" "$outcome" "$took" >>"$status"
  if [ "$rc" -eq 0 ]; then
    echo "   $name: ok in ${took}s"
  else
    echo "   $name: $outcome after ${took}s; the end of its output:"
    if [ -s "$out.err" ]; then tail -n 12 "$out.err"; elif [ -s "$out" ]; then tail -n 12 "$out"; else
      echo "(none)"
    fi | sed 's/^/   | /'
  fi
  return "$rc"
}

# show FILE: prints a step's output, at most 60 lines of it.
show() {
  [ -s "$1" ] || return 0
  head -n 60 "$1"
  local lines
  lines="$(wc -l <"$1")"
  [ "$lines" -le 60 ] || echo "   ... $((lines - 60)) more lines in gpu-bench.tar.gz ($(basename "$1"))"
}

# The first Python that imports torch (for the peer).
pick_python() {
  local c
  for c in "${PYTHON:-}" "$root/bench/peers/.venv/bin/python" python3 python; do
    if [ -z "$c" ] || ! command -v "$c" >/dev/null 2>&1; then continue; fi
    if timeout 90 "$c" -c 'import torch' >/dev/null 2>&1; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

# Decompressors, with Python's modules where the binaries are missing.
unxz_to() {
  if command -v xz >/dev/null 2>&1; then xz -dc "$1" >"$2"; else
    "$py_any" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"
  fi
}
gunzip_to() {
  if command -v gzip >/dev/null 2>&1; then gzip -dc "$1" >"$2"; else
    "$py_any" -c 'import gzip, shutil, sys; shutil.copyfileobj(gzip.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"
  fi
}
sha_of() { sha256sum "$1" | cut -d' ' -f1; }

unpack() {
  [ -f .gpu/pipebd.xz ] && [ -f .gpu/SHA256SUMS ] ||
    fatal "no .gpu/pipebd.xz or .gpu/SHA256SUMS here: run 'bash scripts/gpu-pack.sh' on the build machine and carry .gpu"
  [ -f .gpu/BUILD ] && sed 's/^/   /' .gpu/BUILD
  local sum path
  while read -r sum path; do
    if [ "$path" = ".gpu/bin/pipebd" ]; then
      mkdir -p .gpu/bin
      unxz_to .gpu/pipebd.xz "$path.part" || fatal "cannot decompress .gpu/pipebd.xz (truncated? pack again)"
      chmod +x "$path.part" && mv "$path.part" "$path"
    elif [ -f "$path" ] && [ "$(sha_of "$path")" = "$sum" ]; then
      continue # already there, the same bytes
    else
      mkdir -p "$(dirname "$path")"
      if [ -f ".gpu/$path.gz" ]; then
        gunzip_to ".gpu/$path.gz" "$path.part" || fatal "cannot decompress .gpu/$path.gz (pack again)"
      elif [ -f ".gpu/$path" ]; then
        cp ".gpu/$path" "$path.part"
      else
        fatal ".gpu/$path(.gz) is missing from the pack: run 'bash scripts/gpu-pack.sh' again"
      fi
      mv "$path.part" "$path"
    fi
    [ "$(sha_of "$path")" = "$sum" ] || fatal "$path does not match .gpu/SHA256SUMS: the pack is damaged, run gpu-pack.sh again"
  done <.gpu/SHA256SUMS
  echo "   unpacked and checked: $(awk '{ printf "%s ", $2 }' .gpu/SHA256SUMS)"
}

# Where libcuda and libnvrtc may live (as scripts/gpu-check.sh looks): the
# CUDA toolkit, and the nvidia wheels next to the Python that has torch. Only
# pipebd sees them, through a launcher that becomes $bin (the peer's torch
# keeps its own).
cuda_libraries() {
  local extra="" dir found
  for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    if [ -d "$dir" ]; then extra="$extra:$dir"; fi
  done
  if [ -n "$py_torch" ]; then
    while read -r dir; do
      if [ -n "$dir" ]; then extra="$extra:$dir"; fi
    done < <("$py_torch" -c "$WHEEL_LIBS" 2>/dev/null)
  fi
  # No empty entry: to the loader that means the current folder.
  local path="${LD_LIBRARY_PATH:-}$extra"
  path="${path#:}"
  printf '#!/usr/bin/env bash\nexport LD_LIBRARY_PATH=%q\nexec %q "$@"\n' "$path" "$bin" >"$work/pipebd"
  chmod +x "$work/pipebd"
  bin="$work/pipebd"
  found="$(IFS=:; for dir in $path; do
    if [ -n "$dir" ]; then ls "$dir"/libnvrtc.so* 2>/dev/null; fi
  done | head -n 4 | paste -sd' ' -)"
  echo "   libnvrtc: ${found:-none found (neither the CUDA toolkit's nor the nvidia pip wheels')}"
  if command -v ldconfig >/dev/null 2>&1; then
    echo "   libcuda: $(ldconfig -p 2>/dev/null | grep -m1 -o '/[^ ]*libcuda\.so[^ ]*' || echo 'not in ldconfig')"
  fi
}
WHEEL_LIBS='
import glob, os, site
for root in site.getsitepackages() + [site.getusersitepackages()]:
    for lib in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib"))):
        print(lib)
'

# make_config BATCH FILE: the quickstart on $device at BATCH, one epoch.
make_config() {
  local src=experiments/mnist-cnn.toml pattern n
  for pattern in '^device *= *"' '^batch_size *= *[0-9]' '^epochs *= *[0-9]'; do
    n="$(grep -c "$pattern" "$src")"
    [ "$n" = 1 ] || { echo "   $src: expected one line matching /$pattern/, found $n"; return 1; }
  done
  sed -e "s/^device *= *\"[^\"]*\"/device = \"$device\"/" \
    -e "s/^batch_size *= *[0-9]*/batch_size = $1/" \
    -e "s/^epochs *= *[0-9]*/epochs = 1/" "$src" >"$2"
  if [ -n "$train_limit" ]; then
    if grep -q '^train_limit *=' "$2"; then
      sed -i "s/^train_limit *=.*/train_limit = $train_limit/" "$2"
    else
      sed -i "/^\[data\]/a train_limit = $train_limit" "$2"
    fi
  fi
}

# run_pipebd NAME BATCH: one quickstart run into $work/NAME/.
run_pipebd() {
  local name="$1" batch="$2"
  mkdir -p "$work/$name"
  make_config "$batch" "$work/config-$batch.toml" || { printf '%s\tno config\t\n' "$name" >>"$status"; return 1; }
  step "$name" 90 "$work/$name/stdout" "$bin" run "$work/config-$batch.toml" --out "$work/$name" --quiet
}

# The decoder LLM of the pack (.gpu/LLM: the cut teacher's path and layer
# count), the Brown corpus unpacked into data/ and the peer's gguf reader into
# $work/py. Fails (and the llm steps are skipped) when the pack has none.
llm_cut=""
llm_layers=""
prepare_llm() {
  [ -f .gpu/LLM ] || { echo "   the pack has no SmolLM2 (.gpu/LLM): the llm steps are skipped"; return 1; }
  read -r llm_cut llm_layers <.gpu/LLM
  [ -f "$llm_cut" ] || { echo "   $llm_cut is missing: the llm steps are skipped"; return 1; }
  if [ ! -f data/brown/ca01 ]; then
    if command -v tar >/dev/null 2>&1; then tar -xzf data/brown.tar.gz -C data; else
      "$py_any" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' data/brown.tar.gz data
    fi || { echo "   cannot unpack data/brown.tar.gz: the llm steps are skipped"; return 1; }
  fi
  if [ -f .gpu/py.tar.gz ]; then
    mkdir -p "$work/py"
    "$py_any" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' .gpu/py.tar.gz "$work/py" ||
      echo "   cannot unpack .gpu/py.tar.gz (the peer's gguf reader)"
  fi
  echo "   SmolLM2: $llm_cut ($llm_layers layers), Brown in data/brown"
}

# llm_config MODE FILE: SmolLM2 on $device, every layer a student (whole, as
# the peer's), (warm-up + timed) steps of 16 sentences of 32 tokens:
# `blockwise` one epoch of the blockwise step (smollm2-quick.toml's
# optimizer), `stitched` the stitched pass alone (smollm2-chosen.toml's).
llm_config() {
  local mode="$1" lr=5e-5 k
  [ "$mode" = stitched ] && lr=2e-4
  {
    echo "name = \"gpu-bench-smollm2-$mode\""
    echo 'seed = 42'
    echo "device = \"$device\""
    echo 'schedule = "ideal"'
    echo '[data]'
    echo 'dataset = "brown"'
    echo 'dir = "data/brown"'
    echo "train_limit = $(((llm_steps + LLM_WARMUP) * 16))"
    echo 'test_limit = 16'
    echo 'max_tokens = 32'
    echo '[teacher]'
    echo 'kind = "smollm2-135m"'
    echo "weights = \"$llm_cut\""
    echo '[train]'
    echo 'batch_size = 16'
    echo 'log_every = 10'
    if [ "$mode" = blockwise ]; then
      echo 'epochs = 1'
    else
      echo 'epochs = 0'
      echo 'stitched_epochs = 1'
      echo "stitched_lr = $lr"
      echo 'stitched_gradients = "end-to-end"'
      echo 'stitched_output_loss = "head-kl"'
      echo 'stitched_output_weight = 1.0'
      echo 'stitched_block_weight = 0.0'
    fi
    echo '[optimizer]'
    echo 'kind = "adam"'
    echo "lr = $lr"
    echo 'epsilon = 1e-8'
    echo 'min_lr = 0.0'
    echo 'schedule = "cosine"'
    for ((k = 0; k < llm_layers; k++)); do
      printf '[[students]]\nkind = "decoder"\n'
    done
  } >"$2"
}

# run_llm MODE: pipe-bd's SmolLM2 run, then the peer's, in MODE.
run_llm() {
  local mode="$1"
  mkdir -p "$work/llm-$mode"
  llm_config "$mode" "$work/llm-$mode.toml"
  step "llm-$mode" 120 "$work/llm-$mode/stdout" "$bin" run "$work/llm-$mode.toml" --out "$work/llm-$mode" --quiet
  local peer_path="$work/py${PYTHONPATH:+:$PYTHONPATH}"
  if [ -z "$py_torch" ]; then
    printf '%s\tskipped: no torch\t\n' "llm-peer-$mode" >>"$status"
  elif ! PYTHONPATH="$peer_path" "$py_torch" -c 'import numpy, gguf' >/dev/null 2>&1; then
    echo "== llm-peer-$mode: skipped ($py_torch cannot import numpy and gguf, even with the packed reader)"
    printf '%s\tskipped: no numpy or gguf\t\n' "llm-peer-$mode" >>"$status"
  else
    step "llm-peer-$mode" 120 "$work/llm-peer-$mode.json" env PYTHONPATH="$peer_path" "$py_torch" \
      bench/peers/smollm2_torch.py --mode "$mode" --model "$llm_cut" --device "$device" \
      --steps "$llm_steps" --warmup "$LLM_WARMUP" --threads "$(nproc 2>/dev/null || echo 2)"
  fi
}

main() {
  echo "gpu-bench: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), device $device, budget ${budget}s${train_limit:+, train limit $train_limit}"
  py_any="$(command -v python3 || command -v python || true)"
  [ -n "$py_any" ] || echo "   warning: no python3 here: no peer, and the table shows raw files"
  if [ "$device" != cpu ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/   gpu: /'
    elif ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
      fatal "no NVIDIA GPU here (no working nvidia-smi, no /dev/nvidia*): this is for the GPU machine; '--device cpu' runs the same steps on the CPU as a dry run"
    fi
  fi
  echo "== unpacking .gpu/"
  unpack
  py_torch="$(pick_python || true)"
  if [ -n "$py_torch" ]; then
    echo "   peer python: $py_torch ($("$py_torch" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available:", torch.cuda.is_available())' 2>/dev/null))"
  else
    echo "   no Python with torch here (tried \$PYTHON, bench/peers/.venv, python3, python): the peer steps are skipped"
  fi
  [ "$device" = cpu ] || cuda_libraries

  step kernels-check 60 "$work/kernels-check.txt" "$bin" kernels --device "$device" --check
  show "$work/kernels-check.txt"
  local b
  for b in "${BATCHES[@]}"; do
    run_pipebd "run-$b" "$b"
  done
  for b in "${BATCHES[@]}"; do
    if [ -n "$py_torch" ]; then
      step "peer-$b" 60 "$work/peer-$b.json" "$py_torch" bench/peers/mnist_cnn_torch.py \
        --device "$device" --epochs 1 --batch-size "$b" ${train_limit:+--train-limit "$train_limit"}
    else
      printf '%s\tskipped: no torch\t\n' "peer-$b" >>"$status"
    fi
  done
  step kernels-bench 60 "$work/kernels-bench.txt" "$bin" kernels --device "$device" --bench --repeats 30
  show "$work/kernels-bench.txt"
  echo "== SmolLM2"
  if prepare_llm; then
    run_llm blockwise
    run_llm stitched
  else
    printf '%s\tskipped: no SmolLM2 in the pack\t\n' llm-blockwise llm-stitched >>"$status"
  fi
  local last="${BATCHES[${#BATCHES[@]} - 1]}"
  if [ -f "$work/config-$last.toml" ]; then
    step profile 45 "$work/profile.txt" "$bin" profile "$work/config-$last.toml" --devices "$device" \
      --out "$work/profile.json"
    show "$work/profile.txt"
  fi
  if grep -q "^run-${BATCHES[0]}"$'\t'"ok" "$status"; then
    run_pipebd "run-${BATCHES[0]}-again" "${BATCHES[0]}"
  else
    echo "== run-${BATCHES[0]}-again: skipped (the first start did not finish)"
    printf '%s\tskipped: the first start did not finish\t\n' "run-${BATCHES[0]}-again" >>"$status"
  fi

  echo
  if [ -n "$py_any" ]; then
    "$py_any" - "$work" "$device" "$(date +%s)" "$started" "${llm_layers:-0}" "$LLM_WARMUP" "${BATCHES[@]}" <<'PY'
import json, os, statistics, sys

work, device, now, started = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm_layers, llm_warmup, batches = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7:]
status = {}
with open(os.path.join(work, "status.tsv")) as f:
    for line in f:
        name, outcome, took = (line.rstrip("\n").split("\t") + ["", ""])[:3]
        status[name] = (outcome, float(took) if took else None)


def load(*path):
    try:
        with open(os.path.join(work, *path)) as f:
            text = f.read().strip()
        return json.loads(text.splitlines()[-1] if path[-1].startswith("peer-") else text)
    except (OSError, ValueError, IndexError):
        return None


def why(name):
    """A step's outcome in one or two words, for a table cell."""
    outcome = status.get(name, ("not run", None))[0]
    for short in ("failed", "timed out", "skipped", "no config"):
        if outcome.startswith(short):
            return short
    return "no report" if outcome == "ok" else outcome


ours = {b: load(f"run-{b}", "report.json") for b in batches}
theirs = {b: load(f"peer-{b}.json") for b in batches}
peer_name = next((t["peer"] for t in theirs.values() if t), "pytorch (no result)")
limit = next((f", {r['train_samples']} training samples" for r in ours.values() if r), "")
print(f"== pipe-bd on {device} against {peer_name}: the quickstart recipe, 1 epoch{limit}")
row = "{:>6} {:>18} {:>18} {:>9} {:>12} {:>12} {:>9} {:>10}"
print(row.format("batch", "pipe-bd samples/s", "pytorch samples/s", "ratio", "pipe-bd acc", "pytorch acc",
                 "diff pts", "host reads"))
for b in batches:
    o, t = ours[b], theirs[b]
    ratio = f"{o['samples_per_second'] / t['samples_per_second']:.2f}x" if o and t else "n/a"
    diff = f"{100 * (o['student_accuracy'] - t['student_accuracy']):+.2f}" if o and t else "n/a"
    print(row.format(
        b,
        f"{o['samples_per_second']:,.0f}" if o else why(f"run-{b}"),
        f"{t['samples_per_second']:,.0f}" if t else why(f"peer-{b}"),
        ratio,
        f"{100 * o['student_accuracy']:.2f}%" if o else "n/a",
        f"{100 * t['student_accuracy']:.2f}%" if t else "n/a",
        diff,
        str(o.get("host_reads", "n/a")) if o else "n/a",
    ))
for b in batches:
    for name, samples in ((f"run-{b}", "train_samples"), (f"peer-{b}", "train_samples")):
        outcome = status.get(name, ("",))[0]
        if outcome.startswith("timed out"):
            print(f"   {name} {outcome}: 1 epoch did not finish within it")
for b in batches:
    o, t = ours[b], theirs[b]
    if o and t:
        pairs = zip([blk["final_loss"] for blk in o["blocks"]], t["final_losses"])
        print(f"   batch {b}: final block losses pipe-bd / pytorch: "
              + ", ".join(f"{a:.4f}/{p:.4f}" for a, p in pairs))
outcome = status.get("kernels-check", ("not run", None))[0]
print(f"kernel check (pipebd kernels --check): "
      + {"ok": "passed"}.get(outcome, "FAILED" if outcome.startswith("failed") else outcome))
for name, label in ((f"run-{batches[0]}", "first start "), (f"run-{batches[0]}-again", "second start")):
    r, (outcome, took) = load(name, "report.json"), status.get(name, ("not run", None))
    if r and took is not None:
        print(f"{label} (batch {batches[0]}): process {took:.1f} s = training {r['train_seconds']:.1f} s "
              f"+ {took - r['train_seconds']:.1f} s outside it (start-up, loading, evaluation, saving; "
              f"{took - r['wall_seconds']:.1f} s before the run's own clock, report wall {r['wall_seconds']:.1f} s)")
    else:
        print(f"{label} (batch {batches[0]}): {outcome}")
profile = load("profile.json")
if profile:
    worst, per_block = None, []
    for k, row_ in enumerate(profile.get("entries", [])):
        spreads = [(e[q]["spread"], q, e[q]["median"], e[q]["repeats"]) for e in row_
                   for q in ("teacher_forward", "student_step", "optimizer_update") if e.get(q)]
        if spreads:
            s = max(spreads)
            per_block.append(f"{k + 1}: {100 * s[0]:.0f}%")
            if worst is None or s[0] > worst[0]:
                worst = (s[0], k + 1, s[1], s[2], s[3])
    if worst:
        print(f"profile spread (max-min)/median at batch {profile.get('batch_size')}: worst block {worst[1]} "
              f"{worst[2].replace('_', ' ')} {100 * worst[0]:.0f}% (median {1e3 * worst[3]:.2f} ms over "
              f"{worst[4]} repeats); worst per block {', '.join(per_block)}")
    else:
        print("profile spread: no timings in profile.json")
else:
    print(f"profile spread: {status.get('profile', ('not run',))[0]}")


def llm_flops(mode, layers, batch=16, tokens=32):
    """FLOPs of one SmolLM2 step with whole students (smollm2_torch.step_flops)."""
    hidden, q, kv, ffn, vocab = 576, 9 * 64, 3 * 64, 1536, 49152
    layer = 2 * tokens * (hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * ffn) + 4 * tokens * tokens * q
    per_sequence = layers * layer + 3 * layers * layer
    if mode == "stitched":
        per_sequence += 3 * 2 * tokens * hidden * vocab
    return batch * per_sequence


if llm_layers:
    print(f"== SmolLM2's first {llm_layers} layers (of 30) on {device}, batch 16 x 32 tokens, "
          f"every layer a student: seconds per step, GFLOP/s by the peer's count")
    row = "{:<30} {:>14} {:>14} {:>8} {:>12} {:>12}"
    print(row.format("step", "pipe-bd", "pytorch", "ratio", "pipe-bd GF/s", "pytorch GF/s"))
    for mode in ("blockwise", "stitched"):
        report, peer = load(f"llm-{mode}", "report.json"), load(f"llm-peer-{mode}.json")
        flops = llm_flops(mode, llm_layers)
        ours = {}
        if report and mode == "blockwise" and report.get("steps"):
            ours["all steps"] = report["train_seconds"] / report["steps"]
        if report and mode == "stitched" and report.get("stitched"):
            st = report["stitched"]
            ours["all steps"] = st["seconds"] / max(st["steps"], 1)
            if len(st.get("step_seconds", [])) > llm_warmup:
                ours["steady (median)"] = statistics.median(st["step_seconds"][llm_warmup:])
        theirs = {}
        if peer:
            theirs = {"all steps": peer["all_steps_seconds_per_step"], "steady (median)": peer["seconds_per_step"]}
        for label in ("all steps", "steady (median)"):
            a, b = ours.get(label), theirs.get(label)
            if a is None and b is None:
                continue
            # A figure, '-' where the side ran but does not measure it, or why it did not run.
            cell = lambda v, ran, name: f"{v:.4f}" if v is not None else "-" if ran else why(name)
            print(row.format(
                f"{mode}, {label}",
                cell(a, bool(ours), f"llm-{mode}"),
                cell(b, bool(theirs), f"llm-peer-{mode}"),
                f"{b / a:.2f}x" if a and b else "n/a",
                f"{flops / a / 1e9:.1f}" if a else "n/a",
                f"{flops / b / 1e9:.1f}" if b else "n/a",
            ))
        if not ours and not theirs:
            print(row.format(mode, why(f"llm-{mode}"), why(f"llm-peer-{mode}"), "n/a", "n/a", "n/a"))
    print("   (ratio: pytorch's seconds per step over pipe-bd's; 'all steps' counts the warm-up, "
          "pipe-bd's kernel compilation included; pipe-bd's blockwise report has no per-step times)")
print(f"whole script: {now - started} s; outputs in {work}")
PY
  else
    echo "no python3: the reports are in $work"
  fi
  awk -F'\t' '$2 != "ok" { bad = 1 } END { exit bad }' "$status"
}

touch "$status"
main 2>&1 | tee "$work/gpu-bench.log"
rc="${PIPESTATUS[0]}"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$work/gpu-bench.log" "$OUT/gpu-bench.log"
  tar -czf "$OUT/gpu-bench.tar.gz" -C "$work" --exclude=gpu-bench.log --exclude='*.mpk' --exclude=checkpoints . &&
    echo "gpu-bench: wrote $OUT/gpu-bench.log and $OUT/gpu-bench.tar.gz"
fi
exit "$rc"
