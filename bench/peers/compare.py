"""pipe-bd against its PyTorch peer on one recipe, side by side.

`--workload mnist` (the default, the quickstart): runs `pipebd run
experiments/mnist-cnn.toml` and bench/peers/mnist_cnn_torch.py on the same
machine, one after the other, `--rounds` times each (alternating, so both
see the same machine), and prints the ratios: samples/s while training,
stitched test accuracy, and each block's final loss.

`--workload minilm`: experiments/minilm-quick.toml (its probe section
dropped, `train_limit`, `max_tokens` and `stitched_epochs` set from the
flags) against bench/peers/minilm_torch.py: blockwise samples/s, the
stitched pass's samples/s with `--stitched-epochs N`, each block's final
loss (the students start from differently pruned teacher layers, so the
losses are alike, not equal) and per-block times. With
`--seeds 1,2,3`, each round runs every seed (the config's `seed` replaced,
the peer's `--seed` set): after one epoch the stitched accuracy of this
recipe spreads over points from seed to seed, in both. `--device cuda` runs
both on the GPU (pipe-bd built with `--features cuda`).

`--workload smollm2 --mode blockwise|stitched`: the SmolLM2-135M recipes
against bench/peers/smollm2_torch.py, for speed only. `blockwise` is
experiments/smollm2-quick.toml's blockwise epoch (its stitched pass
dropped), `stitched` experiments/smollm2-chosen.toml's stitched pass (no
blockwise epochs). pipe-bd runs a copy of the config with `train_limit` cut
to `(--steps + --warmup) * batch_size` sentences, so that it trains exactly
those steps, 16 held-out sentences to evaluate (not timed) and
`[runtime] threads_per_worker` (and RAYON_NUM_THREADS) set to `--threads`;
the peer runs the same steps at `--threads`. pipe-bd's report times its
whole loop (`train_seconds` over `steps_run` blockwise, `stitched.seconds`
over `stitched.steps` for the stitched pass), warm-up steps included, so the
ratio compares that with the peer's rate over all its steps, warm-up
included; the peer's steady state (median step after the warm-up) is shown
beside it. Where the report has per-step times (`step_seconds`, top level
for the blockwise loop, under `stitched` for the stitched pass; not written
yet), both sides are compared on their steady state instead. GFLOP/s of both
use the peer's FLOP count of a step (smollm2_torch.step_flops).

    cargo build --release && bash bench/peers/setup.sh
    bench/peers/.venv/bin/python bench/peers/compare.py --epochs 1
    bench/peers/.venv/bin/python bench/peers/compare.py --workload minilm --rounds 3 --threads 2
    bench/peers/.venv/bin/python bench/peers/compare.py --workload smollm2 --mode blockwise --steps 20 --threads 2 --rounds 3
    bench/peers/.venv/bin/python bench/peers/compare.py --workload smollm2 --mode stitched --steps 20 --threads 2 --rounds 3

Writes the measurements to runs/peers/compare-<workload>.json
(runs/peers/compare-smollm2-<mode>.json for smollm2).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def config_with_seed(path, seed, out):
    """A copy of the config at `path` in folder `out` with `seed = <seed>`."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    text, found = re.subn(r"(?m)^seed\s*=\s*\d+", f"seed = {seed}", text)
    if not found:
        sys.exit(f"{path}: no top-level `seed = N` line to replace")
    copy = os.path.join(out, "config.toml")
    with open(copy, "w") as f:
        f.write(text)
    return copy


def minilm_config(args, out):
    """A copy of the MiniLM config in folder `out` with the flags' data size,
    sequence length and stitched epochs, and without the probe (it only
    evaluates, after training)."""
    with open(os.path.join(ROOT, args.config)) as f:
        text = f.read()
    text = re.sub(r"(?ms)^\[data\.probe\].*?(?=^\[)", "", text)
    for key, value in (("train_limit", args.train_limit), ("max_tokens", args.max_tokens),
                       ("stitched_epochs", args.stitched_epochs), ("test_limit", 100)):
        text, found = re.subn(rf"(?m)^{key}\s*=\s*[^\n#]*", f"{key} = {value}", text, count=1)
        if not found:
            sys.exit(f"{args.config}: no `{key} = ...` line to replace")
    copy = os.path.join(out, "config.toml")
    with open(copy, "w") as f:
        f.write(text)
    return copy


