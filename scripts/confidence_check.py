"""Which draft confidence separates accepted drafts from rejected ones: each position's own probability, or the running
product along the chain (engine/spec/confidence.py), measured with real heads on the CPU.

Runs the engine greedy in fp32 (a dataset's prompts as one batch, synchronous steps) with a head at K drafts, records
the drafter's probability of every draft it proposes and how many of them the target accepted, then replays the rounds
under each rule and a range of cutoffs: drafts verified against drafts accepted (a truncated round keeps
min(accepted, verified)). A rule is better where, for as many verified drafts, it keeps more of the accepted ones.
Prints a table per head and dataset and one JSON line last.

    python scripts/confidence_check.py --target TESTBED_BF16_DIR --head peagle=HEADS/peagle --head eagle3=HEADS/eagle3
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

RULES = {
    "product": lambda p: p.cumprod(dim=1),  # the chain's probability up to each draft
    "position": lambda p: p.cummin(dim=1).values,  # each draft's own probability (a prefix: the first below ends it)
}
CUTOFFS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
SAVINGS = (0.3, 0.5, 0.7)  # fractions of the verified drafts left out, at which the rules' kept acceptance is compared


def mtbench_prompts(category: str) -> list[list[dict]]:
    """MT-Bench first turns of one category (the vendored file), as chats."""
    from peagle.datasets import data_file

    lines = data_file("mtbench_question.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [[{"role": "user", "content": r["turns"][0]}] for r in records if r["category"] == category]


def datasets(limit: int) -> dict[str, list[list[dict]]]:
    from peagle.datasets import load_prompts

    code = [list(p.messages) for p in load_prompts("humaneval", limit=limit)]
    return {"code": code, "math": mtbench_prompts("math")[:limit], "reasoning": mtbench_prompts("reasoning")[:limit]}


def record_rounds(llm, chats: list[list[dict]], max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafter probabilities [R, K], drafts accepted [R]) of every verified round, the chats run as one batch."""
    from peagle import SamplingParams
    from peagle.engine.spec import proposer as proposer_module

    runner = llm.engine.runner
    zero = torch.zeros((), device=runner.device)
    proposed: list[torch.Tensor] = []  # the step's [B, K] drafter probabilities, set by the proposer
    real_truncate, real_propose = proposer_module.truncate_drafts, runner.proposer.propose

    def truncate(drafts, probs, cutoff):
        proposed.append(probs.cpu())
        return real_truncate(drafts, probs, cutoff)

    proposer_module.truncate_drafts = truncate
    runner.proposer.propose = lambda inp, k=None, cutoff=None: real_propose(inp, k, zero)
    held: dict[str, torch.Tensor] = {}  # per request: the probabilities of the drafts it verifies next
    probs, acc = [], []
    real_execute = runner.execute

    def execute(seqs, drafts, st, plan, chunks=None):
        proposed.clear()
        result = real_execute(seqs, drafts, st, plan, chunks)
        for i, seq in enumerate(seqs):
            if drafts[i] and seq.seq_id in held:  # round i verifies what the step before proposed for it
                probs.append(held[seq.seq_id][:len(drafts[i])])
                acc.append(result.num_accepted[i])
            if proposed:
                held[seq.seq_id] = proposed[0][i]
        return result

    runner.execute = execute
    try:
        llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    finally:
        proposer_module.truncate_drafts = real_truncate
        runner.execute = real_execute
    k = max(len(p) for p in probs)
    full = [p for p, a in zip(probs, acc) if len(p) == k]  # rounds cut short by max_model_len left out
    return torch.stack(full), torch.tensor([a for p, a in zip(probs, acc) if len(p) == k])


def curve(probs: torch.Tensor, accepted: torch.Tensor, rule: str) -> list[dict]:
    """Per cutoff: drafts verified and drafts accepted per round when each round verifies its confident prefix."""
    conf = RULES[rule](probs)
    rows = []
    for cutoff in CUTOFFS:
        n = (conf >= cutoff).sum(dim=1)
        rows.append({"cutoff": cutoff, "verified": float(n.float().mean()),
                     "accepted": float(torch.minimum(n, accepted).float().mean())})
    return rows


def kept_at(rows: list[dict], saving: float) -> float:
    """Accepted drafts kept (a fraction of the untruncated round's) where the verified drafts fall by `saving`,
    interpolated between cutoffs."""
    full_v, full_a = rows[0]["verified"], rows[0]["accepted"]
    target = (1 - saving) * full_v
    for hi, lo in zip(rows, rows[1:]):
        if lo["verified"] <= target <= hi["verified"]:
            span = hi["verified"] - lo["verified"]
            w = (hi["verified"] - target) / span if span else 0.0
            return (hi["accepted"] + w * (lo["accepted"] - hi["accepted"])) / full_a
    return float("nan")


def separation(probs: torch.Tensor, accepted: torch.Tensor, rule: str) -> float:
    """AUC of the rule's confidence at separating accepted drafts from rejected ones, over the positions the
    target reached (draft i with drafts before it accepted)."""
    conf = RULES[rule](probs)
    j = torch.arange(probs.shape[1])[None, :]
    reached = j <= accepted[:, None]
    reached &= j < probs.shape[1]
    good = conf[reached & (j < accepted[:, None])]
    bad = conf[reached & (j == accepted[:, None])]
    if not len(good) or not len(bad):
        return float("nan")
    return float((good[:, None] > bad[None, :]).float().mean() + 0.5 * (good[:, None] == bad[None, :]).float().mean())


def main() -> None:
    from peagle import LLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the testbed target (bf16 safetensors directory)")
    parser.add_argument("--head", action="append", required=True, metavar="NAME=DIR", help="a head (repeatable)")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per dataset")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    summary = {}
    for name, head in (h.split("=", 1) for h in args.head):
        parallel = json.loads((Path(head) / "config.json").read_text()).get("method") == "peagle" or name == "peagle"
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": args.k, "parallel_drafting": parallel,
                "adaptive": {}}
        llm = LLM(model=args.target, speculative_config=spec, device="cpu", dtype="float32", max_model_len=1024,
                  max_num_seqs=args.prompts, async_scheduling=False, enforce_eager=True)
        for dataset, chats in datasets(args.prompts).items():
            probs, accepted = record_rounds(llm, chats, args.max_tokens)
            out = {"rounds": len(accepted), "acceptance_length": 1 + float(accepted.float().mean()),
                   "per_position": [float((accepted > i).float().mean()) for i in range(args.k)]}
            print(f"\n{name} on {dataset}: {out['rounds']} rounds, AL {out['acceptance_length']:.2f}, per position "
                  + ", ".join(f"{r:.2f}" for r in out["per_position"]))
            print(f"{'rule':9} {'AUC':>6} " + " ".join(f"kept@-{int(100 * s)}%" for s in SAVINGS))
            for rule in RULES:
                rows = curve(probs, accepted, rule)
                kept = {str(s): kept_at(rows, s) for s in SAVINGS}
                auc = separation(probs, accepted, rule)
                out[rule] = {"auc": auc, "kept": kept, "curve": rows}
                print(f"{rule:9} {auc:6.3f} " + " ".join(f"{kept[str(s)]:9.3f}" for s in SAVINGS))
            summary[f"{name}/{dataset}"] = out
        del llm
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
