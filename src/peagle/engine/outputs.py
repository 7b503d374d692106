"""What the engine hands back: per-step deltas (StepOutput) and finished requests in vLLM's shape (RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    num_drafting_rounds: int = 0
    num_draft_tokens: int = 0  # drafts proposed for its rounds (vLLM's "drafted")
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: float | None = None  # mean time between output tokens after the first
    e2e_s: float | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # drafts the target verified: num_draft_tokens less those a draft confidence cutoff left out
    num_verified_tokens: int = 0

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
                   list(seq.accepted_per_position), n, ttft, itl, now - seq.arrival_time, seq.num_cached_tokens,
                   seq.num_verified_tokens)


# One emitted token's log-probabilities, as the engine reports them: (token id, logprob, rank, [(id, logprob)]
# of the top alternatives, most likely first). Ranks count from 1 (the target's argmax).
TokenLogprobs = tuple[int, float, int, list[tuple[int, float]]]


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None  # set when finished
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log-probability under the target, its rank there, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's n sequences, as vLLM's CompletionOutput.

    `logprobs` holds one dict per generated token, keyed by token id: the chosen token and the top alternatives.
    `stop_reason` is the stop string or `stop_token_ids` id that ended it (None for EOS, length, abort).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A finished request in vLLM's shape: `outputs` holds its n sequences (`outputs[0].text`).

    `text`, `token_ids` and `finish_reason` read the first sequence, and `metrics` sums the speculation counters
    of all of them, for callers written before `outputs` existed.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = True
    # with SamplingParams.prompt_logprobs, vLLM's: None for the first prompt token, then each token's dict (the token
    # and the top alternatives, keyed by id)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # why the engine ended it with finish_reason "error" (out of KV cache, ...)
    num_cached_tokens: int = 0  # vLLM's: prompt tokens served from the prefix cache (enable_prefix_caching)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