def smollm2_config(args, out):
    """A copy of the SmolLM2 recipe in folder `out` that trains `--warmup +
    --steps` steps and no more: `train_limit` that many batches, 16 held-out
    sentences, `max_tokens` from the flag, one blockwise epoch and no
    stitched pass (`blockwise`) or no blockwise epoch and one stitched pass
    (`stitched`), `[runtime] threads_per_worker = --threads`."""
    with open(os.path.join(ROOT, args.config)) as f:
        text = f.read()
    batch = re.search(r"(?m)^batch_size\s*=\s*(\d+)", text)
    if not batch:
        sys.exit(f"{args.config}: no `batch_size = N` line")
    values = {"train_limit": (args.steps + args.warmup) * int(batch.group(1)), "test_limit": 16,
              "max_tokens": args.max_tokens}
    values.update({"epochs": 1, "stitched_epochs": 0} if args.mode == "blockwise" else
                  {"epochs": 0, "stitched_epochs": 1})
    for key, value in values.items():
        text, found = re.subn(rf"(?m)^({key}\s*=\s*)[^\s#]+", rf"\g<1>{value}", text, count=1)
        if not found:
            sys.exit(f"{args.config}: no `{key} = ...` line to replace")
    threads = f"threads_per_worker = {args.threads}"
    if not re.search(r"(?m)^\[runtime\]", text):
        text = text.rstrip("\n") + f"\n\n[runtime]\n{threads}\n"
    else:
        text, found = re.subn(r"(?m)^threads_per_worker\s*=\s*[^\n#]*", threads, text, count=1)
        if not found:
            text = re.sub(r"(?m)^\[runtime\]\s*$", f"[runtime]\n{threads}", text, count=1)
    copy = os.path.join(out, "config.toml")
    with open(copy, "w") as f:
        f.write(text)
    return copy


def run_pipebd_smollm2(args):
    """pipe-bd on the cut SmolLM2 recipe: its loop's rate over every step, and
    its steady state where the report has per-step times."""
    with tempfile.TemporaryDirectory() as out:
        config = smollm2_config(args, out)
        cmd = [args.pipebd, "run", config, "--out", out, "--quiet"]
        env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=env)
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
    batch = report["config"]["train"]["batch_size"]
    if args.mode == "blockwise":
        steps, seconds = report.get("steps_run") or report["steps"], report["train_seconds"]
        per_step = report.get("step_seconds")
    else:
        stitched = report.get("stitched")
        if not stitched:
            sys.exit("pipe-bd's report has no stitched pass")
        steps, seconds = stitched["steps"], stitched["seconds"]
        per_step = stitched.get("step_seconds")
    if steps != args.steps + args.warmup:
        print(f"warning: pipe-bd ran {steps} steps, not {args.steps + args.warmup}", file=sys.stderr)
    result = {"steps": steps, "all_steps_seconds": seconds, "all_steps_seconds_per_step": seconds / steps,
              "all_steps_samples_per_second": steps * batch / seconds,
              "wall_seconds": report["wall_seconds"], "final_losses": [b["final_loss"] for b in report["blocks"]],
              "language": report.get("language")}
    if per_step and len(per_step) > args.warmup:
        median = statistics.median(per_step[args.warmup:])
        result.update(seconds_per_step=median, samples_per_second=batch / median, step_seconds=per_step)
    return result


