"""What one benchmark point measures, from per-request traces: throughput, acceptance, TTFT and ITL percentiles.

Definitions (the same for the in-process engine and a server):
- tokens_per_s = output tokens of all measured requests / wall time from the first submission to the last finish.
- acceptance_length (AL) = 1 + accepted / drafting rounds (the bonus token counts); per-position acceptance i =
  accepted at draft position i / rounds; draft_acceptance_rate = accepted / drafted. None without speculation.
- verified_per_round, accepted_per_round = draft tokens the target verified, and accepted, per drafting round;
  verified_per_accepted = verified / accepted (the verification work per accepted draft, which a draft confidence
  cutoff lowers). Verified equals drafted without a cutoff.
- ttft = first output token's arrival - submission. itl = time per output token after the first: a chunk of n tokens
  arriving dt after the previous chunk contributes n gaps of dt / n, so a speculative round that emits 4 tokens at
  once counts as 4 tokens at a quarter of its latency each (per-chunk gaps would penalise speculation for batching).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Output tokens of the untimed warm-up requests before each point: a prefill and a few decode or drafting rounds at
# the point's batch size, so that allocation, compilation and graph capture for it are not measured.
WARMUP_MAX_TOKENS = 8


class RequestPlan:
    """The requests of one point in submission order, as indices into its prompts: each prompt once, then further
    whole waves of `concurrency` (the prompts again, in order) while less than `min_seconds` has passed since
    `start`, so that a point is long enough to measure a rate however fast the method is. `exact`: exactly that many
    requests in the same order instead, whatever the time (another engine's point, repeated request for request)."""

    def __init__(self, num_prompts: int, concurrency: int, min_seconds: float, clock, start: float,
                 exact: int | None = None):
        self.num_prompts, self.concurrency, self.min_seconds = num_prompts, concurrency, min_seconds
        self.clock, self.start = clock, start
        self.total = num_prompts if exact is None else exact
        self.exact = exact
        self.issued = 0

    def take(self) -> int | None:
        """The next request's prompt index, or None when the point has issued all it will."""
        if self.num_prompts == 0:
            return None
        if self.issued == self.total:
            if self.exact is not None:
                return None
            if self.clock() - self.start >= self.min_seconds:
                return None
            self.total += self.concurrency
        self.issued += 1
        return (self.issued - 1) % self.num_prompts


@dataclass
class RequestTrace:
    submitted: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in the chunk)
    error: str | None = None

    def add_chunk(self, now: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.chunks.append((now, num_tokens))

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.submitted if self.chunks else None

    def inter_token_gaps(self) -> list[float]:
        gaps = []
        for (prev, _), (now, n) in zip(self.chunks, self.chunks[1:]):
            gaps += [(now - prev) / n] * n
        return gaps


@dataclass
class SpecCounts:
    """Speculative-decoding counters summed over requests (or read as deltas of a server's counters)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified: int = 0

    def add(self, rounds: int, drafted: int, accepted: int, per_position: list[int],
            verified: int | None = None) -> None:
        """`verified`: the drafts the target verified (default: every drafted one)."""
        self.rounds += rounds
        self.drafted += drafted
        self.accepted += accepted
        self.verified += drafted if verified is None else verified
        if len(per_position) > len(self.accepted_per_position):
            self.accepted_per_position += [0] * (len(per_position) - len(self.accepted_per_position))
        for i, a in enumerate(per_position):
            self.accepted_per_position[i] += a


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    num_prompts: int  # requests that completed and count in the numbers below
    num_failed: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    acceptance_length: float | None
    per_position_acceptance: list[float]
    draft_acceptance_rate: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    verified_per_round: float | None = None
    accepted_per_round: float | None = None
    verified_per_accepted: float | None = None
    client_cpu_per_s: float | None = None  # against a server: the benchmark processes' CPU s/s (1.0: a whole core)
    client_cpu_per_process_max: float | None = None  # the busiest client process's CPU s/s
    client_processes: int | None = None  # the client processes that sent the point's requests


def percentile_ms(values_s: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values_s) * 1e3, q)) if values_s else None


def summarize(traces: list[RequestTrace], wall_s: float, spec: SpecCounts | None) -> Measurement:
    ok = [t for t in traces if t.error is None]
    output_tokens = sum(t.num_output_tokens for t in ok)
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    gaps = [g for t in ok for g in t.inter_token_gaps()]
    rounds = spec.rounds if spec else 0
    return Measurement(
        num_prompts=len(ok),
        num_failed=len(traces) - len(ok),
        output_tokens=output_tokens,
        wall_s=wall_s,
        tokens_per_s=output_tokens / wall_s if wall_s > 0 else 0.0,
        acceptance_length=1.0 + spec.accepted / rounds if rounds else None,
        per_position_acceptance=[a / rounds for a in spec.accepted_per_position] if rounds else [],
        draft_acceptance_rate=spec.accepted / spec.drafted if spec and spec.drafted else None,
        ttft_p50_ms=percentile_ms(ttfts, 50),
        ttft_p99_ms=percentile_ms(ttfts, 99),
        itl_p50_ms=percentile_ms(gaps, 50),
        itl_p99_ms=percentile_ms(gaps, 99),
        verified_per_round=spec.verified / rounds if rounds else None,
        accepted_per_round=spec.accepted / rounds if rounds else None,
        verified_per_accepted=spec.verified / spec.accepted if spec and spec.accepted else None,
    )
