"""Benchmark results: one JSON file per run, a markdown summary, and one JSON line printed last for scripts.

results.json (schema_version 2; docs/BENCH_SCHEMA.md says the same with examples):

    {
      "schema_version": 2,
      "kind": "peagle-bench",
      "created_utc": "2026-01-01T12:00:00Z",
      "command": "peagle bench --model ...",          # as typed
      "config": {...},                                # every resolved sweep option (SweepConfig fields)
      "environment": {"python", "platform", "peagle", "torch", "cuda", "gpu", "transformers", "git_commit",
                      "git_dirty"},
      "points": [                                     # one per measured point, in run order
        {"dataset": "mtbench", "method": "peagle", "k": 7, "adaptive": null, "temperature": 0.0, "concurrency": 1,
         "num_prompts": 80, "num_failed": 0, "output_tokens": 20480, "wall_s": 12.5, "tokens_per_s": 1638.4,
         "acceptance_length": 3.7, "per_position_acceptance": [0.8, ...], "draft_acceptance_rate": 0.39,
         "ttft_p50_ms": 9.1, "ttft_p99_ms": 15.0, "itl_p50_ms": 0.6, "itl_p99_ms": 2.0,
         "verified_per_round": 7.0, "accepted_per_round": 2.7, "verified_per_accepted": 2.59, "flags": [],
         "remeasured": null}
      ]
    }

`method` is none | eagle3 | peagle (the engine), vllm_none | vllm_eagle3 | vllm_peagle (vLLM's LLM on the same
rows, --vllm-baselines: such a point adds "engine": "vllm" and "vllm_version", and results["vllm"] records vLLM's
version, interpreter and path and, per row, its LLM arguments, start-up seconds and any error) or hf_eager |
hf_static_compile | hf_prompt_lookup (Hugging Face transformers baselines, where `concurrency` is the generate batch
size). `k` is null for methods without a K;
`adaptive` is the policy of an adaptive row (null for a fixed K); acceptance fields are null / [] where there is no
speculation; latency fields are null where not measured (HF). `flags` are the hygiene checks that still stand after
one re-measurement (peagle.bench.hygiene); `remeasured` keeps the first measurement of a re-measured point.
Schema 1 files load as schema 2 (greedy, fixed K unless the run's config gave a policy, no flags); files written
before the verification keys (verified_per_round, ...) existed load with them null.
The file is rewritten after every point, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from peagle.bench.measurement import Measurement
from peagle.drafters.policy import policy_text

SCHEMA_VERSION = 2
RESULTS_KIND = "peagle-bench"
TOP_KEYS = ("schema_version", "kind", "created_utc", "command", "config", "environment", "points")
MEASURED_KEYS = (
    "num_prompts", "num_failed", "output_tokens", "wall_s", "tokens_per_s", "acceptance_length",
    "per_position_acceptance", "draft_acceptance_rate", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
    "verified_per_round", "accepted_per_round", "verified_per_accepted",
)
VERIFICATION_KEYS = ("verified_per_round", "accepted_per_round", "verified_per_accepted")  # since issue 52
CLIENT_CPU_LIMIT = 0.9  # a server benchmark's client CPU s/s from which it may have set the rate
POINT_KEYS = ("dataset", "method", "k", "adaptive", "temperature", "concurrency", *MEASURED_KEYS, "flags",
              "remeasured")
ENVIRONMENT_KEYS = ("python", "platform", "peagle", "torch", "cuda", "gpu", "transformers", "git_commit", "git_dirty")
ENGINE_METHODS = ("none", "eagle3", "peagle")
VLLM_METHODS = tuple(f"vllm_{m}" for m in ENGINE_METHODS)  # vLLM's LLM on the same rows (bench.vllm_baseline)
HF_METHODS = ("hf_eager", "hf_static_compile", "hf_prompt_lookup")
METHOD_LABELS = {
    "none": "no speculation", "eagle3": "EAGLE-3", "peagle": "P-EAGLE", "vllm_none": "vLLM no speculation",
    "vllm_eagle3": "vLLM EAGLE-3", "vllm_peagle": "vLLM P-EAGLE", "hf_eager": "HF eager",
    "hf_static_compile": "HF static cache + compile", "hf_prompt_lookup": "HF prompt lookup",
}


def make_point(dataset: str, method: str, k: int | None, concurrency: int, m: Measurement, *,
               temperature: float = 0.0, adaptive: dict | None = None) -> dict[str, Any]:
    point = {"dataset": dataset, "method": method, "k": k, "adaptive": adaptive, "temperature": float(temperature),
             "concurrency": concurrency}
    point.update({key: getattr(m, key) for key in MEASURED_KEYS})
    point.update(flags=[], remeasured=None)
    if m.client_cpu_per_s is not None:  # against a server (peagle.bench.http_runner)
        point["client_cpu_per_s"] = m.client_cpu_per_s
        point["client_cpu_per_process_max"] = m.client_cpu_per_process_max
        point["client_processes"] = m.client_processes
    return point


def variant(p: dict) -> str:
    """A point's row: its method, or method@policy for an adaptive row (e.g. "peagle@8:7,above:0")."""
    return f"{p['method']}@{policy_text(p['adaptive'])}" if p.get("adaptive") else p["method"]


