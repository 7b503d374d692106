"""What the engine hands back: per-step deltas (StepOutput) and finished requests (RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    num_drafting_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: float | None = None  # mean time between output tokens after the first
    e2e_s: float | None = None

    @property
    def acceptance_length(self) -> float | None:
        """1 + accepted / rounds: tokens emitted per drafting round, the bonus token included."""
        if not self.num_drafting_rounds:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafting_rounds

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def per_position_acceptance(self) -> list[float]:
        r = self.num_drafting_rounds
        return [a / r for a in self.accepted_per_position] if r else []

    @classmethod
    def of(cls, seq, now: float) -> "RequestMetrics":
        n = seq.num_output_tokens
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
        itl = None
        if n > 1 and seq.first_token_time is not None:
            itl = (seq.last_token_time - seq.first_token_time) / (n - 1)
        return cls(seq.num_drafting_rounds, seq.num_draft_tokens, seq.num_accepted_tokens,
                   list(seq.accepted_per_position), n, ttft, itl, now - seq.arrival_time)


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None  # set when finished


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None
