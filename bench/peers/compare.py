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

    cargo build --release && bash bench/peers/setup.sh
    bench/peers/.venv/bin/python bench/peers/compare.py --epochs 1
    bench/peers/.venv/bin/python bench/peers/compare.py --workload minilm --rounds 3 --threads 2

Writes the measurements to runs/peers/compare-<workload>.json.
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
    parser.add_argument("--workload", choices=["mnist", "minilm"], default="mnist",
                        help="the quickstart CNN recipe, or MiniLM's encoder layers")
    parser.add_argument("--config", help="pipe-bd's config (default: experiments/mnist-cnn.toml, "
                        "or experiments/minilm-quick.toml for minilm)")
    parser.add_argument("--train-limit", type=int, default=1024, help="minilm: training sentences")
    parser.add_argument("--max-tokens", type=int, default=32, help="minilm: tokens per sequence")
    parser.add_argument("--stitched-epochs", type=int, default=0, help="minilm: stitched epochs after training")
    parser.add_argument("--pipebd", default=os.path.join(ROOT, "target/release/pipebd"))
    parser.add_argument("--device", help="run both here: cpu or cuda[:N] (default: the config's device for "
                        "pipe-bd, the CPU for the peer)")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the config's, and the peer's 42)")
    args = parser.parse_args()
    if args.config is None:
        args.config = "experiments/minilm-quick.toml" if args.workload == "minilm" else "experiments/mnist-cnn.toml"
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
