"""Held-out acceptance over training time, one line per run, from `peagle train` logs (train_log.jsonl).

Usage: python scripts/plot_training.py NAME=LOG.jsonl[.gz] [NAME=LOG.jsonl[.gz] ...] --out PLOT.png [--k 7]
Each eval row's `walk_al` at K (the serving walk over held-out documents) is drawn against the run's training time,
the sum of its train rows' `step_s` up to that step (evaluation time left out), with the simulated AL dashed and,
where the run had --eval-data, the walk over those directories dotted (`eval_data`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path


def curve(log: Path, k: int) -> tuple[list[float], list[float], list[float], list[tuple[float, float]]]:
    """(minutes, walk AL at k, simulated AL at k) at each evaluation of one run with held-out documents, and
    (minutes, walk AL at k) of its --eval-data directories at each evaluation that scored them."""
    minutes, walk, simulated, evaluation, elapsed = [], [], [], [], 0.0
    text = gzip.decompress(log.read_bytes()).decode() if log.suffix == ".gz" else log.read_text()
    for line in text.splitlines():
        row = json.loads(line)
        if row["kind"] == "train":
            elapsed += row.get("step_s") or 0.0
        elif row["kind"] == "eval":
            if str(k) in row.get("walk_al", {}):
                minutes.append(elapsed / 60)
                walk.append(row["walk_al"][str(k)])
                simulated.append(row["sim_al"][str(k)])
            if str(k) in row.get("eval_data", {}).get("walk_al", {}):
                evaluation.append((elapsed / 60, row["eval_data"]["walk_al"][str(k)]))
    return minutes, walk, simulated, evaluation


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="NAME=LOG.jsonl")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--k", type=int, default=7)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.6, 4.4))
    for spec in args.runs:
        name, _, path = spec.partition("=")
        minutes, walk, simulated, evaluation = curve(Path(path), args.k)
        if not minutes and not evaluation:
            print(f"{path}: no evaluation with walk_al at K={args.k}", file=sys.stderr)
            continue
        color = None
        if minutes:
            (line,) = ax.plot(minutes, walk, marker="o", label=f"{name}: walk")
            color = line.get_color()
            ax.plot(minutes, simulated, linestyle="--", color=color, alpha=0.6, label=f"{name}: simulated")
        if evaluation:
            ax.plot(*zip(*evaluation), linestyle=":", marker="s", color=color, label=f"{name}: walk, --eval-data")
    ax.set_xlabel("training time (minutes)")
    ax.set_ylabel(f"held-out acceptance length at K={args.k}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the axes, not over the lines
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
