#!/usr/bin/env python3
"""Issue 53's ablation: does blockwise local distillation (BLD) on the
normalized block loss help the SmolLM2 0.75x student at equal wall time?

Every row trains the same selection (experiments/smollm2-chosen.toml: layers
1-7, 11, 25 whole, the SwiGLU of the 21 others halved) and is scored on the
same 199 held-out Brown sentences. The rows:

  a   refit init -> head-KL pass only (today's recipe)
  b   refit init -> BLD (nmse) -> head-KL pass
  c   the search's BLD-trained candidates -> head-KL pass (needs `--search`: a run
      of experiments/smollm2-search.toml with `teacher.block_loss = "nmse"`,
      Adam 5e-4 and epsilon 1e-12, into runs/smollm2-search-nmse)
  d   b with the block losses kept in the stitched pass (`--block-weight`, 1)

Steps are set from each phase's step cost measured on this machine (flags
below) so that every row spends the same minutes; the minutes each phase
really took come from its report.json. Configs are written next to their run.

  python3 bench/ablation/smollm2_ablation.py run a b c d --minutes 15 --bld-lr 5e-4 --epsilon 1e-12
  python3 bench/ablation/smollm2_ablation.py table      # runs/ablation-53/table.md
  python3 bench/ablation/smollm2_ablation.py run a --minutes 15 --seed 43   # the spread: runs/ablation-53/a-seed43

Probes: `init` (the refit init scored), `bld:<lr>[:<epsilon>]` (60 BLD
steps, then scored), `w:<weight>` (60 BLD + 60 KL steps with the block
losses at that weight).
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "experiments" / "smollm2-chosen.toml"
OUT = ROOT / "runs" / "ablation-53"
PIPEBD = ROOT / "target" / "release" / "pipebd"
BATCH = 16


def set_key(text, section, key, value):
    """Sets `key = value` in `[section]` of a TOML text (adds it if absent)."""
    lines = text.split("\n")
    start = next(i for i, l in enumerate(lines) if l.strip() == f"[{section}]")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    for i in range(start + 1, end):
        if re.match(rf"{re.escape(key)}\s*=", lines[i]):
            lines[i] = f"{key} = {value}"
            return "\n".join(lines)
    lines.insert(start + 1, f"{key} = {value}")
    return "\n".join(lines)


def config(name, sentences, bld, block_loss="nmse", bld_lr=None, epsilon=None,
           block_weight=0.0, weights=None):
    """The chosen student's config for one row."""
    text = BASE.read_text()
    text = "\n".join(l for l in text.split("\n") if not l.startswith("#"))
    text = text.replace('name = "smollm2-chosen"', f'name = "{name.replace(":", "_")}"')
    text = set_key(text, "data", "train_limit", str(sentences))
    text = set_key(text, "teacher", "block_loss", f'"{block_loss}"')
    text = set_key(text, "train", "epochs", "1" if bld else "0")
    text = set_key(text, "train", "stitched_block_weight", repr(float(block_weight)))
    if bld_lr is not None:
        text = set_key(text, "optimizer", "lr", repr(bld_lr))
    if epsilon is not None:
        text = set_key(text, "optimizer", "epsilon", repr(epsilon))
    if weights is not None:
        # One `weights = "..."` per [[students]] table, in order.
        parts = text.split("[[students]]")
        assert len(parts) - 1 == len(weights), (len(parts) - 1, len(weights))
        text = parts[0] + "".join(
            "[[students]]" + p.rstrip("\n") + f'\nweights = "{w}"\n\n'
            for p, w in zip(parts[1:], weights))
    return text


def searched_weights(search_dir):
    """The trained weights of the chosen selection's candidates in a search run:
    candidate 0 (the layer kept) or 1 (SwiGLU halved) of every block, read from
    the chosen selection in smollm2-chosen.toml."""
    students = BASE.read_text().split("[[students]]")[1:]
    scores = json.loads((search_dir / "search.json").read_text())
    out = []
    for block, student in enumerate(students):
        c = 1 if "ffn = 768" in student else 0
        cands = scores["blocks"][block]["candidates"]
        assert cands[c]["table"].get("ffn") == (768 if c else None), cands[c]["table"]
        out.append(str((search_dir / cands[c]["weights"]).resolve()))
    return out


SEED = None