def variant_label(v: str) -> str:
    """A row's label: "P-EAGLE", "P-EAGLE adaptive (8:7,above:3)", or for a --draft-confidence-cutoff row (one K,
    one cutoff) "P-EAGLE K=7 cutoff 0.1"."""
    method, _, policy = v.partition("@")
    if not policy:
        return METHOD_LABELS[method]
    fixed = re.fullmatch(r"above:(\d+) cutoff above:([0-9.e-]+)", policy)
    if fixed:
        return f"{METHOD_LABELS[method]} K={fixed[1]} cutoff {fixed[2]}"
    return f"{METHOD_LABELS[method]} adaptive ({policy})"


def variants_of(points: Iterable[dict]) -> list[str]:
    """Rows in display order: no speculation, EAGLE-3, P-EAGLE, the adaptive rows, vLLM's rows, then the HF
    baselines."""
    seen = list(dict.fromkeys(variant(p) for p in points))
    order = {m: i for i, m in enumerate((*ENGINE_METHODS, "@", *VLLM_METHODS, *HF_METHODS))}
    return sorted(seen, key=lambda v: order["@"] if "@" in v else order[v])


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


GIT_COMMIT_ENV = "PEAGLE_GIT_COMMIT"  # the commit of a copied tree whose own git history is absent or stale


def _git_state(where: Path) -> tuple[str | None, bool | None]:
    """The checkout's commit and whether it has uncommitted changes; (None, None) for an installed package.

    $PEAGLE_GIT_COMMIT, when set, is the commit instead (whether the copy differs from it is then unknown: None):
    for a copy of a checkout run on another machine, whose git history is not the one the tree came from."""
    if os.environ.get(GIT_COMMIT_ENV):
        return os.environ[GIT_COMMIT_ENV].strip(), None
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
        self.policies: dict[str, Path] = {}  # method -> the adaptive.json a calibration wrote
        self._write()

    def add(self, point: dict[str, Any]) -> None:
        self.results["points"].append(point)
        self._write()

    def flush(self) -> None:
        """Rewrites the file after points already added were changed in place (re-measured, flagged)."""
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.results, indent=2) + "\n")
        os.replace(tmp, self.path)  # readers never see a half-written file


def load_results(path: Path) -> dict[str, Any]:
    """A results.json, schema 1 files brought to schema 2."""
    try:
        results = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a JSON file ({e})") from None
    ours = isinstance(results, dict) and results.get("kind") == RESULTS_KIND
    if not ours or results.get("schema_version") not in (1, SCHEMA_VERSION):
        raise ValueError(f"{path} is not a peagle bench results file of schema version 1 or {SCHEMA_VERSION}")
    if results["schema_version"] == 1:
        return upgrade_v1(results)
    if any(key not in p for p in results["points"] for key in VERIFICATION_KEYS):  # written before issue 52
        filled = ({**dict.fromkeys(VERIFICATION_KEYS), **p} for p in results["points"])
        points = [{**{key: f[key] for key in POINT_KEYS if key in f}, **f} for f in filled]  # in the schema's order
        results = {**results, "points": points}
    return results


def upgrade_v1(results: dict[str, Any]) -> dict[str, Any]:
    """Schema 1 had greedy points only, and a run's --adaptive policy applied to every speculative point."""
    cfg = results.get("config") or {}
    policy = None
    if cfg.get("adaptive") or cfg.get("adaptive_above") is not None:
        policy = {"thresholds": [list(t) for t in cfg.get("adaptive") or ()], "above": cfg.get("adaptive_above")}
    points = []
    for p in results["points"]:
        filled = {"adaptive": policy if p["method"] in ("eagle3", "peagle") else None, "temperature": 0.0,
                  "flags": [], "remeasured": None, **dict.fromkeys(VERIFICATION_KEYS), **p}
        points.append({key: filled[key] for key in POINT_KEYS})
    return {**results, "schema_version": SCHEMA_VERSION, "points": points}


