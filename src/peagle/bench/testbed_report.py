"""What a testbed step produced and where a build's time went: the progress line after each step and phase, and
the summary at the end (documents and tokens of a data directory, training steps and the held-out walk of a head,
the served acceptance lengths of the served step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

from peagle.bench.testbed_commands import Phase
from peagle.bench.testbed_commands import seconds as _seconds



def progress_line(where: str, elapsed: float, limit_s: float, note: str, what: str) -> str:
    """'testbed [8/12] responses-sharegpt: 160.4 s of its 160 s limit (stopped there): sharegpt: 2,816 documents...'"""
    return f"{where}: {elapsed:.1f} s of its {_seconds(limit_s)} limit{f' ({note})' if note else ''}: {what}"


def lanes_text(phase: Phase, spent: Mapping[str, float]) -> str:
    """'responses-sharegpt 160 s | synthesize 85 s, responses-synth 70 s': where a phase's time went."""
    return " | ".join(", ".join(f"{step.name} {_seconds(spent[step.name])}" if step.name in spent
                                else f"{step.name} done already" for step in lane) for lane in phase.lanes)


def spent_text(plan: Sequence[Phase], spent: Mapping[str, float]) -> str:
    """The time of what ran in this build: each step alone, each phase with its lanes."""
    parts = []
    for phase in plan:
        if len(phase.lanes) > 1 and phase.name in spent:
            parts.append(f"{phase.name} {_seconds(spent[phase.name])} ({lanes_text(phase, spent)})")
        elif len(phase.lanes) == 1:
            parts += [f"{step.name} {_seconds(spent[step.name])}" for step in phase.steps if step.name in spent]
    return ", ".join(parts) or "nothing to do"


def produced(outputs: Sequence[Path]) -> str:
    """What a step's outputs hold, in a few words each."""
    return "; ".join(f"{_label(o)}: {_describe(o)}" for o in outputs)


def _label(path: Path) -> str:
    return path.parent.name if path.name == "final" else path.name


def _describe(path: Path) -> str:
    if not path.exists():
        return "missing"
    if (path / "manifest.json").is_file():
        documents, tokens, prompts = data_totals(path)
        return f"{documents:,} documents, {_count(tokens)} tokens from {prompts:,} prompts"
    if path.name == "final" and (path.parent / "train_log.jsonl").is_file():
        return _head_layers(path) + _training_summary(path.parent / "train_log.jsonl")
    if path.name == "results.json" and path.parent.parent.name == "served":
        return served_summary(path)
    if path.is_dir() and not any(path.iterdir()):
        return "empty"
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return f"{count_records(path):,} records"
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
    return f"{size / 1e6:,.1f} MB" if size >= 1e6 else f"{size / 1e3:.1f} kB"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def data_totals(data_dir: Path) -> tuple[int, int, int]:
    """(documents, tokens, prompts answered) of a `peagle regenerate` directory; zeros without a manifest."""
    try:
        shards = json.loads((data_dir / "manifest.json").read_text())["shards"]
    except (OSError, ValueError, KeyError):
        return 0, 0, 0
    return (sum(s["num_documents"] for s in shards if s.get("file")), sum(s["num_tokens"] for s in shards),
            sum(s["num_prompts"] for s in shards))


def count_records(path: Path) -> int:
    from peagle.training.data_sources import open_text

    with open_text(path) as f:
        return sum(1 for line in f if line.strip())


def _head_layers(head: Path) -> str:
    """'4 layers, ' from a trained head's config.json (the recipe's choice that a build's arguments may change;
    its trained depth shows in the walk's K), '' without one."""
    try:
        layers = json.loads((head / "config.json").read_text())["transformer_layer_config"]["num_hidden_layers"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f"{layers} layer{'s' if layers != 1 else ''}, "


def _training_summary(log: Path) -> str:
    step, walk = 0, None
    for line in log.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("kind") == "train":
            step = row["step"]
        elif row.get("kind") == "eval" and row.get("walk_al"):
            walk = row["walk_al"]
    text = f"{step:,} steps"
    if walk:
        k = max(walk, key=int)
        text += f", held-out walk AL@{k} {walk[k]:.2f}"
    return text


def served_summary(results: Path) -> str:
    """'mtbench: EAGLE-3 AL 2.44 / 2.14, P-EAGLE AL 2.46 / 2.21 at K 7 / 3, P-EAGLE / EAGLE-3 AL 1.01x at K 7,
    P-EAGLE AL K 7 / 3 1.11x, P-EAGLE / EAGLE-3 tok/s 1.20x at each best K, P-EAGLE / none 1.92x; humaneval: ...'
    from a `peagle bench` results.json (greedy points)."""
    names = {"eagle3": "EAGLE-3", "peagle": "P-EAGLE"}
    points = [p for p in json.loads(results.read_text())["points"] if not p.get("temperature")]
    parts = []
    for dataset in dict.fromkeys(p["dataset"] for p in points):
        rows = [p for p in points if p["dataset"] == dataset]
        ks = sorted({p["k"] for p in rows if p.get("k")}, reverse=True)
        best = {m: max((p["tokens_per_s"] for p in rows if p["method"] == m), default=0.0) for m in ("none", *names)}
        als, al = [], {}
        for method, name in names.items():
            al[method] = by_k = {p["k"]: p["acceptance_length"] for p in rows if p["method"] == method and p.get("k")}
            if by_k:
                als.append(f"{name} AL {' / '.join(f'{by_k[k]:.2f}' for k in ks if k in by_k)}")
        text = f"{dataset}: {', '.join(als)} at K {' / '.join(map(str, ks))}"
        # issue-style acceptance ratios: P-EAGLE over EAGLE-3 at the deepest K, P-EAGLE's deepest K over its shallowest
        if ks and al["peagle"].get(ks[0]) and al["eagle3"].get(ks[0]):
            text += f", P-EAGLE / EAGLE-3 AL {al['peagle'][ks[0]] / al['eagle3'][ks[0]]:.2f}x at K {ks[0]}"
        if len(ks) > 1 and al["peagle"].get(ks[0]) and al["peagle"].get(ks[-1]):
            text += f", P-EAGLE AL K {ks[0]} / {ks[-1]} {al['peagle'][ks[0]] / al['peagle'][ks[-1]]:.2f}x"
        if best["peagle"] and best["eagle3"]:
            text += f", P-EAGLE / EAGLE-3 tok/s {best['peagle'] / best['eagle3']:.2f}x at each best K"
        if best["peagle"] and best["none"]:
            text += f", P-EAGLE / none {best['peagle'] / best['none']:.2f}x"
        parts.append(text)
    return "; ".join(parts) or "no greedy points"
