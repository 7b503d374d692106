"""The adaptive K: what each step verifies and proposes, decided once per step by `DraftPlanner` as a `DraftPlan`
that the engine hands to the model runner, which follows it and picks its graphs by it.

The adaptive policy (config.AdaptivePolicy) gives the load's K: the most drafts a request verifies with that many
requests running. A step verifies the drafts its requests hold (cut to the load's K) and, with
propose_verified_only (the default), proposes as many for the next step (`draft_count`; the engine's K after a step
without drafts); without it every step proposes the engine's K. When the load falls and the load's K rises above the
drafts held, the step is laid out as the new K's step, its missing drafts fed as PAD_DRAFT (never accepted), so it
runs as that K's steps do (graphs) and proposes the new count; a step that cannot be padded (a prompt or chunk beside
it, logits processing that reads the drafts, no room before max_model_len) proposes its own count, and the rise
comes at the next decode-only step. K = 0 turns speculation off: the drafter runs only over new prompts, and the step
that turns it back on verifies no drafts and proposes the engine's K (cuda_graph's resume graphs).

With a draft confidence cutoff (`confident`), requests hold only their confident drafts (spec/confidence.py), as many
as each has: a step is laid out for the load's K and verifies what each request holds, without padding (the
model runner lays such steps out compactly: a request's rows are its own drafts), and proposes the load's K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peagle.engine.config import AdaptivePolicy

# A draft that is fed but never accepted (the verifiers skip ids < 0): pads a step whose K rose to the new K's layout,
# and stands for each draft a request does not verify because its confidence fell below the cutoff.
PAD_DRAFT = -1
# A step launched ahead with drafts cut by confidence gets rows for its requests' next tokens and this many times the
# drafts they held in the round before, plus one request's K (`DraftPlanner.compact_budget`)
BUDGET_MARGIN = 1.25


@dataclass(frozen=True, slots=True)
class DraftPlan:
    """One step's drafting: the drafts each request verifies (the step's layout and its graphs' K), the drafts the
    drafter proposes per request for the next step (0: the drafter does not run), and whether requests' missing
    drafts are padded with PAD_DRAFT up to verify_k."""

    verify_k: int
    propose_k: int = 0
    pad: bool = False

    @property
    def draft(self) -> bool:
        """Whether the drafter runs this step."""
        return self.propose_k > 0


class DraftPlanner:
    """The engine's drafting rules: its K (0 without a drafter), the adaptive policy, whether a step proposes only
    what it verifies, and max_model_len, past which no draft position may lie."""

    def __init__(self, k: int, adaptive: AdaptivePolicy | None = None, *, propose_verified_only: bool = True,
                 max_model_len: int, confidence_cutoff: float | None = None):
        self.k = k
        self.adaptive = adaptive if adaptive is not None else AdaptivePolicy()
        self.propose_verified_only = propose_verified_only
        self.max_model_len = max_model_len
        self.confidence_cutoff = confidence_cutoff  # None: the adaptive policy's cutoffs

    def load_k(self, num_running: int) -> int:
        """The most drafts a request verifies with `num_running` requests running (0: speculation off)."""
        return self.adaptive.k_for(num_running, self.k) if self.k else 0

    @property
    def confident(self) -> bool:
        """Whether requests verify only their confident drafts (a cutoff at some load; an explicit 0 turns it off)."""
        if not self.k:
            return False
        if self.confidence_cutoff is not None:
            return self.confidence_cutoff > 0
        return self.adaptive.has_cutoffs

    def cutoff(self, num_running: int) -> float:
        """The draft confidence cutoff with `num_running` requests running (0: every draft verified)."""
        if self.confidence_cutoff is not None:
            return self.confidence_cutoff
        return self.adaptive.cutoff_for(num_running)

    def graph_ks(self) -> list[int]:
        """Every K a decode step can verify: the engine's and each K the adaptive policy may pick."""
        if not self.k:
            return [0]
        policy = self.adaptive
        ks = {self.k} | {k for _, k in policy.thresholds} | ({policy.above} if policy.above is not None else set())
        return sorted({min(k, self.k) for k in ks})

    def draft_count(self, k: int) -> int:
        """The drafts a step verifying k per request proposes for the next, as its graphs do: with
        propose_verified_only as many as it verifies (the load's K, which the next step most likely verifies again;
        the engine's K after a step without drafts), else the engine's K."""
        return k if k > 0 and self.propose_verified_only else self.k

    def trim(self, seqs, load_k: int) -> None:
        """Each running request's drafts cut to what its next step may verify: the load's K, and no position past
        max_model_len."""
        for seq in seqs:
            cut = max(0, min(load_k, self.max_model_len - seq.num_tokens))
            del seq.draft_token_ids[cut:]
            seq.num_proposed_drafts = min(seq.num_proposed_drafts, cut)

    def plan(self, seqs, drafts: list[list[int]], load_k: int, *, logits_processing: bool = False,
             chunks: list[int] | None = None) -> DraftPlan:
        """A step built on the host from its requests' drafts (trimmed to load_k). `logits_processing`: some request
        processes its logits (it reads the drafts as history); `chunks`: the step prefills in chunks."""
        most = max(map(len, drafts), default=0)
        # The drafter runs unless the policy turned speculation off (K = 0); it still reads new prompts.
        if not self.k or not (load_k > 0 or any(s.num_computed_tokens < s.num_tokens - 1 for s in seqs)):
            return DraftPlan(most)
        if self.confident and load_k > 0:  # each request verifies what it holds, the step proposes the load's K
            return DraftPlan(load_k, self.draft_count(load_k))
        if (self.propose_verified_only and self.rose(load_k, most)
                and self.can_pad(seqs, drafts, most, load_k, logits_processing, chunks)):
            return DraftPlan(load_k, load_k, pad=True)
        # A rise that cannot be padded proposes what its K's graphs do: proposing the new count would run the whole
        # step eagerly (several rounds' time on the GPU) at every admission across a band edge (docs/DECISIONS.md).
        return DraftPlan(most, self.draft_count(most))

    def plan_ahead(self, num_running: int, num_drafts: int, *, admitting: bool) -> DraftPlan | None:
        """A step launched before the answer in flight reached the host (async scheduling), feeding the first of the
        `num_drafts` drafts each request's answer holds; `admitting`: it admits new prompts too. None when the
        load's K rose above those drafts and no prompt comes in: the step then waits for the answer, so that it can
        be padded (`plan`); beside prompts it cannot be, and runs at the K its drafts hold."""
        load_k = self.load_k(num_running)
        if self.rose(load_k, num_drafts) and not admitting:
            return None
        k = min(load_k, num_drafts)
        draft = self.k > 0 and (admitting or load_k > 0)  # new prompts: the drafter reads them
        return DraftPlan(k, self.draft_count(k) if draft else 0)

    @staticmethod
    def compact_budget(held: list[int], k: int) -> int:
        """Rows for a step launched ahead of its answer whose requests verify only their confident drafts (of which
        the host has not seen the count yet): each request's next token, and BUDGET_MARGIN times the drafts `held`
        in the round before plus one request's k, never more than all their k drafts. Where the drafts come out
        deeper than that, the device cuts the deepest (`kernels.compact_decode_inputs`): lossless, but fewer
        accepted; one request alone is never cut."""
        drafts = sum(min(h, k) for h in held)
        return len(held) + min(len(held) * k, math.ceil(BUDGET_MARGIN * drafts) + k)

    @staticmethod
    def rose(load_k: int, held: int) -> bool:
        """Whether the load's K is above the drafts requests hold (and they hold some: a step without drafts
        proposes the engine's K anyway)."""
        return 0 < held < load_k

    def can_pad(self, seqs, drafts: list[list[int]], k: int, want: int, logits_processing: bool,
                chunks: list[int] | None) -> bool:
        """Whether a step verifying k drafts can be laid out as one verifying `want` (padded): every request decodes
        with k drafts, no logits processing reads the drafts, and the padded positions stay inside the model."""
        if chunks is not None or logits_processing:
            return False
        return all(s.num_tokens - s.num_computed_tokens == 1 and len(d) == k
                   and s.num_tokens + want <= self.max_model_len for s, d in zip(seqs, drafts))
