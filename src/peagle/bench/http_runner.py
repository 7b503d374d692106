"""Measuring a point against a running OpenAI-compatible server: concurrent streaming chat requests.

Acceptance comes from the server's Prometheus counters at GET /metrics, read before and after the point:
`peagle_spec_decode_num_drafts_total` (drafting rounds), `peagle_spec_decode_num_draft_tokens_total`,
`peagle_spec_decode_num_accepted_tokens_total`, `peagle_spec_decode_num_verified_tokens_total` (every drafted token
where a server lacks it), and, when exposed,
`peagle_spec_decode_num_accepted_tokens_per_pos_total{position="i"}` (0-based). The server must run only this
benchmark's requests during a point. A stream does not say how many tokens each chunk holds, so each chunk is taken
to hold the request's average (usage.completion_tokens / content chunks) when computing inter-token latency.

The client is one Python process (asyncio + httpx) or, with `client_processes` (`peagle bench --client-processes`),
several: one Python process streams at most some 20K tokens/s, so a fast server at high concurrency measures the
client instead. "auto" (the CLI's default) takes one process per 16 streams, at most half the CPUs:
min(cpus // 2, ceil(c / 16)), so 1 up to concurrency 16; an integer fixes it; never more than c. The point's
concurrency c is split as evenly as possible over the processes (spawned, each with its own event loop and httpx
client, for the point only), and its requests are dealt out by stream slot (request i to the process that owns slot
i mod c), so that every process sends the same requests as its streams would in one process and the point measures
the same prompts; with `min_seconds`, each process adds waves of its own share. The processes warm up side by side
(a barrier before each warm-up phase), report ready, and start the timed requests together when the parent, having
read the counters, sets a common start; the point's traces are merged, its wall time runs from that start to the
last process's last finish, and the counters are read by the parent before and after. A process that raises or dies
fails the point with its error (the others are terminated); a request that fails is counted in num_failed as in one
process.

The client's CPU use over the point (user + system over wall) is reported beside the point: client_cpu_per_s,
summed over the client processes, and client_cpu_per_process_max, the busiest one's; a warning (and a `c` in the
table) from 0.9 for the busiest process, where the client rather than the server may have set the rate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import queue as queue_module
import time
import traceback
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

AUTO = "auto"  # client processes: one per STREAMS_PER_PROCESS streams, at most half the CPUs
STREAMS_PER_PROCESS = 16
STOP_GRACE_S = 10.0  # how long a finished client process may take to exit before it is terminated


def client_processes_for(setting: int | str, concurrency: int) -> int:
    """The client processes of a point at `concurrency`: `setting` ("auto" or a number), at most one per stream."""
    if setting == AUTO:
        wanted = min(max(1, _cpus() // 2), math.ceil(concurrency / STREAMS_PER_PROCESS))
    else:
        wanted = int(setting)
        if wanted < 1:
            raise ValueError(f"client processes must be 'auto' or at least 1, got {setting!r}")
    return max(1, min(wanted, concurrency))


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the CPUs this process may use (a container's share)
    except AttributeError:
        return os.cpu_count() or 1


def stream_shares(concurrency: int, processes: int) -> list[int]:
    """Streams per process, as even as possible (the first ones take the remainder)."""
    return [concurrency // processes + (i < concurrency % processes) for i in range(processes)]


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
                 ignore_eos: bool = False, timeout_s: float = 600.0, client_processes: int | str = 1):
        self.url = url.rstrip("/")
        self.max_tokens = max_tokens
        self.model = model
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s
        client_processes_for(client_processes, 1)  # refuses a bad setting now, not at the first point
        self.client_processes = client_processes

    def measure(self, prompts: Sequence[Prompt], concurrency: int, *, temperature: float = 0.0,
                min_seconds: float = 0.0) -> Measurement:
        """The point: every prompt once, then more waves of them while less than `min_seconds` has passed."""
        processes = client_processes_for(self.client_processes, concurrency)
        if processes == 1:
            measured = asyncio.run(self._measure(list(prompts), concurrency, temperature, min_seconds))
        else:
            measured = self._measure_processes(list(prompts), concurrency, processes, temperature, min_seconds)
        _warn_if_client_bound(measured, concurrency)
        return measured

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
        per_s = cpu / wall if wall > 0 else None
        return dataclasses.replace(summarize(traces, wall, spec), client_cpu_per_s=per_s,
                                   client_cpu_per_process_max=per_s, client_processes=1)

    def _measure_processes(self, prompts: list[Prompt], concurrency: int, processes: int, temperature: float,
                           min_seconds: float) -> Measurement:
        """The point over `processes` spawned client processes (the module docstring says how)."""
        import multiprocessing

        try:
            import httpx
        except ImportError:
            raise ValueError("benchmarking a server (--url) needs httpx: pip install httpx") from None

        shares = stream_shares(concurrency, processes)
        owner = [w for w, share in enumerate(shares) for _ in range(share)]  # stream slot -> its process
        with httpx.Client(timeout=self.timeout_s, headers=self.headers) as client:
            model = self.model or _first_model_sync(client, self.url)
            settings = {"url": self.url, "max_tokens": self.max_tokens, "model": model, "api_key": self.api_key,
                        "ignore_eos": self.ignore_eos, "timeout_s": self.timeout_s}
            dealt = [[i for i in range(len(prompts)) if owner[i % concurrency] == w] for w in range(processes)]
            parts = [ClientShare(worker=w, streams=shares[w], concurrency=concurrency, indices=dealt[w],
                                 prompts=[prompts[i] for i in dealt[w]], temperature=temperature,
                                 min_seconds=min_seconds) for w in range(processes)]
            ctx = multiprocessing.get_context("spawn")  # no fork: the parent may run threads (a server, tqdm)
            barrier, start, inbox = ctx.Barrier(processes), ctx.Event(), ctx.Queue()
            wait_s = self.timeout_s + 60.0  # a process waiting on the others longer than a request may take
            workers = [ctx.Process(target=_client_process, args=(settings, part, barrier, start, inbox, wait_s),
                                   name=f"peagle-bench-client-{part.worker}", daemon=True) for part in parts]
            failed = True
            try:
                for proc in workers:
                    proc.start()
                _collect(inbox, workers, "ready")
                before = _counters_sync(client, self.url)
                started = time.perf_counter()
                start.set()
                done = _collect(inbox, workers, "done")
                spec = counter_delta(before, _counters_sync(client, self.url))
                failed = False
            finally:
                _stop(workers, graceful=not failed)
                inbox.close()
        wall = max(d.finished for d in done) - started
        traces = [t for d in done for t in d.traces]
        cpu = [d.cpu_s for d in done]
        return dataclasses.replace(summarize(traces, wall, spec),
                                   client_cpu_per_s=sum(cpu) / wall if wall > 0 else None,
                                   client_cpu_per_process_max=max(cpu) / wall if wall > 0 else None,
                                   client_processes=processes)

    async def _measure_share(self, part: "ClientShare", barrier, start, inbox, wait_s: float) -> "ClientResult":
        """One client process's part of a point: warm-up beside the others, then its streams from the common start."""
        import httpx

        c = part.streams
        limits = httpx.Limits(max_connections=c + 2)
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers, limits=limits) as client:
            barrier.wait(wait_s)  # the warm-up at the whole point's batch size, all processes at once
            await self._run_all(client, self.model, part.prompts[:c], c, WARMUP_MAX_TOKENS, part.temperature)
            barrier.wait(wait_s)
            # staggered as in one process: 8 + i mod concurrency tokens for the point's i-th request
            await self._run_all(client, self.model, part.prompts, c,
                                lambda j: min(self.max_tokens, WARMUP_MAX_TOKENS + part.indices[j] % part.concurrency),
                                part.temperature)
            inbox.put(("ready", part.worker, None))
            if not start.wait(wait_s):
                raise TimeoutError(f"no common start within {wait_s:.0f} s")
            cpu0 = time.process_time()
            traces = await self._run_all(client, self.model, part.prompts, c, self.max_tokens, part.temperature,
                                         part.min_seconds)
            finished, cpu = time.perf_counter(), time.process_time() - cpu0
        return ClientResult(traces=traces, finished=finished, cpu_s=cpu)

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