def run_peer_smollm2(args):
    cmd = [sys.executable, os.path.join(ROOT, "bench/peers/smollm2_torch.py"), "--mode", args.mode,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--max-tokens", str(args.max_tokens)]
    done = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_smollm2(args):
    ours, theirs = [], []
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}: pipe-bd ...", file=sys.stderr, flush=True)
        ours.append(run_pipebd_smollm2(args))
        print(f"round {r + 1}/{args.rounds}: pytorch ...", file=sys.stderr, flush=True)
        theirs.append(run_peer_smollm2(args))
    median = lambda runs, key: statistics.median(run[key] for run in runs)
    flops = theirs[0]["flops_per_step"]
    steady = all("samples_per_second" in run for run in ours)
    total = args.steps + args.warmup
    print(f"SmolLM2 {args.mode} ({args.config}), {args.steps} steps after {args.warmup} warm-up at batch "
          f"{theirs[0]['batch_size']} x {args.max_tokens} tokens, {flops / 1e9:.1f} GFLOP per step, "
          f"{args.threads} threads, {args.rounds} round(s); peer: {theirs[0]['peer']}")
    print(f"{'':<28}{'pipe-bd':>12}{'pytorch':>12}{'ratio':>10}")

    def row(label, a, b, faster):
        """`faster(a, b)`: how many times faster pipe-bd is, from the two figures."""
        text = lambda v: f"{v:>12.3f}" if v is not None else f"{'-':>12}"
        ratio = f"{faster(a, b):>9.2f}x" if a is not None else ""
        print(f"{label:<28}{text(a)}{text(b)}{ratio}")

    per_second = lambda a, b: a / b
    per_step = lambda a, b: b / a
    a_all, b_all = median(ours, "all_steps_seconds_per_step"), median(theirs, "all_steps_seconds_per_step")
    a_steady = median(ours, "seconds_per_step") if steady else None
    b_steady = median(theirs, "seconds_per_step")
    batch = theirs[0]["batch_size"]
    row(f"s/step, all {total} steps", a_all, b_all, per_step)
    row(f"samples/s, all {total} steps", batch / a_all, batch / b_all, per_second)
    row(f"GFLOP/s, all {total} steps", flops / 1e9 / a_all, flops / 1e9 / b_all, per_second)
    row("s/step, steady (median)", a_steady, b_steady, per_step)
    row("samples/s, steady", batch / a_steady if steady else None, batch / b_steady, per_second)
    row("GFLOP/s, steady", flops / 1e9 / a_steady if steady else None, flops / 1e9 / b_steady, per_second)
    if steady:
        speed, measure = median(ours, "samples_per_second") / median(theirs, "samples_per_second"), "steady state"
    else:
        print("(pipe-bd's report.json has no per-step times: its steady state is not known)")
        speed = median(ours, "all_steps_samples_per_second") / median(theirs, "all_steps_samples_per_second")
        measure = f"all {total} steps, warm-up included"
    print(f"speed ratio, pipe-bd samples/s over pytorch samples/s ({measure}): {speed:.2f}x")
    os.makedirs(os.path.join(ROOT, "runs/peers"), exist_ok=True)
    with open(os.path.join(ROOT, f"runs/peers/compare-smollm2-{args.mode}.json"), "w") as f:
        json.dump({"workload": "smollm2", "mode": args.mode, "config": args.config, "steps": args.steps,
                   "warmup": args.warmup, "threads": args.threads, "flops_per_step": flops, "speed_ratio": speed,
                   "speed_measure": measure, "pipebd": ours, "pytorch": theirs}, f, indent=1)


def run_pipebd(args, seed):
    with tempfile.TemporaryDirectory() as out:
        if args.workload == "minilm":
            config = minilm_config(args, out)
        else:
            config = args.config if seed is None else config_with_seed(args.config, seed, out)
        cmd = [args.pipebd, "run", config, "--out", out, "--epochs", str(args.epochs), "--quiet"]
        if args.device:
            cmd += ["--device", args.device]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
    result = {
        "samples_per_second": report["samples_per_second"],
        "train_seconds": report["train_seconds"],
        "student_accuracy": report.get("student_accuracy"),
        "teacher_accuracy": report.get("teacher_accuracy"),
        "final_losses": [b["final_loss"] for b in report["blocks"]],
    }
    stitched = report.get("stitched")
    if stitched:
        result["stitched_samples_per_second"] = stitched["steps"] * report["config"]["train"]["batch_size"] / \
            stitched["seconds"]
    return result


