"""Measuring a point in process: keep `concurrency` requests in flight through an LLMEngine's step loop.

The runner talks to the engine only through `add_request(request_id, prompt_token_ids, sampling_params)`,
`step() -> [StepOutput]`, `abort_request(request_id)` and `has_unfinished_requests()`; tests drive it with a fake.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable, Sequence

from peagle.datasets import Prompt
from peagle.bench.measurement import (
    WARMUP_MAX_TOKENS,
    Measurement,
    RequestPlan,
    RequestTrace,
    SpecCounts,
    summarize,
)

logger = logging.getLogger(__name__)


class EngineRunner:
    """Measures points on one engine (one method and K). `encode(prompt) -> token ids` applies the chat template.

    `params(temperature, max_tokens)` makes a request's sampling parameters. Before each point its prompts run
    untimed as warm-up requests (same temperature, `warmup_tokens` tokens) so that lazy allocation, compilation and
    CUDA-graph capture for that batch size are not timed. Every prompt of the point is warmed: each new prompt
    length can need a kernel variant of its own, and compiling one inside the measurement costs seconds. At
    concurrency above 1 they run twice: first all at once (each prompt's prefill), then with staggered lengths
    (`warmup_tokens` + i mod concurrency tokens for the i-th, at most the point's), so that requests finish a step
    apart and each step admits a prompt beside the running decodes, as in the measurement: the engine captures the
    graph of such a step's (tokens, requests) bucket on its first use, some 30-40 ms each, which would otherwise
    fall inside the measured seconds (docs/DECISIONS.md).
    """

    def __init__(self, engine: Any, encode: Callable[[Prompt], list[int]], params: Callable[[float, int], Any],
                 max_tokens: int, warmup_tokens: int = WARMUP_MAX_TOKENS,
                 clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.encode = encode
        self.params = params
        self.max_tokens = max_tokens
        self.warmup_tokens = min(warmup_tokens, max_tokens)
        self.clock = clock
        self._ids = itertools.count()
        self._encoded: dict[str, list[int]] = {}

    def measure(self, prompts: Sequence[Prompt], concurrency: int, *, temperature: float = 0.0,
                min_seconds: float = 0.0, requests: int | None = None) -> Measurement:
        """The point: every prompt once, then more waves of them while less than `min_seconds` has passed (or, with
        `requests`, exactly that many requests in the same order)."""
        token_ids = [self._encode(p) for p in prompts]
        self._drive(token_ids, concurrency, self.params(temperature, self.warmup_tokens), 0.0)
        if concurrency > 1:
            self._drive(token_ids, concurrency, lambda i: self.params(
                temperature, min(self.max_tokens, self.warmup_tokens + i % concurrency)), 0.0)
        start = self.clock()
        traces, spec = self._drive(token_ids, concurrency, self.params(temperature, self.max_tokens), min_seconds,
                                   requests)
        return summarize(traces, self.clock() - start, spec)

    def close(self) -> None:
        self.engine = None  # drop the engine so its memory can go before the next one is built

    def _encode(self, prompt: Prompt) -> list[int]:
        if prompt.id not in self._encoded:
            self._encoded[prompt.id] = self.encode(prompt)
        return self._encoded[prompt.id]

    def _drive(self, token_ids: list[list[int]], concurrency: int, params: Any,
               min_seconds: float, requests: int | None = None) -> tuple[list[RequestTrace], SpecCounts]:
        """Runs the point's requests with at most `concurrency` in flight; per-request traces + spec counts.
        `params`: every request's sampling parameters, or a function of the request's number in the plan."""
        plan = RequestPlan(len(token_ids), concurrency, min_seconds, self.clock, self.clock(), exact=requests)
        traces: list[RequestTrace] = []
        in_flight: dict[str, int] = {}
        spec = SpecCounts()
        more = True
        while more or in_flight:
            while more and len(in_flight) < concurrency:
                index = plan.take()
                if index is None:
                    more = False
                    break
                request_id = f"bench-{next(self._ids)}"
                traces.append(RequestTrace(submitted=self.clock()))
                self.engine.add_request(request_id, token_ids[index],
                                        params(plan.issued - 1) if callable(params) else params)
                in_flight[request_id] = len(traces) - 1
            if not in_flight:
                break
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"the engine lost {len(in_flight)} request(s) without finishing them")
            outputs = self.engine.step()
            now = self.clock()
            for out in outputs:
                trace = in_flight.get(out.request_id)
                if trace is None:
                    continue
                traces[trace].add_chunk(now, len(out.new_token_ids))
                if out.finished:
                    del in_flight[out.request_id]
                    self._finish(traces[trace], out, spec)
        return traces, spec

    @staticmethod
    def _finish(trace: RequestTrace, out: Any, spec: SpecCounts) -> None:
        if out.error is not None:
            trace.error = out.error
            logger.warning("request %s failed: %s", out.request_id, out.error)
            return
        m = out.metrics
        if m is not None:
            spec.add(m.num_drafting_rounds, m.num_draft_tokens, m.num_accepted_tokens, list(m.accepted_per_position),
                     m.num_verified_tokens)