def merge_results(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' results as one: the first run's header, each run's command under config.merged_commands, and
    each point once (a point measured again by a later run, e.g. a baseline's companion row, keeps the first)."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    config = {**first.get("config", {}), "merged_commands": [r.get("command", "") for r in runs]}
    points: dict[tuple, dict] = {}
    for p in (p for r in runs for p in r["points"]):
        points.setdefault((p["dataset"], variant(p), p["k"], p["temperature"], p["concurrency"]), p)
    merged = {**first, "command": " && ".join(r.get("command", "") for r in runs), "config": config,
              "points": list(points.values())}
    vllm = [r["vllm"] for r in runs if r.get("vllm")]
    if vllm:  # each run's vLLM rows, under the first run's vLLM
        merged["vllm"] = {**vllm[0], "rows": [row for v in vllm for row in v.get("rows", [])]}
    return merged


# ---- summaries -------------------------------------------------------------------------------------------------


def datasets_of(points: Iterable[dict]) -> list[str]:
    return list(dict.fromkeys(p["dataset"] for p in points))


def temperatures_of(points: Iterable[dict]) -> list[float]:
    return sorted({p.get("temperature", 0.0) for p in points})


def best_points(points: Iterable[dict], dataset: str, temperature: float = 0.0) -> dict[tuple[str, int], dict]:
    """(variant, concurrency) -> the point with the highest tokens/s over K (each row at its best K)."""
    best: dict[tuple[str, int], dict] = {}
    for p in points:
        if p["dataset"] != dataset or p.get("temperature", 0.0) != temperature or not p["num_prompts"]:
            continue
        key = (variant(p), p["concurrency"])
        if key not in best or p["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = p
    return best


def speedups(points: Iterable[dict], dataset: str, numerator: str, denominator: str,
             temperature: float = 0.0) -> dict[int, float]:
    """concurrency -> best tokens/s of `numerator` / best tokens/s of `denominator`, where both were measured."""
    best = best_points(points, dataset, temperature)
    out = {}
    for (v, c), p in sorted(best.items(), key=lambda kv: kv[0][1]):
        other = best.get((denominator, c))
        if v == numerator and other and other["tokens_per_s"] > 0:
            out[c] = p["tokens_per_s"] / other["tokens_per_s"]
    return out


SPEEDUP_PAIRS = (("peagle", "eagle3"), ("peagle", "none"), ("eagle3", "none"), ("peagle", "vllm_peagle"),
                 ("eagle3", "vllm_eagle3"), ("none", "vllm_none"))


def speedup_pairs(variants: Iterable[str]) -> list[tuple[str, str]]:
    """The fixed pairs among `variants`, then each adaptive row over no speculation."""
    variants = list(variants)
    pairs = [(a, b) for a, b in SPEEDUP_PAIRS if a in variants and b in variants]
    return pairs + [(v, "none") for v in variants if "@" in v and "none" in variants]


def temperature_title(t: float) -> str:
    return "greedy" if t == 0 else f"temperature {t:g} sampling"


def markdown(results: dict[str, Any]) -> str:
    points = results["points"]
    cfg = results.get("config", {})
    lines = [f"# peagle bench: {results.get('environment', {}).get('gpu') or 'CPU'}", ""]
    if cfg.get("note"):
        lines += [f"**{cfg['note']}**", ""]
    lines += [f"`{results.get('command', '')}`", "", _length_line(cfg), ""] + _vllm_refusals(results)
    swept = sorted({p["k"] for p in points if p["method"] in ("eagle3", "peagle") and p["k"] and not p.get("adaptive")})
    for t in temperatures_of(points):
        mine = [p for p in points if p.get("temperature", 0.0) == t]
        lines += [f"## {temperature_title(t).capitalize()}", ""]
        for dataset in datasets_of(mine):
            lines += (_engine_table(mine, dataset, t, swept) + _full_table(mine, dataset)
                      + _vllm_table(mine, dataset) + _hf_table(mine, dataset, t) + _acceptance_table(mine, dataset)
                      + _verification_table(mine, dataset))
        lines += _seeds_section(mine, t, swept)
    return "\n".join(lines + _hygiene_section(points))


# What the seeds report for the same cells (PEAGLE.md section 7: GPT-OSS-20B and Qwen3-Coder-30B-A3B on one B200,
# MT-Bench, HumanEval and SPEED-Bench, each method at its best K).
SEEDS = {"c1_pe": "1.55-1.69x", "c1_pn": "2.97-3.97x", "cmax_pe": "1.05-1.25x (c=64)", "best_k": "7-11"}


def _seeds_section(points: list[dict], temperature: float, swept: Iterable[int] = ()) -> list[str]:
    """The seeds' headline cells from this run, per data set: P-EAGLE over EAGLE-3 and over no speculation at
    concurrency 1 and at the highest concurrency measured (each at its best K), over HF static cache + compile at 1,
    the adaptive rows over no speculation (at the highest concurrency, and their lowest over every concurrency),
    and P-EAGLE's best K at concurrency 1. A ratio with a row whose best K is at the edge of what was measured there
    (`best_k_at_edge`) is marked *, as in the tables above."""
    datasets = [d for d in datasets_of(points) if any(p["dataset"] == d and p["method"] == "peagle" for p in points)]
    if not datasets:
        return []
    cells: dict[str, dict[str, str]] = {}

    def put(row: str, dataset: str, text: str) -> None:
        cells.setdefault(row, {})[dataset] = text

    for d in datasets:
        best = best_points(points, d, temperature)
        top = max(c for v, c in best if v == "peagle")
        ratios = {other: speedups(points, d, "peagle", other, temperature) for other in ("eagle3", "none")}
        edge = best_k_at_edge(points, d, temperature, swept)
        for c in (1, top) if top > 1 else (1,):
            for other, label in (("eagle3", "EAGLE-3"), ("none", "no speculation")):
                if c in ratios[other]:
                    bound = " *" if ("peagle", c) in edge or (other, c) in edge else ""
                    put(f"c={c}: P-EAGLE / {label}", d, f"{ratios[other][c]:.2f}x{bound}")
            hf = best.get(("hf_static_compile", 1))
            if c == 1 and hf and ("peagle", 1) in best and hf["tokens_per_s"] > 0:
                put("c=1: P-EAGLE / HF static cache + compile", d,
                    f"{best[('peagle', 1)]['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
        for v in (v for v in variants_of(points) if v.startswith("peagle@")):
            adaptive = speedups(points, d, v, "none", temperature)
            if adaptive:
                c_top, low = max(adaptive), min(adaptive, key=adaptive.get)
                put(f"{variant_label(v)} / no speculation, c={c_top}", d, f"{adaptive[c_top]:.2f}x")
                put(f"{variant_label(v)} / no speculation, lowest", d, f"{adaptive[low]:.2f}x (c={low})")
        if ("peagle", 1) in best:
            put("P-EAGLE's best K at c=1", d, str(best[("peagle", 1)]["k"]) + (" *" if ("peagle", 1) in edge else ""))
    seeds_of = {"c=1: P-EAGLE / EAGLE-3": SEEDS["c1_pe"], "c=1: P-EAGLE / no speculation": SEEDS["c1_pn"],
                "P-EAGLE's best K at c=1": SEEDS["best_k"]}
    rows = [f"### Against the seeds ({temperature_title(temperature)})", "",
            _row(["cell", *datasets, "seeds"]), _row(["---"] * (len(datasets) + 2))]
    for name, by_dataset in cells.items():
        seed = seeds_of.get(name, SEEDS["cmax_pe"] if name.endswith("P-EAGLE / EAGLE-3") and "c=1" not in name
                            else "-")
        rows.append(_row([name, *(by_dataset.get(d, "-") for d in datasets), seed]))
    return rows + [""]


def _length_line(cfg: dict) -> str:
    return (f"Up to {cfg.get('max_tokens', '?')} output tokens per request; a point runs at least "
            f"{cfg.get('min_waves', 1)} waves of its concurrency and at least {cfg.get('min_seconds', 0):g} s. "
            "Output tokens/s at each concurrency; each row at its best K (K and acceptance length in parentheses).")


def best_k_at_edge(points: Iterable[dict], dataset: str, temperature: float,
                   swept: Iterable[int]) -> dict[tuple[str, int], list[int]]:
    """(method, concurrency) -> the Ks of `swept` (those the whole run measured) beyond that row's best K which were not
    measured there, when its best K is the smallest or largest measured there: the row's best may lie among them, so
    a ratio against it is a bound, not a measurement. Fixed-K rows of eagle3 and peagle only."""
    ks: dict[tuple[str, int], set[int]] = {}
    for p in points:
        if (p["dataset"] == dataset and p.get("temperature", 0.0) == temperature and p["num_prompts"]
                and p["method"] in ("eagle3", "peagle") and p["k"] and not p.get("adaptive")):
            ks.setdefault((p["method"], p["concurrency"]), set()).add(p["k"])
    best = best_points(points, dataset, temperature)
    out = {}
    for (method, c), here in ks.items():
        k = best[(method, c)]["k"]
        missing = [x for x in swept if x not in here and ((x < k and k == min(here)) or (x > k and k == max(here)))]
        if missing:
            out[(method, c)] = missing
    return out


def _engine_table(points: list[dict], dataset: str, temperature: float, swept: Iterable[int] = ()) -> list[str]:
    best = best_points(points, dataset, temperature)
    rows_of = [v for v in variants_of(points) if v.partition("@")[0] in ENGINE_METHODS and any(
        key[0] == v for key in best)]
    if not rows_of:
        return []
    pairs = speedup_pairs(rows_of)
    counts = sorted({p["num_prompts"] for (v, _), p in best.items() if v in rows_of})
    prompts = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    header = ["concurrency", *(f"{variant_label(v)} tok/s" for v in rows_of),
              *(f"{variant_label(a)} / {variant_label(b)}" for a, b in pairs)]
    rows = [f"### {dataset} ({prompts} requests per point)", "", _row(header), _row(["---"] * len(header))]
    ratios = {pair: speedups(points, dataset, *pair, temperature) for pair in pairs}
    edge = best_k_at_edge(points, dataset, temperature, swept)
    for c in sorted({c for v, c in best if v in rows_of}):
        cells = [str(c)] + [_throughput_cell(best.get((v, c))) + (" *" if (v, c) in edge else "") for v in rows_of]
        cells += [f"{ratios[pair][c]:.2f}x" if c in ratios[pair] else "-" for pair in pairs]
        rows.append(_row(cells))
    notes = []
    for (method, c), missing in sorted(edge.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        notes.append(f"{METHOD_LABELS[method]} at c={c}: K {', '.join(map(str, missing))} not measured here")
    if notes:
        rows += ["", "\\* best K at the edge of the Ks measured at that point, with Ks of this run beyond it not "
                 "measured there (" + "; ".join(notes) + "): its best may lie there, so ratios against it are bounds."]
    return rows + [""]


def _full_table(points: list[dict], dataset: str) -> list[str]:
    """Every row and K at every concurrency: tokens/s (acceptance length); ! flagged, r re-measured."""
    mine = [p for p in points if p["dataset"] == dataset and p["method"] in ENGINE_METHODS]
    cs = sorted({p["concurrency"] for p in mine})
    keys = sorted({(variant(p), p["k"]) for p in mine},
                  key=lambda vk: (variants_of(mine).index(vk[0]), vk[1] if vk[1] is not None else -1))
    if len(keys) < 2:
        return []
    cell = {(variant(p), p["k"], p["concurrency"]): p for p in mine}
    rows = [f"Every row and K ({dataset}): tokens/s (acceptance length); ! still flagged, r re-measured once, c the "
            f"busiest benchmark client process neared a whole core (it may have set the rate):", "",
            _row(["row", "K", *(f"c={c}" for c in cs)]), _row(["---"] * (len(cs) + 2))]
    for v, k in keys:
        cells = []
        for c in cs:
            p = cell.get((v, k, c))
            if p is None or not p["num_prompts"]:
                cells.append("-")
                continue
            al = f" ({p['acceptance_length']:.2f})" if p["acceptance_length"] is not None else ""
            busiest = p.get("client_cpu_per_process_max", p.get("client_cpu_per_s"))  # one process before
            client_bound = (busiest or 0.0) >= CLIENT_CPU_LIMIT
            marks = ("!" if p.get("flags") else "") + ("r" if p.get("remeasured") else "") + ("c" if client_bound else "")
            cells.append(f"{p['tokens_per_s']:.0f}{al}{' ' + marks if marks else ''}")
        rows.append(_row([variant_label(v), "-" if k is None else str(k), *cells]))
    return rows + [""]


def _throughput_cell(p: dict | None) -> str:
    if p is None:
        return "-"
    if p["k"] is None:
        return f"{p['tokens_per_s']:.1f}"
    al = f", AL {p['acceptance_length']:.2f}" if p["acceptance_length"] is not None else ""
    return f"{p['tokens_per_s']:.1f} (K={p['k']}{al})"


def against_vllm(points: Iterable[dict], dataset: str) -> list[tuple[dict, dict]]:
    """(peagle's point, vLLM's point) for each vLLM point of `dataset` that peagle measured at the same method, K,
    temperature and concurrency (fixed-K rows), in temperature, method, K and concurrency order."""
    ours = {(p["method"], p["k"], p.get("temperature", 0.0), p["concurrency"]): p for p in points
            if p["dataset"] == dataset and p["method"] in ENGINE_METHODS and not p.get("adaptive") and p["num_prompts"]}
    pairs = []
    for p in points:
        if p["dataset"] == dataset and p["method"] in VLLM_METHODS and p["num_prompts"]:
            mine = ours.get((p["method"].removeprefix("vllm_"), p["k"], p.get("temperature", 0.0), p["concurrency"]))
            if mine:
                pairs.append((mine, p))
    return sorted(pairs, key=lambda mv: (mv[1].get("temperature", 0.0), VLLM_METHODS.index(mv[1]["method"]),
                                         mv[1]["k"] or 0, mv[1]["concurrency"]))


def _vllm_table(points: list[dict], dataset: str) -> list[str]:
    """peagle against vLLM at the same method, K and concurrency: tokens/s, acceptance length, draft 1's and the last
    draft's acceptance."""
    pairs = against_vllm(points, dataset)
    if not pairs:
        return []
    versions = sorted({str(v.get("vllm_version")) for _, v in pairs})
    rows = [f"peagle against vLLM {', '.join(versions)} on the same prompts ({dataset}; same method, K and "
            "concurrency; AL: acceptance length, pos 1 / pos K: rounds accepting draft 1 / draft K):", "",
            _row(["row", "K", "c", "peagle tok/s", "vLLM tok/s", "peagle / vLLM", "peagle AL", "vLLM AL",
                  "vLLM AL / peagle AL", "pos 1 / pos K, peagle", "pos 1 / pos K, vLLM"]), _row(["---"] * 11)]
    for mine, theirs in pairs:
        ratio = f"{mine['tokens_per_s'] / theirs['tokens_per_s']:.2f}x" if theirs["tokens_per_s"] > 0 else "-"
        al = [x["acceptance_length"] for x in (mine, theirs)]
        al_ratio = f"{al[1] / al[0]:.3f}" if None not in al and al[0] > 0 else "-"
        rows.append(_row([METHOD_LABELS[mine["method"]], "-" if mine["k"] is None else str(mine["k"]),
                          str(mine["concurrency"]), f"{mine['tokens_per_s']:.1f}", f"{theirs['tokens_per_s']:.1f}",
                          ratio, *(f"{a:.2f}" if a is not None else "-" for a in al), al_ratio,
                          _ends(mine), _ends(theirs)]))
    return rows + [""]


def _ends(p: dict) -> str:
    rates = p.get("per_position_acceptance") or []
    return f"{rates[0]:.2f} / {rates[-1]:.2f}" if rates else "-"


def _vllm_refusals(results: dict[str, Any]) -> list[str]:
    """A line for each vLLM row that did not run to its end (vLLM refused the head or the settings, or it died)."""
    failed = [r for r in (results.get("vllm") or {}).get("rows", []) if r.get("error")]
    lines = [f"- {METHOD_LABELS['vllm_' + r['method']]}{'' if r['k'] is None else ' K=' + str(r['k'])}: "
             f"{r['error']} (log: {r.get('log', '-')})" for r in failed]
    return ["vLLM rows that did not finish:", "", *lines, ""] if lines else []


def _hf_table(points: list[dict], dataset: str, temperature: float) -> list[str]:
    best = best_points(points, dataset, temperature)
    hf = sorted(((v, c), p) for (v, c), p in best.items() if v in HF_METHODS)
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
    spec = [p for p in points if p["dataset"] == dataset and p["acceptance_length"] is not None
            and not p.get("adaptive")]
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


def _verification_table(points: list[dict], dataset: str) -> list[str]:
    """Drafts verified per accepted draft by row and concurrency, where some row cut its drafts by confidence: the
    verification work a cutoff saves."""
    spec = [p for p in points if p["dataset"] == dataset and p.get("verified_per_accepted") is not None]
    if not any((p.get("adaptive") or {}).get("cutoff_above") is not None or (p.get("adaptive") or {}).get("cutoffs")
               for p in spec):
        return []
    cs = sorted({p["concurrency"] for p in spec})
    rows = [f"Draft tokens verified per accepted draft ({dataset}):", "",
            _row(["row", *(f"c={c}" for c in cs)]), _row(["---"] * (len(cs) + 1))]
    for v, k in dict.fromkeys((variant(p), p["k"]) for p in spec):
        cell = {p["concurrency"]: p["verified_per_accepted"] for p in spec if (variant(p), p["k"]) == (v, k)}
        rows.append(_row([label_with_k(v, k), *(f"{cell[c]:.2f}" if c in cell else "-" for c in cs)]))
    return rows + [""]


def label_with_k(v: str, k: int | None) -> str:
    """A row's label with its K, unless it names its K already (a cutoff row) or has none."""
    label = variant_label(v)
    return label if k is None or f"K={k}" in label else f"{label} K={k}"


def _point_name(p: dict) -> str:
    return f"{label_with_k(variant(p), p['k'])}, {p['dataset']}, {temperature_title(p.get('temperature', 0.0))}, " \
           f"c={p['concurrency']}"


def _hygiene_section(points: list[dict]) -> list[str]:
    again = [p for p in points if p.get("remeasured")]
    flagged = [p for p in points if p.get("flags")]
    lines = ["## Hygiene", "", f"{len(again)} point(s) re-measured once, {len(flagged)} still flagged "
             "(rate far off its neighbours along concurrency, or a TTFT p99 that says the point stalled).", ""]
    if again:
        lines += [_row(["re-measured point", "first tok/s", "now tok/s", "why", "still flagged"]),
                  _row(["---"] * 5)]
        lines += [_row([_point_name(p), f"{p['remeasured']['tokens_per_s']:.0f}", f"{p['tokens_per_s']:.0f}",
                        "; ".join(p["remeasured"]["flags"]), "; ".join(p["flags"]) or "no"]) for p in again]
        lines.append("")
    never = [p for p in flagged if not p.get("remeasured")]
    if never:
        lines += ["Flagged, not re-measured (checked after the run, or by a later point):", ""]
        lines += [f"- {_point_name(p)}: {'; '.join(p['flags'])}" for p in never] + [""]
    return lines


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def summary_line(results: dict[str, Any], files: dict[str, Any]) -> str:
    """The last line a run prints: where its files are and the headline speed-ups, as one JSON object.

    Greedy speed-ups are keyed speedup_A_vs_B (A, B a method, or method@policy for an adaptive row); sampled ones
    speedup_A_vs_B_tT. Also the number of re-measured and still-flagged points."""
    points = results["points"]
    summary: dict[str, Any] = {"results": str(files.get("results")), "markdown": str(files.get("markdown")),
                               "plots": [str(p) for p in files.get("plots", [])], "num_points": len(points),
                               "num_remeasured": sum(bool(p.get("remeasured")) for p in points),
                               "num_flagged": sum(bool(p.get("flags")) for p in points)}
    for t in temperatures_of(points):
        suffix = "" if t == 0 else f"_t{t:g}"
        for a, b in speedup_pairs(variants_of(points)):
            by_dataset = {d: {str(c): round(r, 3) for c, r in speedups(points, d, a, b, t).items()}
                          for d in datasets_of(points)}
            if any(by_dataset.values()):
                summary[f"speedup_{a}_vs_{b}{suffix}"] = by_dataset
    return json.dumps(summary, separators=(",", ":"))


def command_line() -> str:
    return shlex.join(["peagle", *sys.argv[1:]])


def print_outcome(results: dict, files: dict, banner: str | None = None) -> None:
    """The table, where the files are, an optional banner, and last the one-line JSON summary."""
    print(markdown(results))
    print(f"results: {files['results']}\ntable:   {files['markdown']}")
    for plot in files["plots"]:
        print(f"plot:    {plot}")
    for method, path in files.get("policies", {}).items():
        print(f"policy:  {path} ({method}, calibrated)")
    if banner:
        print(banner)
    print(summary_line(results, files))
