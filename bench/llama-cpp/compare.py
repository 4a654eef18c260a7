"""Teacher and students side by side in llama.cpp: exports SmolLM2 and the
students of the given run folders as GGUF files (`pipebd export`), then
measures each with llama.cpp's own tools built by build.sh (2 threads):

- file size, and the weight multiply-adds per token relative to the teacher
  (every linear layer and the LM head: what prompt processing pays);
- perplexity on the held-out Brown sentences (the split no run trains on,
  tag-stripped, one per line) at context 128 and 512 with
  `llama-perplexity`, and at 128 with `pipebd eval-gguf` beside it;
- KL divergence to the teacher and top-1 agreement at context 128
  (`llama-perplexity --kl-divergence`);
- `llama-bench -t 2`: prompt (pp128) and generation (tg64) tokens/s, and
  each ratio to the teacher next to its ideal: the multiply-add ratio for
  the prompt, the weight-byte ratio for generation.

Each model is written at the teacher's types (Q4_1 linear layers, Q8_0
embeddings) and, with --types, at others too. Results go to
runs/llama-cpp/ (table.md, results.json, the .gguf files). Standard library only.

    bash bench/llama-cpp/build.sh                    # once: 10-20 min
    cargo build --release                            # pipebd
    python3 bench/llama-cpp/compare.py runs/smollm2-chosen [more run folders] [--types teacher,q8_0]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "experiments/smollm2-chosen.toml"


def run(cmd, **kw):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        sys.exit(f"compare.py: {cmd[0]} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def export(pipebd, source, kind, out):
    args = ["export", "--teacher", source] if source == CONFIG else ["export", source]
    text = run([pipebd, *args, "--type", kind, "--out", out])
    ratio = float(re.search(r"([0-9.]+)x the teacher's", text).group(1))
    return ratio


def perplexity(bin_dir, model, text, context, chunks, extra=()):
    out = run([f"{bin_dir}/llama-perplexity", "-m", model, "-f", text, "-c", str(context),
               "--chunks", str(chunks), "-t", "2", *extra])
    found = {}
    # A KL pass prints its perplexity among the statistics instead.
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out) or re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", out)
    if m:
        found["ppl"] = float(m.group(1))
    m = re.search(r"Mean\s+KLD:\s+([0-9.]+)", out)
    if m:
        found["kld"] = float(m.group(1))
    m = re.search(r"Same top p:\s+([0-9.]+)", out)
    if m:
        found["same_top"] = float(m.group(1)) / 100.0
    return found


def bench(bin_dir, models, rounds, repetitions):
    """`llama-bench` of every model in turn, `rounds` times over (the
    machine's speed drifts by 10% between runs of a few seconds: each
    student is compared with the teacher of the same round): per model the
    median tokens/s, and per round its values, for the ratios."""
    per_round = []
    for r in range(rounds):
        speeds = {}
        for model in models:
            args = [f"{bin_dir}/llama-bench", "-t", "2", "-p", "128", "-n", "64", "-r", str(repetitions),
                    "-o", "json", "-m", model]
            done = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"compare.py: llama-bench failed:\n{done.stderr[-3000:]}")
            for row in json.loads(done.stdout):
                test = "pp128" if row["n_prompt"] > 0 else "tg64"
                speeds.setdefault(model, {})[test] = row["avg_ts"]
        per_round.append(speeds)
        print(f"compare.py: llama-bench round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    return per_round


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", default=["runs/smollm2-chosen"])
    parser.add_argument("--types", default="teacher", help="export types, comma-separated (teacher,q8_0,f16,...)")
    parser.add_argument("--chunks-128", type=int, default=100, help="windows scored at context 128")
    parser.add_argument("--chunks-512", type=int, default=25, help="windows scored at context 512")
    parser.add_argument("--rounds", type=int, default=10, help="llama-bench rounds over all models")
    parser.add_argument("--repetitions", type=int, default=3, help="llama-bench repetitions per round")
    parser.add_argument("--out", default="runs/llama-cpp")
    args = parser.parse_args()
    bin_dir = subprocess.run(["bash", "bench/llama-cpp/build.sh"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
    pipebd = os.path.join(REPO, "target/release/pipebd")
    if not os.path.exists(pipebd):
        sys.exit("compare.py: build pipebd first: cargo build --release")
    out = os.path.join(REPO, args.out)
    os.makedirs(out, exist_ok=True)
    text = os.path.join(out, "brown-heldout.txt")
    started = time.time()
    models = []
    for kind in args.types.split(","):
        for source in [CONFIG, *args.runs]:
            name = "teacher" if source == CONFIG else os.path.basename(os.path.normpath(source))
            path = os.path.join(out, f"{name}-{kind}.gguf")
            ratio = export(pipebd, source, kind, path)
            models.append({"name": name, "type": kind, "path": path, "macs_ratio": ratio,
                           "bytes": os.path.getsize(path)})
    # The held-out text, written by pipebd itself (the split its runs use),
    # and pipebd's own perplexity of each file beside llama.cpp's.
    for m in models:
        ours = run([pipebd, "eval-gguf", m["path"], "--text", "data/brown", "--save-text", text,
                    "--context", "128", "--chunks", str(args.chunks_128)])
        m["pipebd_ppl_128"] = float(re.search(r"perplexity ([0-9.]+)", ours).group(1))
    for kind in args.types.split(","):
        teacher = next(m for m in models if m["name"] == "teacher" and m["type"] == kind)
        base = os.path.join(out, f"teacher-{kind}.kld")
        teacher.update({"ppl_128": perplexity(bin_dir, teacher["path"], text, 128, args.chunks_128,
                                              ["--kl-divergence-base", base])["ppl"]})
        for m in models:
            if m["type"] != kind:
                continue
            m["ppl_512"] = perplexity(bin_dir, m["path"], text, 512, args.chunks_512)["ppl"]
            if m is teacher:
                continue
            found = perplexity(bin_dir, m["path"], text, 128, args.chunks_128,
                               ["--kl-divergence-base", base, "--kl-divergence"])
            m.update({"ppl_128": found["ppl"], "kld": found.get("kld"), "same_top": found.get("same_top")})
        os.remove(base)
    rounds = bench(bin_dir, [m["path"] for m in models], args.rounds, args.repetitions)
    for m in models:
        teacher = next(t for t in models if t["name"] == "teacher" and t["type"] == m["type"])
        for test in ("pp128", "tg64"):
            m[test] = median([r[m["path"]][test] for r in rounds])
            ratios = sorted(r[m["path"]][test] / r[teacher["path"]][test] for r in rounds)
            m[f"{test}_ratio"] = median(ratios)
            m[f"{test}_ratio_range"] = [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]
    lines = table(models)
    print("\n".join(lines))
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"models": models, "threads": 2, "bench_rounds": rounds, "text": "Brown held-out sentences (pipebd's split)",
                   "chunks_128": args.chunks_128, "chunks_512": args.chunks_512,
                   "minutes": (time.time() - started) / 60}, f, indent=2)
    print(f"compare.py: wrote {out}/table.md and results.json in {(time.time() - started) / 60:.1f} min",
          file=sys.stderr)


def table(models):
    lines = [
        "| model | type | MB | weight MACs | ppl c128 llama.cpp (pipebd) | ppl c512 | KL to teacher | same top-1 "
        "| pp128 tok/s | x teacher [IQR] (ideal) | tg64 tok/s | x teacher [IQR] (ideal) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        teacher = next(t for t in models if t["name"] == "teacher" and t["type"] == m["type"])
        ideal_pp, ideal_tg = 1 / m["macs_ratio"], teacher["bytes"] / m["bytes"]
        kld = "-" if m.get("kld") is None else f"{m['kld']:.3f}"
        same = "-" if m.get("same_top") is None else f"{100 * m['same_top']:.1f}%"
        ratio = lambda test: "{:.3f} [{:.2f}-{:.2f}]".format(m[f"{test}_ratio"], *m[f"{test}_ratio_range"])
        lines.append(
            f"| {m['name']} | {m['type']} | {m['bytes'] / 1e6:.1f} | {m['macs_ratio']:.3f}x "
            f"| {m['ppl_128']:.2f} ({m['pipebd_ppl_128']:.2f}) | {m['ppl_512']:.2f} | {kld} | {same} "
            f"| {m['pp128']:.1f} | {ratio('pp128')} ({ideal_pp:.3f}) "
            f"| {m['tg64']:.1f} | {ratio('tg64')} ({ideal_tg:.3f}) |"
        )
    return lines


if __name__ == "__main__":
    main()