@dataclasses.dataclass
class ClientShare:
    """What one client process of a point sends: `streams` of the point's `concurrency`, the point's requests
    `indices` (and their prompts) of the slots it owns."""

    worker: int
    streams: int
    concurrency: int
    indices: list[int]
    prompts: list[Prompt]
    temperature: float
    min_seconds: float


@dataclasses.dataclass
class ClientResult:
    traces: list[RequestTrace]
    finished: float  # time.perf_counter() (system-wide monotonic) at its last request's end
    cpu_s: float  # user + system over its timed requests


def _client_process(settings: dict, part: ClientShare, barrier, start, inbox, wait_s: float) -> None:
    """A spawned client process: its share of the point, its result or its error onto `inbox`."""
    try:
        runner = HttpRunner(**settings)
        inbox.put(("done", part.worker, asyncio.run(runner._measure_share(part, barrier, start, inbox, wait_s))))
    except BaseException as e:  # the parent fails the point with it
        inbox.put(("error", part.worker, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _collect(inbox, workers: list, kind: str) -> list:
    """A `kind` message from every client process, in process order; the first error, or a process that ended
    without one, fails the point."""
    got: dict[int, Any] = {}
    while len(got) < len(workers):
        try:
            what, worker, payload = inbox.get(timeout=0.2)
        except queue_module.Empty:
            dead = [w for w, proc in enumerate(workers) if w not in got and proc.exitcode is not None]
            if not dead:
                continue
            try:  # what it put before it ended is in the pipe by now
                what, worker, payload = inbox.get(timeout=1.0)
            except queue_module.Empty:
                w = dead[0]
                raise RuntimeError(f"bench client process {w + 1} of {len(workers)} ended (exit code "
                                   f"{workers[w].exitcode}) before it was {kind}") from None
        if what == "error":
            raise RuntimeError(f"bench client process {worker + 1} of {len(workers)} failed: {payload}")
        if what == kind:
            got[worker] = payload
    return [got[w] for w in range(len(workers))]


def _stop(workers: list, graceful: bool) -> None:
    """Every client process ended: waited for a while after a point that succeeded, terminated at once otherwise."""
    deadline = time.monotonic() + (STOP_GRACE_S if graceful else 0.0)
    for proc in workers:
        if proc.pid is None:  # never started
            continue
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _first_model_sync(client, url: str) -> str:
    resp = client.get(f"{url}/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{url}/v1/models lists no model; pass the model name")
    return models[0]["id"]


def _counters_sync(client, url: str) -> SpecCounts:
    resp = client.get(f"{url}/metrics")
    resp.raise_for_status()
    return read_spec_counters(resp.text)


def _warn_if_client_bound(m: Measurement, concurrency: int) -> None:
    busiest = m.client_cpu_per_process_max
    if busiest is not None and busiest >= CLIENT_CPU_LIMIT:
        logger.warning("the busiest benchmark client process used %.2f CPU-s/s at concurrency %d (%d process(es), "
                       "%.2f CPU-s/s in all; a whole core is 1.0): the client, not the server, may have set this "
                       "rate; raise --client-processes", busiest, concurrency, m.client_processes or 1,
                       m.client_cpu_per_s or 0.0)


def _spread_tokens(trace: RequestTrace, arrivals: list[float], completion_tokens: int | None) -> None:
    """Fills the trace's chunks: the usage total spread evenly over content chunks (one token each without usage)."""
    if not arrivals:
        return
    total = completion_tokens if completion_tokens is not None else len(arrivals)
    base, extra = divmod(total, len(arrivals))
    for i, t in enumerate(arrivals):
        trace.add_chunk(t, base + (1 if i < extra else 0))
