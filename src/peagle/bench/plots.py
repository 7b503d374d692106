"""PNG plots of a results file: throughput vs concurrency, P-EAGLE / EAGLE-3 speed-up, acceptance length vs K,
acceptance by draft position, and peagle over vLLM at the same method and K (with --vllm-baselines).

Small figures (500x320 px) so that they can be committed next to BENCHMARKS.md. Greedy plots carry plain names;
those of a sampling temperature T end in _tT (throughput_mtbench_t0.7.png); the speed-up plot holds both.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from peagle.bench.report import (
    ENGINE_METHODS,
    VLLM_METHODS,
    against_vllm,
    best_points,
    datasets_of,
    speedups,
    temperature_title,
    temperatures_of,
    variant_label,
    variants_of,
)

FIGSIZE = (5.0, 3.2)
DPI = 100
# vLLM's rows take their peagle row's marker and colour, drawn hollow and dotted.
MARKERS = {"none": "o", "eagle3": "s", "peagle": "^", "vllm_none": "o", "vllm_eagle3": "s", "vllm_peagle": "^",
           "hf_eager": "x", "hf_static_compile": "+", "hf_prompt_lookup": "1"}
COLORS = {"none": "C0", "eagle3": "C1", "peagle": "C2", "vllm_none": "C0", "vllm_eagle3": "C1", "vllm_peagle": "C2",
          "hf_eager": "C3", "hf_static_compile": "C4", "hf_prompt_lookup": "C5"}
LINESTYLES = ("-", "--", ":", "-.")  # one per dataset where datasets share a figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, safe on servers and in CI
    import matplotlib.pyplot as plt

    return plt


def _log2_concurrency_axis(ax, concurrencies: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies)
    ax.set_xticklabels([str(c) for c in concurrencies])
    ax.set_xlabel("concurrency")
    ax.grid(True, alpha=0.3)


def _style(v: str) -> dict:
    """Line style of a row: its method's colour and marker; adaptive rows dashed with a star."""
    method, _, policy = v.partition("@")
    if policy:
        return {"linestyle": "--", "marker": "*", "color": COLORS[method]}
    if method in VLLM_METHODS:
        return {"linestyle": ":", "marker": MARKERS[method], "color": COLORS[method], "markerfacecolor": "none"}
    return {"linestyle": "-" if method in ENGINE_METHODS else "none",  # baselines: markers at their batch sizes only
            "marker": MARKERS[method], "color": COLORS[method]}


def plot_throughput(points: list[dict], dataset: str, path: Path, temperature: float = 0.0) -> Path | None:
    """Output tokens/s vs concurrency, one line per row at its best K (HF baselines as markers)."""
    best = best_points(points, dataset, temperature)
    if not best:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for v in variants_of(points):
        series = sorted((c, p["tokens_per_s"]) for (w, c), p in best.items() if w == v)
        if series:
            xs, ys = zip(*series)
            ax.plot(xs, ys, label=variant_label(v), **_style(v))
    _log2_concurrency_axis(ax, sorted({c for _, c in best}))
    ax.set_yscale("log")  # rates span 10-100x from concurrency 1 to 64, and HF baselines sit far below
    ax.set_ylabel("output tokens/s (log scale)")
    ax.set_title(f"{dataset}, {temperature_title(temperature)}: throughput (best K)", fontsize=10)
    ax.legend(fontsize=6)
    return _save(plt, fig, path)


def plot_speedup(points: list[dict], path: Path) -> Path | None:
    """P-EAGLE / EAGLE-3 speed-up vs concurrency, one line per dataset and temperature, each at its best K."""
    curves = {(d, t): speedups(points, d, "peagle", "eagle3", t)
              for t in temperatures_of(points) for d in datasets_of(points)}
    curves = {key: c for key, c in curves.items() if c}
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for ((dataset, t), curve), linestyle in zip(curves.items(), itertools.cycle(LINESTYLES)):
        label = dataset if t == 0 else f"{dataset}, T={t:g}"
        ax.plot(list(curve), list(curve.values()), linestyle=linestyle, marker="o" if t == 0 else "s", label=label)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    _log2_concurrency_axis(ax, sorted({c for curve in curves.values() for c in curve}))
    ax.set_ylabel("speed-up (x)")
    ax.set_title("P-EAGLE / EAGLE-3 output tokens/s (best K each)", fontsize=10)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _fixed_k_series(points: list[dict], temperature: float, has) -> list[tuple[str, str, list[dict], dict]]:
    """Fixed-K rows of `temperature` for which `has(point)` holds, grouped per dataset and engine method: (dataset,
    method, its rows, its line style: one line style per dataset, one marker and colour per method)."""
    spec = [p for p in points if has(p) and p["k"] is not None and not p.get("adaptive")
            and p.get("temperature", 0.0) == temperature]
    groups = []
    for dataset, linestyle in zip(datasets_of(spec), itertools.cycle(LINESTYLES)):
        for method in (*ENGINE_METHODS, *VLLM_METHODS):
            mine = [p for p in spec if p["dataset"] == dataset and p["method"] == method]
            if mine:
                hollow = {"markerfacecolor": "none"} if method in VLLM_METHODS else {}
                groups.append((dataset, method, mine, dict(linestyle=linestyle, marker=MARKERS[method],
                                                           color=COLORS[method], **hollow)))
    return groups


