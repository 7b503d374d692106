"""Measuring a point against a running OpenAI-compatible server: concurrent streaming chat requests.

Acceptance comes from the server's Prometheus counters at GET /metrics, read before and after the point:
`peagle_spec_decode_num_drafts_total` (drafting rounds), `peagle_spec_decode_num_draft_tokens_total`,
`peagle_spec_decode_num_accepted_tokens_total`, `peagle_spec_decode_num_verified_tokens_total` (every drafted token
where a server lacks it), and, when exposed,
`peagle_spec_decode_num_accepted_tokens_per_pos_total{position="i"}` (0-based). The server must run only this
benchmark's requests during a point. A stream does not say how many tokens each chunk holds, so each chunk is taken
to hold the request's average (usage.completion_tokens / content chunks) when computing inter-token latency.

The client is one Python process: its CPU use over the point (user + system over wall) is reported beside the point
as client_cpu_per_s, with a warning from 0.9, where the client rather than the server may have set the rate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any, Callable, Sequence

from peagle.datasets import Prompt
from peagle.bench.report import CLIENT_CPU_LIMIT
from peagle.bench.measurement import WARMUP_MAX_TOKENS, Measurement, RequestPlan, RequestTrace, SpecCounts, summarize

logger = logging.getLogger(__name__)

COUNTER_ROUNDS = "peagle_spec_decode_num_drafts_total"
COUNTER_DRAFTED = "peagle_spec_decode_num_draft_tokens_total"
COUNTER_ACCEPTED = "peagle_spec_decode_num_accepted_tokens_total"
COUNTER_PER_POSITION = "peagle_spec_decode_num_accepted_tokens_per_pos_total"
COUNTER_VERIFIED = "peagle_spec_decode_num_verified_tokens_total"


def read_spec_counters(metrics_text: str) -> SpecCounts:
    """The speculative counters of a Prometheus text exposition (summed over label sets; zeros when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == COUNTER_PER_POSITION:
                pos = int(sample.labels["position"])
                per_position[pos] = per_position.get(pos, 0.0) + sample.value
            elif sample.name in (COUNTER_ROUNDS, COUNTER_DRAFTED, COUNTER_ACCEPTED, COUNTER_VERIFIED):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    positions = [int(per_position.get(i, 0)) for i in range(max(per_position, default=-1) + 1)]
    drafted = int(totals.get(COUNTER_DRAFTED, 0))
    return SpecCounts(rounds=int(totals.get(COUNTER_ROUNDS, 0)), drafted=drafted,
                      accepted=int(totals.get(COUNTER_ACCEPTED, 0)), accepted_per_position=positions,
                      verified=int(totals.get(COUNTER_VERIFIED, drafted)))


def counter_delta(before: SpecCounts, after: SpecCounts) -> SpecCounts:
    width = len(after.accepted_per_position)
    prev = before.accepted_per_position + [0] * (width - len(before.accepted_per_position))
    return SpecCounts(rounds=after.rounds - before.rounds, drafted=after.drafted - before.drafted,
                      accepted=after.accepted - before.accepted,
                      accepted_per_position=[a - b for a, b in zip(after.accepted_per_position, prev)],
                      verified=after.verified - before.verified)


class HttpRunner:
    """Measures points on a server at `url` (e.g. http://127.0.0.1:8000), whatever method and K it serves."""

    def __init__(self, url: str, max_tokens: int, *, model: str | None = None, api_key: str | None = None,
                 ignore_eos: bool = False, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.max_tokens = max_tokens
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s

    def measure(self, prompts: Sequence[Prompt], concurrency: int, *, temperature: float = 0.0,
                min_seconds: float = 0.0) -> Measurement:
        """The point: every prompt once, then more waves of them while less than `min_seconds` has passed."""
        return asyncio.run(self._measure(list(prompts), concurrency, temperature, min_seconds))

    async def _measure(self, prompts: list[Prompt], concurrency: int, temperature: float,
                       min_seconds: float) -> Measurement:
        try:
            import httpx
        except ImportError:
            raise ValueError("benchmarking a server (--url) needs httpx: pip install httpx") from None

        limits = httpx.Limits(max_connections=concurrency + 2)
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers, limits=limits) as client:
            model = self.model or await self._first_model(client)
            await self._run_all(client, model, prompts[:concurrency], concurrency, WARMUP_MAX_TOKENS, temperature)
            if concurrency > 1:  # staggered, so steps admit prompts beside running decodes (EngineRunner says why)
                await self._run_all(client, model, prompts, concurrency,
                                    lambda i: min(self.max_tokens, WARMUP_MAX_TOKENS + i % concurrency), temperature)
            before = await self._counters(client)
            start, cpu0 = time.perf_counter(), time.process_time()
            traces = await self._run_all(client, model, prompts, concurrency, self.max_tokens, temperature,
                                         min_seconds)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
            spec = counter_delta(before, await self._counters(client))
        measured = dataclasses.replace(summarize(traces, wall, spec), client_cpu_per_s=cpu / wall if wall > 0 else None)
        if measured.client_cpu_per_s is not None and measured.client_cpu_per_s >= CLIENT_CPU_LIMIT:
            logger.warning("the benchmark client used %.2f CPU-s/s at concurrency %d (a whole core is 1.0): it, not "
                           "the server, may have set this rate; scripts/server_overhead.py's raw-socket clients "
                           "(--client-processes) load a server more cheaply", measured.client_cpu_per_s, concurrency)
        return measured

    async def _first_model(self, client) -> str:
        resp = await client.get(f"{self.url}/v1/models")
        resp.raise_for_status()
        models = resp.json().get("data") or []
        if not models:
            raise ValueError(f"{self.url}/v1/models lists no model; pass the model name")
        return models[0]["id"]

    async def _counters(self, client) -> SpecCounts:
        resp = await client.get(f"{self.url}/metrics")
        resp.raise_for_status()
        return read_spec_counters(resp.text)

    async def _run_all(self, client, model: str, prompts: list[Prompt], concurrency: int,
                       max_tokens: int | Callable[[int], int], temperature: float,
                       min_seconds: float = 0.0) -> list[RequestTrace]:
        """`concurrency` clients, each sending its next request when its last one ends, until the plan runs out.
        `max_tokens`: every request's, or a function of the request's number in the plan."""
        plan = RequestPlan(len(prompts), concurrency, min_seconds, time.perf_counter, time.perf_counter())
        traces: list[RequestTrace] = []

        async def client_loop() -> None:
            while (index := plan.take()) is not None:
                n = max_tokens(plan.issued - 1) if callable(max_tokens) else max_tokens
                traces.append(await self._request(client, model, prompts[index], n, temperature))

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return traces

    async def _request(self, client, model: str, prompt: Prompt, max_tokens: int,
                       temperature: float) -> RequestTrace:
        import httpx

        body: dict[str, Any] = {"model": model, "messages": list(prompt.messages), "max_tokens": max_tokens,
                                "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        trace = RequestTrace(submitted=time.perf_counter())
        arrivals: list[float] = []
        completion_tokens = None
        try:
            async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    trace.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                    return trace
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                        arrivals.append(time.perf_counter())
                    if chunk.get("usage"):
                        completion_tokens = chunk["usage"].get("completion_tokens")
        except httpx.HTTPError as e:
            trace.error = f"{type(e).__name__}: {e}"
            return trace
        _spread_tokens(trace, arrivals, completion_tokens)
        return trace


def _spread_tokens(trace: RequestTrace, arrivals: list[float], completion_tokens: int | None) -> None:
    """Fills the trace's chunks: the usage total spread evenly over content chunks (one token each without usage)."""
    if not arrivals:
        return
    total = completion_tokens if completion_tokens is not None else len(arrivals)
    base, extra = divmod(total, len(arrivals))
    for i, t in enumerate(arrivals):
        trace.add_chunk(t, base + (1 if i < extra else 0))
