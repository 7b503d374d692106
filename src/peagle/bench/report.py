"""Benchmark results: one JSON file per run, a markdown summary, and one JSON line printed last for scripts.

results.json (schema_version 1; docs/BENCH_SCHEMA.md says the same with examples):

    {
      "schema_version": 1,
      "kind": "peagle-bench",
      "created_utc": "2026-01-01T12:00:00Z",
      "command": "peagle bench --model ...",          # as typed
      "config": {...},                                # every resolved sweep option (SweepConfig fields)
      "environment": {"python", "platform", "peagle", "torch", "cuda", "gpu", "transformers", "git_commit",
                      "git_dirty"},
      "points": [                                     # one per (dataset, method, k, concurrency), in run order
        {"dataset": "mtbench", "method": "peagle", "k": 7, "concurrency": 1,
         "num_prompts": 80, "num_failed": 0, "output_tokens": 20480, "wall_s": 12.5, "tokens_per_s": 1638.4,
         "acceptance_length": 3.7, "per_position_acceptance": [0.8, ...], "draft_acceptance_rate": 0.39,
         "ttft_p50_ms": 9.1, "ttft_p99_ms": 15.0, "itl_p50_ms": 0.6, "itl_p99_ms": 2.0}
      ]
    }

`method` is none | eagle3 | peagle (the engine) or hf_eager | hf_static_compile | hf_prompt_lookup (Hugging Face
transformers baselines, where `concurrency` is the generate batch size). `k` is null for methods without a K;
acceptance fields are null / [] where there is no speculation; latency fields are null where not measured (HF).
The file is rewritten after every point, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import shlex
import sys

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Iterable

from peagle.bench.measurement import Measurement

SCHEMA_VERSION = 1
RESULTS_KIND = "peagle-bench"
TOP_KEYS = ("schema_version", "kind", "created_utc", "command", "config", "environment", "points")
POINT_KEYS = (
    "dataset", "method", "k", "concurrency", "num_prompts", "num_failed", "output_tokens", "wall_s", "tokens_per_s",
    "acceptance_length", "per_position_acceptance", "draft_acceptance_rate", "ttft_p50_ms", "ttft_p99_ms",
    "itl_p50_ms", "itl_p99_ms",
)
ENVIRONMENT_KEYS = ("python", "platform", "peagle", "torch", "cuda", "gpu", "transformers", "git_commit", "git_dirty")
ENGINE_METHODS = ("none", "eagle3", "peagle")
HF_METHODS = ("hf_eager", "hf_static_compile", "hf_prompt_lookup")
METHOD_LABELS = {
    "none": "no speculation", "eagle3": "EAGLE-3", "peagle": "P-EAGLE", "hf_eager": "HF eager",
    "hf_static_compile": "HF static cache + compile", "hf_prompt_lookup": "HF prompt lookup",
}


def make_point(dataset: str, method: str, k: int | None, concurrency: int, m: Measurement) -> dict[str, Any]:
    point = {"dataset": dataset, "method": method, "k": k, "concurrency": concurrency}
    point.update({key: getattr(m, key) for key in POINT_KEYS[4:]})
    return point


def environment() -> dict[str, Any]:
    import peagle

    env: dict[str, Any] = {"python": platform.python_version(), "platform": f"{platform.system()}-{platform.machine()}",
                           "peagle": peagle.__version__}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        env["gpu"] = ", ".join(torch.cuda.get_device_name(i) for i in range(count)) or None
    except ImportError:
        env.update(torch=None, cuda=None, gpu=None)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    env["git_commit"], env["git_dirty"] = _git_state(Path(peagle.__file__).parent)
    return env


def _git_state(where: Path) -> tuple[str | None, bool | None]:
    """The checkout's commit and whether it has uncommitted changes; (None, None) for an installed package."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if commit.returncode:
            return None, None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                capture_output=True, text=True, timeout=10)
        return commit.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


class ResultsWriter:
    """Owns a run's results.json: created with the command, config and environment; rewritten on every point."""

    def __init__(self, out_dir: Path, command: str, config: dict[str, Any], env: dict[str, Any] | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "results.json"
        self.results = {
            "schema_version": SCHEMA_VERSION, "kind": RESULTS_KIND,
            "created_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": command, "config": config, "environment": environment() if env is None else env,
            "points": [],
        }
        self._write()

    def add(self, point: dict[str, Any]) -> None:
        self.results["points"].append(point)
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.results, indent=2) + "\n")
        os.replace(tmp, self.path)  # readers never see a half-written file


def load_results(path: Path) -> dict[str, Any]:
    try:
        results = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a JSON file ({e})") from None
    ours = isinstance(results, dict) and results.get("kind") == RESULTS_KIND
    if not ours or results.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path} is not a peagle bench results file of schema version {SCHEMA_VERSION}")
    return results


# ---- summaries -------------------------------------------------------------------------------------------------


def datasets_of(points: Iterable[dict]) -> list[str]:
    return list(dict.fromkeys(p["dataset"] for p in points))