def plot_acceptance_vs_k(points: list[dict], path: Path, temperature: float = 0.0) -> Path | None:
    """Acceptance length vs K per method and dataset (fixed-K rows), at the lowest measured concurrency."""
    groups = _fixed_k_series(points, temperature, lambda p: p["acceptance_length"] is not None)
    if not groups:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    for dataset, method, mine, style in groups:
        c_min = min(p["concurrency"] for p in mine)
        series = sorted((p["k"], p["acceptance_length"]) for p in mine if p["concurrency"] == c_min)
        ax.plot(*zip(*series), **style, label=f"{variant_label(method)}, {dataset}")
    ax.set_xticks(sorted({p["k"] for _, _, mine, _ in groups for p in mine}))
    ax.set_xlabel("K (draft tokens per round)")
    ax.set_ylabel("acceptance length")
    ax.grid(True, alpha=0.3)
    ax.set_title(f"Acceptance length vs K ({temperature_title(temperature)})", fontsize=10)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def conditional_acceptance(per_position: list[float]) -> list[float | None]:
    """Acceptance of draft i given that draft i-1 was accepted (draft 1: of every round); None where no round
    accepted the draft before."""
    return [p if i == 0 else (p / per_position[i - 1] if per_position[i - 1] > 0 else None)
            for i, p in enumerate(per_position)]


def plot_per_position(points: list[dict], path: Path, temperature: float = 0.0) -> Path | None:
    """Acceptance by draft position per method and dataset, at each method's largest fixed K and lowest measured
    concurrency: the share of rounds that accepted draft i (left) and the share of those that accepted draft i - 1
    which accepted draft i too (right), where a drafter that drafts all positions at once (P-EAGLE) and one that
    feeds each draft back (EAGLE-3) part."""
    groups = _fixed_k_series(points, temperature, lambda p: bool(p.get("per_position_acceptance")))
    if not groups:
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(2 * FIGSIZE[0], FIGSIZE[1]))
    for dataset, method, mine, style in groups:
        k = max(p["k"] for p in mine)
        rates = min((p for p in mine if p["k"] == k), key=lambda p: p["concurrency"])["per_position_acceptance"]
        label = f"{variant_label(method)} K={k}, {dataset}"
        left.plot(range(1, len(rates) + 1), rates, **style, label=label)
        cond = [(i + 1, c) for i, c in enumerate(conditional_acceptance(rates)) if c is not None]
        right.plot(*zip(*cond), **style, label=label)
    for ax, what in ((left, "rounds accepting draft i"), (right, "accepting draft i, given draft i - 1")):
        ax.set_xlabel("draft position i")
        ax.set_ylabel(what)
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
    left.set_title(f"Acceptance by draft position ({temperature_title(temperature)})", fontsize=10)
    right.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_against_vllm(points: list[dict], path: Path) -> Path | None:
    """peagle's tokens/s over vLLM's at the same method and K, against concurrency: one line per row, dataset and
    temperature (the dotted line at 1: as fast as vLLM)."""
    curves: dict[tuple, list[tuple[int, float]]] = {}
    for dataset in datasets_of(points):
        for mine, theirs in against_vllm(points, dataset):
            if theirs["tokens_per_s"] > 0:
                key = (mine["method"], mine["k"], dataset, mine.get("temperature", 0.0))
                curves.setdefault(key, []).append((mine["concurrency"], mine["tokens_per_s"] / theirs["tokens_per_s"]))
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    datasets = list(dict.fromkeys(key[2] for key in curves))
    for (method, k, dataset, t), curve in curves.items():
        label = f"{variant_label(method)}{'' if k is None else f' K={k}'}, {dataset}" + ("" if t == 0 else f", T={t:g}")
        ax.plot(*zip(*sorted(curve)), marker=MARKERS[method], color=COLORS[method], label=label,
                linestyle=LINESTYLES[datasets.index(dataset) % len(LINESTYLES)])
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    _log2_concurrency_axis(ax, sorted({c for curve in curves.values() for c, _ in curve}))
    ax.set_ylabel("peagle / vLLM tokens/s (x)")
    ax.set_title("peagle over vLLM, same method and K", fontsize=10)
    ax.legend(fontsize=6)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_all(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Every plot the results support, written into out_dir; returns the files written."""
    points = results["points"]
    out_dir = Path(out_dir)
    written = []
    for t in temperatures_of(points):
        suffix = "" if t == 0 else f"_t{t:g}"
        mine = [p for p in points if p.get("temperature", 0.0) == t]
        written += [plot_throughput(mine, d, out_dir / f"throughput_{d}{suffix}.png", t) for d in datasets_of(mine)]
        written.append(plot_acceptance_vs_k(mine, out_dir / f"acceptance_vs_k{suffix}.png", t))
        written.append(plot_per_position(mine, out_dir / f"acceptance_by_position{suffix}.png", t))
    written.append(plot_speedup(points, out_dir / "speedup_peagle_vs_eagle3.png"))
    written.append(plot_against_vllm(points, out_dir / "peagle_vs_vllm.png"))
    return [p for p in written if p is not None]
