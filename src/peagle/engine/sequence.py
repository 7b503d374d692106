"""Sequence: one request's tokens, KV bookkeeping, drafts and metrics, on the host.

Vocabulary used throughout the engine:
- `num_computed_tokens`: leading tokens whose TARGET KV is final. The last token is never computed: it was just
  sampled and is fed to the target in the next step.
- `draft_token_ids`: drafts proposed for the next verification (set by the proposer through `set_drafts`, which
  keeps those before the first PAD_DRAFT, the drafts the drafter is confident in; cleared by `commit` and by
  preemption).
- A step feeds `token_ids[num_computed_tokens:] + draft_token_ids` (`num_new_tokens` of them) to the target; the
  verifier answers with the accepted drafts plus one sampled token (recovered or bonus), which `commit` applies.
"""

from __future__ import annotations

import enum
import time

from peagle.engine.sampling_params import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """One request. Times (`arrival_time`, `now`) are `time.monotonic()` seconds."""

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int | None = None,
    ):
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)  # prompt + output, one list
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        # None: no length cap of its own; the scheduler sets its max_model_len on admission.
        self.max_model_len = max_model_len
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache (at the last admission)
        self.prompt_logprobs: list | None = None  # TokenLogprobs of prompt tokens 1.. (SamplingParams.prompt_logprobs)
        self.drafter_gap = False  # a step fed it without running the drafter (speculation off): entries missing
        self.prefix_keys: list[bytes] | None = None  # the prompt's full-block keys (prefix caching), made once
        self.draft_token_ids: list[int] = []
        self.num_proposed_drafts = 0  # drafts the drafter proposed for the next round, unconfident ones included
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_drafting_rounds = 0
        self.num_draft_tokens = 0  # drafts proposed for the rounds (vLLM's "drafted")
        self.num_verified_tokens = 0  # drafts the target verified (fewer where confidence cut them)
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []  # [i] = rounds whose draft i was accepted; grows to the K used

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, drafts={len(self.draft_token_ids)})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_new_tokens(self) -> int:
        """Tokens the target is fed this step: the uncomputed span plus the drafts to verify."""
        return len(self.token_ids) - self.num_computed_tokens + len(self.draft_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, error: str | None = None):
        """Mark finished. Only the scheduler frees blocks: call `Scheduler.finish` from engine code."""
        assert reason in FINISH_REASONS, reason
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def append_tokens(self, new_token_ids: list[int], now: float | None = None) -> int:
        """Append tokens one by one up to the first stop condition; return how many were kept.

        Stops (and finishes the sequence) after an EOS id unless `ignore_eos`, after a `stop_token_ids` id, or when
        `max_tokens` outputs or `max_model_len` total tokens are reached. The stopping token is kept.
        """
        assert not self.is_finished, f"{self.seq_id}: append to a finished sequence"
        params = self.sampling_params
        # Tokens until a length limit: max_tokens outputs or max_model_len tokens in all.
        room = params.max_tokens - self.num_output_tokens
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(self.token_ids))
        kept, reason = len(new_token_ids), None
        if kept >= room:
            kept, reason = room, "length"
        # A stop token at or before that point wins (it is kept, and checked before the length).
        stop_ids = params.stop_token_ids
        for i, token_id in enumerate(new_token_ids[:kept]):
            if token_id in stop_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
                kept, reason = i + 1, "stop"
                break
        self.token_ids.extend(new_token_ids[:kept])
        if reason is not None:
            self.finish(reason)
        if kept:
            now = time.monotonic() if now is None else now
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        return kept

    def set_drafts(self, drafts: list[int]) -> None:
        """The drafts proposed for the next round: those before the first PAD_DRAFT (id < 0: a draft the drafter was
        not confident in) are verified; all count as proposed."""
        n = next((i for i, t in enumerate(drafts) if t < 0), len(drafts))
        self.draft_token_ids = drafts[:n]
        self.num_proposed_drafts = len(drafts)

    def commit(self, new_token_ids: list[int], now: float | None = None, num_verified: int | None = None) -> int:
        """Apply one step's verifier output: the accepted drafts followed by one sampled token.

        Records the drafting-round metrics (from the verifier's answer, before any stop truncation; `num_verified`:
        the drafts the step verified, by default all it held), consumes the drafts, appends via `append_tokens` and
        marks everything but the new last token as computed: the fed span and the accepted drafts now have final
        target KV. Returns how many tokens were kept.
        """
        drafts = self.draft_token_ids
        num_accepted = len(new_token_ids) - 1
        verified = len(drafts) if num_verified is None else num_verified
        assert 0 <= num_accepted <= verified <= len(drafts), (self.seq_id, new_token_ids, drafts, num_verified)
        assert new_token_ids[:num_accepted] == drafts[:num_accepted], "accepted tokens must be the drafts"
        proposed = max(self.num_proposed_drafts, len(drafts))
        if proposed:
            self._record_round(proposed, verified, num_accepted)
        self.draft_token_ids = []
        self.num_proposed_drafts = 0
        kept = self.append_tokens(new_token_ids, now)
        self.num_computed_tokens = len(self.token_ids) - 1
        return kept

    def commit_chunk(self, num_tokens: int):
        """Chunked prefill: the first `num_tokens` of the uncomputed span now have final target KV; nothing was
        sampled (the span goes on past the chunk)."""
        assert not self.draft_token_ids and self.num_computed_tokens + num_tokens < self.num_tokens, (self, num_tokens)
        self.num_computed_tokens += num_tokens

    def _record_round(self, num_drafts: int, num_verified: int, num_accepted: int):
        self.num_drafting_rounds += 1
        self.num_draft_tokens += num_drafts
        self.num_verified_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def reset_for_recompute(self):
        """Preemption by recompute: drop all KV state; the whole sequence is prefilled again on re-admission."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.draft_token_ids = []
        self.num_proposed_drafts = 0
        self.drafter_gap = False  # the prefill that recomputes it runs the drafter over every position
