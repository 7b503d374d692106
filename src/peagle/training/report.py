"""`peagle train-report`: several training runs side by side from their logs (train_log.jsonl): steps, training
time, throughput, held-out accuracy by depth and the held-out walk at one K, as a markdown table, and the walk over
training time as a PNG (the curves an A/B of recipes is decided on)."""

from __future__ import annotations

import bisect
import json
import statistics
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class TrainingRun:
    label: str
    train: list[dict]  # the log's "train" rows, in order
    evals: list[dict]  # its "eval" rows, in order

    @cached_property
    def _elapsed(self) -> tuple[list[int], list[float]]:
        """Each train row's step and the training seconds up to it: its step_s times the steps since the row
        before it (evaluation time excluded: the trainer's step_s measures steps only)."""
        steps, seconds, total, previous = [], [], 0.0, 0
        for row in self.train:
            total += row["step_s"] * (row["step"] - previous)
            previous = row["step"]
            steps.append(previous)
            seconds.append(total)
        return steps, seconds

    def minutes_at(self, step: int) -> float:
        """Training minutes up to `step` (the last train row at or before it)."""
        steps, seconds = self._elapsed
        i = bisect.bisect_right(steps, step)
        return seconds[i - 1] / 60.0 if i else 0.0

    @property
    def last_eval(self) -> dict:
        return self.evals[-1]


def load_run(spec: str) -> TrainingRun:
    """`LABEL=PATH` or `PATH`; PATH is a train_log.jsonl (or .jsonl.gz) or the training output directory holding
    one. The label defaults to the file's stem or the directory's name."""
    from peagle.training.data_sources import open_text

    label, sep, path_text = spec.partition("=")
    if not sep:
        label, path_text = "", spec
    path = Path(path_text)
    if path.is_dir():
        path = path / "train_log.jsonl"
    if not path.is_file():
        raise ValueError(f"{spec}: no training log at {path} (a train_log.jsonl, .jsonl.gz, or `peagle train "
                         f"--out` directory)")
    if not label:
        label = path.parent.name if path.name == "train_log.jsonl" else path.name.split(".")[0]
    train, evals = [], []
    with open_text(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ValueError(f"{path}:{number}: not a JSON line") from None
            kind = row.get("kind")
            if kind == "train":
                train.append(row)
            elif kind == "eval":
                evals.append(row)
    if not evals:
        raise ValueError(f"{path}: no evaluation rows (train with --eval-every so that the log holds some)")
    return TrainingRun(label, train, evals)


def walks(row: dict) -> set[int]:
    """The depths an evaluation row walked, on either split."""
    evaluation = (row.get("eval_data") or {}).get("walk_al", {})
    return {int(k) for k in row.get("walk_al", {})} | {int(k) for k in evaluation}


def default_k(runs: Sequence[TrainingRun]) -> int:
    """K=7 (the serving default) if every run's last evaluation walked it, else their deepest common K."""
    common = set.intersection(*(walks(r.last_eval) for r in runs)) if runs else set()
    if not common:
        raise ValueError("the logs' last evaluations share no walk depth: give --k")
    return 7 if 7 in common else max(common)


def _walk(row: dict, k: int, eval_data: bool) -> float | None:
    source = row.get("eval_data") if eval_data else row
    if not source:
        return None
    return source.get("walk_al", {}).get(str(k))


def curve(run: TrainingRun, k: int, what: str) -> tuple[list[float], list[float]]:
    """(training minutes, value) at each evaluation that has `what` at K: "walk" (the held-out split of the
    training sources), "eval_data" (the walk over --eval-data) or "simulated" (the per-anchor proxy)."""
    xs, ys = [], []
    for row in run.evals:
        if what == "simulated":
            value = row.get("sim_al", {}).get(str(k))
        else:
            value = _walk(row, k, what == "eval_data")
        if value is not None:
            xs.append(run.minutes_at(row["step"]))
            ys.append(value)
    return xs, ys


def table(runs: Sequence[TrainingRun], k: int) -> str:
    """One markdown row per run: its last evaluation."""
    depths = max(min(4, len(r.last_eval.get("acc", []))) for r in runs)
    header = (["run", "steps", "minutes", "tokens/s (median)", f"held-out acc depth 1-{depths}",
               f"walk AL@{k} held-out", f"walk AL@{k} --eval-data"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        last = run.last_eval
        rates = [row["tokens_per_s"] for row in run.train if row.get("tokens_per_s")]
        walk, walk_eval = _walk(last, k, False), _walk(last, k, True)
        cells = [run.label, f"{last['step']:,}", f"{run.minutes_at(last['step']):.1f}",
                 f"{statistics.median(rates) / 1e3:.1f}K" if rates else "-",
                 " / ".join(f"{a:.3f}" for a in last.get("acc", [])[:depths]) or "-",
                 "-" if walk is None else f"{walk:.3f}", "-" if walk_eval is None else f"{walk_eval:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: Sequence[TrainingRun], k: int, path: Path, title: str | None = None,
         simulated: bool = False) -> Path:
    """The walk at K over training minutes, one colour per run: solid on the held-out split of the training
    sources, dotted on --eval-data where the log has it, dashed the simulated AL with `simulated`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    kinds = [("walk", "-", "o", "held-out"), ("eval_data", ":", "s", "--eval-data")]
    if simulated:
        kinds.append(("simulated", "--", "", "simulated"))
    for i, run in enumerate(runs):
        for what, style, marker, suffix in kinds:
            xs, ys = curve(run, k, what)
            if ys:
                ax.plot(xs, ys, linestyle=style, marker=marker or None, markersize=3, color=f"C{i % 10}",
                        alpha=0.6 if what == "simulated" else 1.0, label=f"{run.label}: {suffix}")
    ax.set_xlabel("training time (minutes, evaluations excluded)")
    ax.set_ylabel(f"acceptance length at K={k}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(runs) > 3 else 1)
    if title:
        ax.set_title(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