def run(name, text):
    if SEED is not None:
        name = f"{name}-seed{SEED}"
        text = text.replace(f'name = "{name.split("-seed")[0].replace(":", "_")}"', f'name = "{name.replace(":", "_")}"')
        text = re.sub(r"(?m)^seed = \d+", f"seed = {SEED}", text, count=1)
    name = name.replace(":", "_")
    run_dir = OUT / name
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = OUT / f"{name}.toml"
    cfg.write_text(text)
    log = OUT / f"{name}.log"
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {cfg}", flush=True)
    with open(log, "w") as f:
        rc = subprocess.call([str(PIPEBD), "run", str(cfg), "--out", str(run_dir), "--quiet"],
                             stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: exit {rc}", flush=True)
    if rc != 0:
        sys.exit(f"{name} failed: see {log}")


def sentences_for(seconds, per_step):
    return max(1, int(seconds / per_step)) * BATCH


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["run", "table"])
    p.add_argument("rows", nargs="*")
    p.add_argument("--minutes", type=float, default=20.0, help="each row's whole budget")
    p.add_argument("--overhead", type=float, default=70.0, help="s of init + eval per run")
    p.add_argument("--kl-step", type=float, default=3.1, help="s per head-KL step")
    p.add_argument("--bld-step", type=float, default=1.65, help="s per BLD step")
    p.add_argument("--bld-lr", type=float, default=5e-5)
    p.add_argument("--epsilon", type=float, default=None)
    p.add_argument("--block-weight", type=float, default=1.0, help="row d")
    p.add_argument("--search", default=str(ROOT / "runs" / "smollm2-search-nmse"))
    p.add_argument("--probe-steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=None,
                   help="another seed (sentence order, init): runs named <row>-seed<N>, for the spread")
    a = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    global SEED
    SEED = a.seed
    train = a.minutes * 60 - a.overhead
    if a.what == "table":
        return table()
    for row in a.rows:
        if row == "a":
            run("a", config("a", sentences_for(train, a.kl_step), bld=False))
        elif row == "b":
            run("b", config("b", sentences_for(train, a.bld_step + a.kl_step), bld=True,
                            bld_lr=a.bld_lr, epsilon=a.epsilon))
        elif row == "c":
            run("c", config("c", sentences_for(train, a.kl_step), bld=False,
                            weights=searched_weights(Path(a.search))))
        elif row == "d":
            run("d", config("d", sentences_for(train, a.bld_step + a.kl_step), bld=True,
                            bld_lr=a.bld_lr, epsilon=a.epsilon, block_weight=a.block_weight))
        elif row == "init":
            # The refit init scored: one head-KL step at a learning rate of ~0.
            text = config("init", BATCH, bld=False)
            run("init", set_key(text, "train", "stitched_lr", "1e-15"))
        elif row.startswith("bld:"):
            # BLD probes: `bld:<lr>[:<epsilon>]`, BLD steps only, then one ~0 KL step.
            bits = row.split(":")[1:]
            lr = float(bits[0])
            eps = float(bits[1]) if len(bits) > 1 else None
            text = config(row, a.probe_steps * BATCH, bld=True, bld_lr=lr, epsilon=eps)
            run(row, set_key(text, "train", "stitched_lr", "1e-15"))
        elif row.startswith("w:"):
            # Block-weight probes: `w:<weight>`: probe-steps BLD + probe-steps KL steps.
            w = float(row[2:])
            run(row, config(row, a.probe_steps * BATCH, bld=True, bld_lr=a.bld_lr,
                            epsilon=a.epsilon, block_weight=w))
        else:
            sys.exit(f"unknown row {row}")


def table():
    rows = []
    for report_path in sorted(OUT.glob("*/report.json")):
        r = json.loads(report_path.read_text())
        lang = r["language"]
        st = r.get("stitched") or {}
        bld_s = r.get("train_seconds", 0.0) if r["steps_run"] else 0.0
        rows.append((report_path.parent.name, r, lang, st, bld_s))
    teacher = rows[0][2]["teacher_perplexity"] if rows else float("nan")
    lines = [
        f"teacher perplexity {teacher:.2f} on {rows[0][2]['heldout_sequences'] if rows else 0} held-out sentences",
        "",
        "| row | block loss | BLD steps | BLD min | KL steps | KL min | whole run min | perplexity | vs teacher | top-1 | KL | peak GB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r, lang, st, bld_s in rows:
        ppl = lang["student_perplexity"]
        lines.append(
            f"| {name} | {r['config']['teacher'].get('block_loss', 'mse')} "
            f"(w {r['config']['train']['stitched_block_weight']:g}) | {r['steps_run']} | {bld_s / 60:.1f} | "
            f"{st.get('steps', 0)} | {st.get('seconds', 0) / 60:.1f} | {r['wall_seconds'] / 60:.1f} | "
            f"{ppl:.2f} | {100 * (ppl / lang['teacher_perplexity'] - 1):+.1f}% | "
            f"{100 * lang['top1_agreement']:.1f}% | {lang['mean_kl']:.3f} | "
            f"{(r.get('peak_memory_bytes') or 0) / 1e9:.2f} |")
    text = "\n".join(lines) + "\n"
    (OUT / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
