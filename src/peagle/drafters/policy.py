"""A head's adaptive policy file: `adaptive.json` beside the head, its calibrated default number of drafts per load.

The file holds a policy in the shape `speculative_config.adaptive` takes, `{"thresholds": [[bound, K], ...],
"above": K}` and, where the calibration swept confidence cutoffs, `"cutoffs": [[bound, cutoff], ...],
"cutoff_above": cutoff` (the draft confidence cutoff per load), plus a `calibration` record (what was measured, on
which GPU) that readers ignore. `peagle bench
--calibrate` derives and writes it (peagle.bench.calibration); `head_adaptive_default` fills it into a speculative
config that gives no `adaptive` of its own. This module imports nothing heavy: the engine calls it while parsing
configs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

POLICY_FILE = "adaptive.json"


def policy_path(head: str | Path) -> Path:
    """Where a head's policy file lives: HEAD/adaptive.json."""
    return Path(str(head)) / POLICY_FILE


def policy_text(policy: dict[str, Any]) -> str:
    """A policy in the `--adaptive` syntax: {"thresholds": [[8, 7]], "above": 0} -> "8:7,above:0"; its confidence
    cutoffs, if any, after a space: "8:7,above:3 cutoff 16:0,above:0.3"."""
    items = [f"{bound}:{k}" for bound, k in policy.get("thresholds") or ()]
    if policy.get("above") is not None:
        items.append(f"above:{policy['above']}")
    text = ",".join(items) or "above:max"
    cutoffs = [f"{bound}:{c:g}" for bound, c in policy.get("cutoffs") or ()]
    if policy.get("cutoff_above") is not None:
        cutoffs.append(f"above:{policy['cutoff_above']:g}")
    return f"{text} cutoff {','.join(cutoffs)}" if cutoffs else text


def policy_file_text(policy: dict[str, Any], record: dict[str, Any]) -> str:
    """The text of a policy file: the policy's fields and the `calibration` record that says how it was derived."""
    return json.dumps({**policy, "calibration": record}, indent=2) + "\n"


def read_policy(path: str | Path) -> dict[str, Any]:
    """The policy of an adaptive.json: {"thresholds": [...], "above": K}; ValueError naming the file if malformed."""
    try:
        data = json.loads(Path(path).read_text())
        policy = {"thresholds": [[int(b), int(k)] for b, k in data.get("thresholds", [])], "above": data.get("above")}
        if "cutoffs" in data or data.get("cutoff_above") is not None:
            policy["cutoffs"] = [[int(b), float(c)] for b, c in data.get("cutoffs", [])]
            policy["cutoff_above"] = None if data.get("cutoff_above") is None else float(data["cutoff_above"])
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not an adaptive policy file ({e}); rewrite it with peagle bench --calibrate, "
                         "delete it, or give speculative_config.adaptive explicitly") from None
    if policy["above"] is not None and not isinstance(policy["above"], int):
        raise ValueError(f"{path}: 'above' must be an integer K or null")
    return policy


def head_adaptive_default(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` with `adaptive` taken from the head's adaptive.json when it gives none (an explicit `adaptive`, even
    {}, is kept: that is how a caller asks for a fixed K). Any other spec comes back unchanged."""
    if "adaptive" in spec or not spec.get("model"):
        return spec
    path = policy_path(spec["model"])
    if not path.is_file():
        return spec
    policy = read_policy(path)
    logger.info("adaptive policy %s from %s (the head's calibrated default; pass \"adaptive\": {} for a fixed K)",
                policy_text(policy), path)
    return {**spec, "adaptive": policy}
