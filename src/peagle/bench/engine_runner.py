"""Measuring a point in process: keep `concurrency` requests in flight through an LLMEngine's step loop.

The runner talks to the engine only through `add_request(request_id, prompt_token_ids, sampling_params)`,
`step() -> [StepOutput]`, `abort_request(request_id)` and `has_unfinished_requests()`; tests drive it with a fake.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Any, Callable, Sequence

from peagle.bench.datasets import Prompt
from peagle.bench.measurement import Measurement, RequestTrace, SpecCounts, summarize

logger = logging.getLogger(__name__)


class EngineRunner:
    """Measures points on one engine (one method and K). `encode(prompt) -> token ids` applies the chat template.

    `params` are the measured requests' sampling parameters; `warmup_params` those of the warm-up requests (the
    same prompts, fewer tokens) that run before each point so that lazy allocation, compilation and CUDA-graph
    capture for that batch size are not timed. Every prompt of the point is warmed: each new prompt length can
    need a kernel variant of its own, and compiling one inside the measurement costs seconds.
    """

    def __init__(self, engine: Any, encode: Callable[[Prompt], list[int]], params: Any, warmup_params: Any,
                 clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.encode = encode
        self.params = params
        self.warmup_params = warmup_params
        self.clock = clock
        self._ids = itertools.count()
        self._encoded: dict[str, list[int]] = {}

    def measure(self, prompts: Sequence[Prompt], concurrency: int) -> Measurement:
        token_ids = [self._encode(p) for p in prompts]
        self._drive(token_ids, concurrency, self.warmup_params)
        start = self.clock()
        traces, spec = self._drive(token_ids, concurrency, self.params)
        return summarize(traces, self.clock() - start, spec)

    def close(self) -> None:
        self.engine = None  # drop the engine so its memory can go before the next one is built

    def _encode(self, prompt: Prompt) -> list[int]:
        if prompt.id not in self._encoded:
            self._encoded[prompt.id] = self.encode(prompt)
        return self._encoded[prompt.id]

    def _drive(self, token_ids: list[list[int]], concurrency: int,
               params: Any) -> tuple[list[RequestTrace], SpecCounts]:
        """Runs every prompt to completion with at most `concurrency` in flight; per-request traces + spec counts."""
        pending = deque(enumerate(token_ids))
        traces: list[RequestTrace] = [RequestTrace(submitted=0.0) for _ in token_ids]
        in_flight: dict[str, int] = {}
        spec = SpecCounts()
        while pending or in_flight:
            while pending and len(in_flight) < concurrency:
                index, ids = pending.popleft()
                request_id = f"bench-{next(self._ids)}"
                traces[index].submitted = self.clock()
                self.engine.add_request(request_id, ids, params)
                in_flight[request_id] = index
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"the engine lost {len(in_flight)} request(s) without finishing them")
            outputs = self.engine.step()
            now = self.clock()
            for out in outputs:
                index = in_flight.get(out.request_id)
                if index is None:
                    continue
                traces[index].add_chunk(now, len(out.new_token_ids))
                if out.finished:
                    del in_flight[out.request_id]
                    self._finish(traces[index], out, spec)
        return traces, spec

    @staticmethod
    def _finish(trace: RequestTrace, out: Any, spec: SpecCounts) -> None:
        if out.error is not None:
            trace.error = out.error
            logger.warning("request %s failed: %s", out.request_id, out.error)
            return
        m = out.metrics
        if m is not None:
            spec.add(m.num_drafting_rounds, m.num_draft_tokens, m.num_accepted_tokens, list(m.accepted_per_position))
