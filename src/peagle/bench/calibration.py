"""The adaptive policy derived from measurements, and the file beside a head that makes it the head's default.

`derive_policy` picks, at each measured concurrency (the number of running requests a closed loop of that many
clients keeps), the K whose output tokens/s is highest relative to no speculation (K = 0), pooled over the
measured workloads (dataset x temperature) by the geometric mean of the ratios. Ks are compared on the same
workloads only: a K that a workload at that concurrency lacks (a run cut by its time limit, results merged from calls
that swept different Ks) is left out there and named in the table, since a geometric mean over fewer, easier
workloads would flatter it. A concurrency where no K was measured says nothing and gets no row. Near-ties go to the
smaller K: a K that does not clearly win costs drafting work for nothing. Between two measured concurrencies the
band boundary sits at their geometric mean (the grid is log-spaced), and the last winner holds above the largest one.

Worked example: concurrencies 1, 2, 4, 8, 16, 32, 64 won by K 11, 11, 7, 7, 5, 0, 0 give boundaries 1, 2, 5, 11, 22,
45 and, with equal neighbours merged, `{"thresholds": [[2, 11], [11, 7], [22, 5]], "above": 0}`.

Draft confidence cutoffs (`peagle bench --draft-confidence-cutoff`) are calibrated with K: a row measured at K with
cutoff c (its policy K and c at every load, `sweep.cutoff_policy`) is one more candidate (K, c) beside the fixed-K
rows (K, 0), so each concurrency's winner is a pair; near-ties go to the smaller K, then to the smaller cutoff (0:
every draft verified, the behaviour without one). The cutoffs get bands of their own at the same boundaries:
winners (11, 0), (11, 0), (7, 0), (7, 0.1), (5, 0.3), (5, 0.3), (5, 0.3) add `"cutoffs": [[5, 0.0], [11, 0.1]],
"cutoff_above": 0.3`. Where every winner's cutoff is 0 the policy has no cutoffs.

`write_policy` saves the policy beside the head as `adaptive.json`, in the format of peagle.drafters.policy, which
also reads it back as the head's default policy.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from peagle.drafters.policy import policy_file_text

logger = logging.getLogger(__name__)

TIE_TOLERANCE = 0.02  # a larger K must beat the best smaller one by more than this fraction of tokens/s
RULE = ("per concurrency, the K (and draft confidence cutoff, where swept) with the highest tokens/s over no "
        "speculation (geometric mean over the workloads every compared K was measured on; near-ties to the smaller "
        "K, then the smaller cutoff); band edges at geometric midpoints")


def _candidate(p: dict, method: str) -> tuple[int, float] | None:
    """A point's (K, cutoff) as a calibration candidate: no speculation (0, 0), a fixed-K row of `method` (K, 0), a
    cutoff row of it (K, its cutoff at every load); None for anything else (other adaptive rows, other methods)."""
    if p["method"] == "none":
        return 0, 0.0
    if p["method"] != method:
        return None
    policy = p.get("adaptive")
    if not policy:
        return p["k"], 0.0
    if not policy.get("thresholds") and not policy.get("cutoffs") and policy.get("cutoff_above") is not None:
        return policy["above"], float(policy["cutoff_above"])
    return None


def _label(candidate: tuple[int, float]) -> str:
    """"K" for a fixed K, "K@cutoff" with a cutoff (the table's keys)."""
    k, cutoff = candidate
    return f"{k}@{cutoff:g}" if cutoff else str(k)


def winners(points: Iterable[dict], method: str, tie_tolerance: float = TIE_TOLERANCE) -> list[dict]:
    """Per concurrency: each candidate's tokens/s over no speculation's (geometric mean over workloads) and the
    winner.

    Uses the points of `none`, and the fixed-K and cutoff rows of `method` (`_candidate`), that completed requests
    and carry no hygiene flag. Returns [{"concurrency": c, "winner": K, "cutoff": cutoff, "speedup_vs_none":
    {"K" or "K@cutoff": ratio}, "workloads": ["dataset@temperature", ...]}] in increasing concurrency (plus
    "left_out": {candidate: [workloads it lacks]} where candidates were measured on different workloads); K 0 is no
    speculation.
    """
    rates: dict[tuple, float] = {}
    for p in points:
        candidate = _candidate(p, method)
        if candidate is not None and p["num_prompts"] and not p.get("flags") and p["tokens_per_s"] > 0:
            rates[(p["dataset"], p.get("temperature", 0.0), p["concurrency"], candidate)] = p["tokens_per_s"]
    out = []
    for c in sorted({key[2] for key in rates if key[3] == (0, 0.0)}):
        by_k: dict[tuple, dict[str, float]] = {}  # candidate -> {workload: its tokens/s over no speculation's}
        for (dataset, temperature, cc, cand), rate in rates.items():
            base = rates.get((dataset, temperature, c, (0, 0.0)))
            if cc == c and base and cand[0]:
                by_k.setdefault(cand, {})[f"{dataset}@{temperature:g}"] = rate / base
        if not by_k:
            continue
        workloads = sorted(set().union(*by_k.values()))
        compared = {k: r for k, r in sorted(by_k.items()) if len(r) == len(workloads)}
        left_out = {_label(k): [w for w in workloads if w not in r] for k, r in sorted(by_k.items())
                    if k not in compared}
        if left_out:
            lacks = "; ".join(f"K={k} lacks {', '.join(w)}" for k, w in left_out.items())
            logger.warning("calibration at concurrency %d: K %s left out (not measured on every workload there: %s)",
                           c, ", ".join(left_out), lacks)
        if not compared:
            continue
        score = {(0, 0.0): 1.0, **{k: math.exp(sum(map(math.log, r.values())) / len(r)) for k, r in compared.items()}}
        best = max(score.values())
        winner = min(k for k, s in score.items() if s >= (1 - tie_tolerance) * best)
        row = {"concurrency": c, "winner": winner[0], "cutoff": winner[1],
               "speedup_vs_none": {_label(k): round(s, 4) for k, s in score.items()}, "workloads": workloads}
        if left_out:
            row["left_out"] = left_out
        out.append(row)
    return out


def policy_from_winners(concurrency: Sequence[int], ks: Sequence[int],
                        cutoffs: Sequence[float] | None = None) -> dict[str, Any]:
    """Bands from per-concurrency winners (see the module docstring): {"thresholds": [[bound, K], ...], "above": K},
    and "cutoffs" / "cutoff_above" where some winner's cutoff is above 0."""
    if not concurrency or len(concurrency) != len(ks) or (cutoffs is not None and len(cutoffs) != len(ks)):
        raise ValueError("need one winning K (and cutoff) per measured concurrency")
    thresholds, above = _bands(concurrency, ks)
    policy: dict[str, Any] = {"thresholds": thresholds, "above": above}
    if cutoffs is not None and any(cutoffs):
        policy["cutoffs"], policy["cutoff_above"] = _bands(concurrency, cutoffs)
    return policy


def _bands(concurrency: Sequence[int], values: Sequence) -> tuple[list[list], Any]:
    """[[bound, value], ...] up to the last band, and the last band's value; bounds at geometric midpoints."""
    bounds = [math.isqrt(a * b) for a, b in zip(concurrency, concurrency[1:])]
    bands: list[list] = []
    for bound, v, next_v in zip(bounds, values, values[1:]):
        if v != next_v:  # equal neighbours share one band, ending at the later boundary
            bands.append([bound, v])
    return bands, values[-1]


def derive_policy(points: Iterable[dict], method: str,
                  tie_tolerance: float = TIE_TOLERANCE) -> tuple[dict[str, Any], list[dict]]:
    """(policy, per-concurrency table) for `method` from a sweep's points; ValueError when they cannot say."""
    table = winners(points, method, tie_tolerance)
    if not table:
        raise ValueError(f"calibration needs unflagged points of 'none' and of {method!r} at the same concurrency "
                         "and dataset, with some K measured on every workload (dataset x temperature) of that "
                         "concurrency")
    return policy_from_winners([r["concurrency"] for r in table], [r["winner"] for r in table],
                               [r["cutoff"] for r in table]), table


def write_policy(path: str | Path, policy: dict[str, Any], record: dict[str, Any]) -> Path:
    """Writes a policy file (policy + a `calibration` record) through a temporary file; returns its path."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(policy_file_text(policy, record))
    tmp.replace(path)
    return path