def profile_pipebd(args):
    """Per block at the full batch on one slot: teacher forward and student step (ms)."""
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "profile.json")
        config = minilm_config(args, out) if args.workload == "minilm" else args.config
        cmd = [args.pipebd, "profile", config, "--devices", args.device or "cpu", "--out", path]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(path) as f:
            entries = json.load(f)["entries"]
    ms = lambda t: 1e3 * t["median"] if t else float("nan")
    return [{"teacher_forward": ms(row[0]["teacher_forward"]), "student_step": ms(row[0]["student_step"])}
            for row in entries]


def run_peer(args, seed):
    if args.workload == "minilm":
        cmd = [sys.executable, os.path.join(ROOT, "bench/peers/minilm_torch.py"), "--epochs", str(args.epochs),
               "--threads", str(args.threads), "--train-limit", str(args.train_limit),
               "--max-tokens", str(args.max_tokens), "--stitched-epochs", str(args.stitched_epochs)]
    else:
        cmd = [sys.executable, os.path.join(ROOT, "bench/peers/mnist_cnn_torch.py"), "--epochs", str(args.epochs),
               "--threads", str(args.threads), "--device", args.device or "cpu"]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    done = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--workload", choices=["mnist", "minilm", "smollm2"], default="mnist",
                        help="the quickstart CNN recipe, MiniLM's encoder layers, or SmolLM2's decoder layers")
    parser.add_argument("--config", help="pipe-bd's config (default: experiments/mnist-cnn.toml, "
                        "experiments/minilm-quick.toml for minilm, experiments/smollm2-quick.toml for "
                        "smollm2 blockwise, experiments/smollm2-chosen.toml for smollm2 stitched)")
    parser.add_argument("--mode", choices=["blockwise", "stitched"], default="blockwise",
                        help="smollm2: the blockwise epoch or the stitched pass")
    parser.add_argument("--steps", type=int, default=20, help="smollm2: timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="smollm2: warm-up steps")
    parser.add_argument("--train-limit", type=int, default=1024, help="minilm: training sentences")
    parser.add_argument("--max-tokens", type=int, default=32, help="minilm, smollm2: tokens per sequence")
    parser.add_argument("--stitched-epochs", type=int, default=0, help="minilm: stitched epochs after training")
    parser.add_argument("--pipebd", default=os.path.join(ROOT, "target/release/pipebd"))
    parser.add_argument("--device", help="run both here: cpu or cuda[:N] (default: the config's device for "
                        "pipe-bd, the CPU for the peer)")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the config's, and the peer's 42)")
    args = parser.parse_args()
    if args.config is None:
        args.config = {"minilm": "experiments/minilm-quick.toml", "mnist": "experiments/mnist-cnn.toml",
                       "smollm2": f"experiments/smollm2-{'quick' if args.mode == 'blockwise' else 'chosen'}.toml"
                       }[args.workload]
    if args.workload == "smollm2":
        if args.seeds or args.device not in (None, "cpu"):
            sys.exit("--workload smollm2: the peer runs on the CPU with the config's seed (no --seeds, --device)")
        if args.steps < 1 or args.warmup < 0:
            sys.exit("--steps must be >= 1 and --warmup >= 0")
        if not os.path.exists(args.pipebd):
            sys.exit(f"{args.pipebd}: not found (cargo build --release first)")
        return compare_smollm2(args)
    if args.workload == "minilm" and (args.seeds or args.device not in (None, "cpu")):
        sys.exit("--workload minilm: the peer runs on the CPU with the config's seed (no --seeds, --device)")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [None]
    if not os.path.exists(args.pipebd):
        sys.exit(f"{args.pipebd}: not found (cargo build --release first)")

    ours, theirs = [], []
    for r in range(args.rounds):
        for seed in seeds:
            label = f"round {r + 1}/{args.rounds}" + ("" if seed is None else f", seed {seed}")
            print(f"{label}: pipe-bd ...", file=sys.stderr, flush=True)
            ours.append(dict(run_pipebd(args, seed), seed=seed))
            print(f"{label}: pytorch ...", file=sys.stderr, flush=True)
            theirs.append(dict(run_peer(args, seed), seed=seed))

    median = lambda runs, key: statistics.median(run[key] for run in runs)
    speed = median(ours, "samples_per_second") / median(theirs, "samples_per_second")
    recipe = "quickstart recipe" if args.workload == "mnist" else f"MiniLM recipe at {args.max_tokens} tokens"
    print(f"{recipe}, {args.epochs} epoch(s), {args.threads} threads, {args.rounds} round(s); "
          f"peer: {theirs[0]['peer']}")
    print(f"{'':<24}{'pipe-bd':>12}{'pytorch':>12}{'ratio':>10}")
    print(f"{'samples/s':<24}{median(ours, 'samples_per_second'):>12.1f}"
          f"{median(theirs, 'samples_per_second'):>12.1f}{speed:>9.2f}x")
    stitched_speed = None
    if args.workload == "minilm" and args.stitched_epochs:
        a, b = median(ours, "stitched_samples_per_second"), median(theirs, "stitched_samples_per_second")
        stitched_speed = a / b
        print(f"{'stitched samples/s':<24}{a:>12.1f}{b:>12.1f}{stitched_speed:>9.2f}x")
    if args.workload == "mnist":
        print(f"{'stitched accuracy':<24}{100 * median(ours, 'student_accuracy'):>11.2f}%"
              f"{100 * median(theirs, 'student_accuracy'):>11.2f}%")
    for k in range(len(ours[0]["final_losses"])):
        a = statistics.median(run["final_losses"][k] for run in ours)
        b = statistics.median(run["final_losses"][k] for run in theirs)
        print(f"{f'block {k + 1} final loss':<24}{a:>12.4f}{b:>12.4f}{a / b:>9.2f}x")
    if len(seeds) > 1:
        print("stitched accuracy per seed (pipe-bd / pytorch):")
        for a, b in zip(ours, theirs):
            print(f"  seed {a['seed']:<6}{100 * a['student_accuracy']:>8.2f}%{100 * b['student_accuracy']:>8.2f}%")
        for name, runs in (("pipe-bd", ours), ("pytorch", theirs)):
            acc = [100 * run["student_accuracy"] for run in runs]
            print(f"  {name:<10} mean {statistics.mean(acc):.2f}%  sd {statistics.stdev(acc):.2f}  "
                  f"min {min(acc):.2f}%  max {max(acc):.2f}%")
    print("per block, median ms per step (pipe-bd: `pipebd profile`; pytorch: timed in its loop):")
    ours_ms = profile_pipebd(args)
    theirs_ms = theirs[0]["block_ms"]
    print(f"{'':<10}{'teacher forward (ours / theirs)':>34}{'student step (ours / theirs)':>34}")
    for k, (a, b) in enumerate(zip(ours_ms, theirs_ms)):
        tf = f"{a['teacher_forward']:.1f} / {b['teacher_forward']:.1f} = {a['teacher_forward'] / b['teacher_forward']:.1f}x"
        st = f"{a['student_step']:.1f} / {b['student_step']:.1f} = {a['student_step'] / b['student_step']:.1f}x"
        print(f"{f'block {k + 1}':<10}{tf:>34}{st:>34}")
    os.makedirs(os.path.join(ROOT, "runs/peers"), exist_ok=True)
    with open(os.path.join(ROOT, f"runs/peers/compare-{args.workload}.json"), "w") as f:
        json.dump({"workload": args.workload, "stitched_speed_ratio": stitched_speed, "epochs": args.epochs, "threads": args.threads, "seeds": seeds, "pipebd": ours, "pytorch": theirs,
                   "speed_ratio": speed, "pipebd_block_ms": ours_ms}, f, indent=1)


if __name__ == "__main__":
    main()
