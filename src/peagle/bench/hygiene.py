"""Hygiene of a sweep's points: a rate far off its neighbours along concurrency, or a TTFT tail that says it stalled.

A series is one (dataset, temperature, method, adaptive policy, K) measured at several concurrencies. Along it,
total output tokens/s should not fall as concurrency rises, and the rate per request should not rise; a point that
breaks either by more than `drop_tolerance` is flagged (the later point of a fall, the earlier point of a rise).
A point whose TTFT p99 is `stall_factor` times, and `stall_min_ms` above, the larger TTFT p99 of its neighbouring
concurrencies stalled (a compilation, an allocator hiccup) somewhere inside it. A lower neighbour's TTFT is scaled by
the ratio of concurrencies first: a burst of c prompts queues c prefills, so prefill-bound points (long prompts) grow
their TTFT tail with concurrency without stalling (docs/DECISIONS.md). `settle` re-measures each flagged point once
and leaves in its `flags` what still stands. All functions are pure over point dicts (docs/BENCH_SCHEMA.md) except
for the `measure_again` callable given to `settle`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from peagle.bench.report import ENGINE_METHODS, variant


@dataclass(frozen=True, kw_only=True, slots=True)
class HygieneRules:
    drop_tolerance: float = 0.15  # fraction by which tokens/s may fall (or tokens/s per request rise) between steps
    stall_factor: float = 4.0  # TTFT p99 over this many times the neighbours' ...
    stall_min_ms: float = 250.0  # ... and more than this above them, is a stall

    def __post_init__(self):
        if not 0 < self.drop_tolerance < 1:
            raise ValueError(f"drop_tolerance must be in (0, 1), got {self.drop_tolerance}")
        if self.stall_factor <= 1 or self.stall_min_ms < 0:
            raise ValueError("stall_factor must be > 1 and stall_min_ms >= 0")


def series_key(p: dict) -> tuple:
    return p["dataset"], p.get("temperature", 0.0), variant(p), p["k"]


def series(points: list[dict]) -> dict[tuple, list[int]]:
    """Series key -> indices into `points` in increasing concurrency (engine points that completed requests)."""
    out: dict[tuple, list[int]] = {}
    for i, p in enumerate(points):
        if p["method"] in ENGINE_METHODS and p["num_prompts"]:
            out.setdefault(series_key(p), []).append(i)
    return {key: sorted(idx, key=lambda i: points[i]["concurrency"]) for key, idx in out.items()}


def flag_points(points: list[dict], rules: HygieneRules = HygieneRules()) -> dict[int, list[str]]:
    """Index into `points` -> why that point looks wrong; points not in the result look fine."""
    flags: dict[int, list[str]] = {}
    tol = rules.drop_tolerance
    for idx in series(points).values():
        for a, b in zip(idx, idx[1:]):
            pa, pb = points[a], points[b]
            ra, rb, ca, cb = pa["tokens_per_s"], pb["tokens_per_s"], pa["concurrency"], pb["concurrency"]
            if rb < (1 - tol) * ra:
                flags.setdefault(b, []).append(f"tokens/s {1 - rb / ra:.0%} below c={ca}'s")
            if ra / ca < (1 - tol) * rb / cb:
                flags.setdefault(a, []).append(f"tokens/s per request {1 - (ra / ca) / (rb / cb):.0%} below c={cb}'s")
        for i, j in enumerate(idx):
            p99, c = points[j]["ttft_p99_ms"], points[j]["concurrency"]
            neighbours = [points[n] for n in (idx[i - 1] if i else None, idx[i + 1] if i + 1 < len(idx) else None)
                          if n is not None and points[n]["ttft_p99_ms"] is not None]
            if p99 is None or not neighbours:
                continue
            ref = max(n["ttft_p99_ms"] * max(1.0, c / n["concurrency"]) for n in neighbours)
            if p99 > rules.stall_factor * ref and p99 - ref > rules.stall_min_ms:
                flags.setdefault(j, []).append(f"TTFT p99 {p99:.0f} ms against {ref:.0f} ms at the neighbouring "
                                               "concurrency, scaled to this one (a stall)")
    return flags


def settle(points: list[dict], measure_again: Callable[[dict], dict],
           rules: HygieneRules = HygieneRules()) -> list[int]:
    """Re-measures every flagged point once (in place), then writes each point's standing `flags`.

    A re-measured point keeps its first measurement's rate, TTFT p99 and flags under `remeasured`. Re-measuring one
    point can flag a neighbour; that one is re-measured too, and no point twice. Returns the re-measured indices.
    """
    done: list[int] = []
    while True:
        todo = {i: why for i, why in flag_points(points, rules).items() if i not in done}
        if not todo:
            break
        for i, why in sorted(todo.items()):
            point = points[i]
            record = {"tokens_per_s": point["tokens_per_s"], "ttft_p99_ms": point["ttft_p99_ms"], "flags": why}
            again = measure_again(point)
            point.update({key: again[key] for key in again if key not in ("flags", "remeasured")})
            point["remeasured"] = record
            done.append(i)
    standing = flag_points(points, rules)
    for i, p in enumerate(points):
        if p["method"] in ENGINE_METHODS:
            p["flags"] = standing.get(i, [])
    return done