def best_points(points: Iterable[dict], dataset: str) -> dict[tuple[str, int], dict]:
    """(method, concurrency) -> the point with the highest tokens/s over K (each method at its best K)."""
    best: dict[tuple[str, int], dict] = {}
    for p in points:
        if p["dataset"] != dataset or not p["num_prompts"]:
            continue
        key = (p["method"], p["concurrency"])
        if key not in best or p["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = p
    return best


def speedups(points: Iterable[dict], dataset: str, numerator: str, denominator: str) -> dict[int, float]:
    """concurrency -> best tokens/s of `numerator` / best tokens/s of `denominator`, where both were measured."""
    best = best_points(points, dataset)
    out = {}
    for (method, c), p in sorted(best.items(), key=lambda kv: kv[0][1]):
        other = best.get((denominator, c))
        if method == numerator and other and other["tokens_per_s"] > 0:
            out[c] = p["tokens_per_s"] / other["tokens_per_s"]
    return out


SPEEDUP_PAIRS = (("peagle", "eagle3"), ("peagle", "none"), ("eagle3", "none"))


def markdown(results: dict[str, Any]) -> str:
    points = results["points"]
    cfg = results.get("config", {})
    lines = [f"# peagle bench: {results.get('environment', {}).get('gpu') or 'CPU'}", ""]
    if cfg.get("note"):
        lines += [f"**{cfg['note']}**", ""]
    lines += [f"`{results.get('command', '')}`", "",
             f"Greedy, up to {cfg.get('max_tokens', '?')} output tokens per request. Output tokens/s at each "
             "concurrency; each speculative method at its best K (K and acceptance length in parentheses).", ""]
    for dataset in datasets_of(points):
        lines += _engine_table(points, dataset) + _hf_table(points, dataset) + _acceptance_table(points, dataset)
    return "\n".join(lines)


def _engine_table(points: list[dict], dataset: str) -> list[str]:
    best = best_points(points, dataset)
    methods = [m for m in ENGINE_METHODS if any(key[0] == m for key in best)]
    if not methods:
        return []
    pairs = [(a, b) for a, b in SPEEDUP_PAIRS if a in methods and b in methods]
    counts = sorted({p["num_prompts"] for (m, _), p in best.items() if m in methods})
    prompts = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    header = ["concurrency", *(f"{METHOD_LABELS[m]} tok/s" for m in methods),
              *(f"{METHOD_LABELS[a]} / {METHOD_LABELS[b]}" for a, b in pairs)]
    rows = [f"## {dataset} ({prompts} prompts per point)", "", _row(header), _row(["---"] * len(header))]
    ratios = {pair: speedups(points, dataset, *pair) for pair in pairs}
    for c in sorted({c for m, c in best if m in methods}):
        cells = [str(c)] + [_throughput_cell(best.get((m, c))) for m in methods]
        cells += [f"{ratios[pair][c]:.2f}x" if c in ratios[pair] else "-" for pair in pairs]
        rows.append(_row(cells))
    return rows + [""]


def _throughput_cell(p: dict | None) -> str:
    if p is None:
        return "-"
    if p["k"] is None:
        return f"{p['tokens_per_s']:.1f}"
    al = f", AL {p['acceptance_length']:.2f}" if p["acceptance_length"] is not None else ""
    return f"{p['tokens_per_s']:.1f} (K={p['k']}{al})"


def _hf_table(points: list[dict], dataset: str) -> list[str]:
    best = best_points(points, dataset)
    hf = sorted(((m, c), p) for (m, c), p in best.items() if m in HF_METHODS)
    if not hf:
        return []
    rows = [f"Hugging Face transformers `generate` on the same prompts ({dataset}):", "",
            _row(["baseline", "batch", "prompts", "tok/s", "P-EAGLE at the same concurrency / baseline"]),
            _row(["---"] * 5)]
    for (method, c), p in hf:
        ours = best.get(("peagle", c))
        ratio = f"{ours['tokens_per_s'] / p['tokens_per_s']:.2f}x" if ours and p["tokens_per_s"] > 0 else "-"
        rows.append(_row([METHOD_LABELS[method], str(c), str(p["num_prompts"]), f"{p['tokens_per_s']:.1f}", ratio]))
    return rows + [""]


def _acceptance_table(points: list[dict], dataset: str) -> list[str]:
    spec = [p for p in points if p["dataset"] == dataset and p["acceptance_length"] is not None]
    if not spec:
        return []
    c_min = min(p["concurrency"] for p in spec)
    ks = sorted({p["k"] for p in spec})
    rows = [f"Acceptance length by K ({dataset}, concurrency {c_min}):", "",
            _row(["method", *(f"K={k}" for k in ks)]), _row(["---"] * (len(ks) + 1))]
    for method in ENGINE_METHODS:
        al = {p["k"]: p["acceptance_length"] for p in spec if p["method"] == method and p["concurrency"] == c_min}
        if al:
            rows.append(_row([METHOD_LABELS[method], *(f"{al[k]:.2f}" if k in al else "-" for k in ks)]))
    return rows + [""]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def summary_line(results: dict[str, Any], files: dict[str, Any]) -> str:
    """The last line a run prints: where its files are and the headline speed-ups, as one JSON object."""
    points = results["points"]
    summary: dict[str, Any] = {"results": str(files.get("results")), "markdown": str(files.get("markdown")),
                               "plots": [str(p) for p in files.get("plots", [])], "num_points": len(points)}
    for a, b in SPEEDUP_PAIRS:
        by_dataset = {d: {str(c): round(r, 3) for c, r in speedups(points, d, a, b).items()}
                      for d in datasets_of(points)}
        if any(by_dataset.values()):
            summary[f"speedup_{a}_vs_{b}"] = by_dataset
    return json.dumps(summary, separators=(",", ":"))


def command_line() -> str:
    return shlex.join(["peagle", *sys.argv[1:]])


def print_outcome(results: dict, files: dict, banner: str | None = None) -> None:
    """The table, where the files are, an optional banner, and last the one-line JSON summary."""
    print(markdown(results))
    print(f"results: {files['results']}\ntable:   {files['markdown']}")
    for plot in files["plots"]:
        print(f"plot:    {plot}")
    if banner:
        print(banner)
    print(summary_line(results, files))
