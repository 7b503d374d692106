"""Prometheus metrics under `peagle_` and under vLLM's own `vllm:` names, in a registry owned by one server.

With several API server processes (`--api-server-count`), prometheus-client's multiprocess mode
(PROMETHEUS_MULTIPROC_DIR, set by the supervisor before the servers start): each process writes its values to files
there, and a scrape of any server sums every server's counters and histograms; the engine's gauges are the most
recently written.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from peagle.engine.outputs import RequestMetrics

logger = logging.getLogger("peagle.server.stats")  # the periodic stats lines (StatLogger)

# Latency buckets in seconds, as vLLM spaces them: fine below a second, coarse up to minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _Pair:
    """Two metric children updated together."""

    def __init__(self, ours, theirs):
        self._both = (ours, theirs)

    def inc(self, amount: float = 1.0):
        for m in self._both:
            m.inc(amount)

    def observe(self, value: float):
        for m in self._both:
            m.observe(value)

    def set(self, value: float):
        for m in self._both:
            m.set(value)


class _Twin(_Pair):
    """One metric under peagle's name (`peagle_<name>`) and vLLM's (`vllm:<name>`, with vLLM's model_name label),
    so vLLM's dashboards and alerts read a peagle server unchanged."""

    def __init__(self, kind, name: str, doc: str, registry, model_name: str, labels: tuple[str, ...] = (), **kw):
        self._ours = kind(f"peagle_{name}", doc, list(labels), registry=registry, **kw)
        self._vllm = kind(f"vllm:{name}", doc, ["model_name", *labels], registry=registry, **kw)
        self._model_name = model_name
        if not labels:
            super().__init__(self._ours, self._vllm.labels(model_name=model_name))

    def labels(self, **labels) -> _Pair:
        return _Pair(self._ours.labels(**labels), self._vllm.labels(model_name=self._model_name, **labels))


class _StepHistogram:
    """A histogram under peagle's name and vLLM's, observed a value at a time with a count (a step's tokens share one
    inter-token interval): one bisect and two additions where prometheus-client's Histogram pair would take two
    locked observations per token. Exported by `collect` as two metric families, as a Histogram would be."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], registry, model_name: str,
                 multiprocess: bool = False):
        self._names, self._doc, self._model_name = (f"peagle_{name}", f"vllm:{name}"), doc, model_name
        self._bounds = [*buckets, float("inf")]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()  # the engine thread observes, a scrape collects
        self._shared = None  # multiprocess mode: per twin, (bucket values, sum value) in the shared files
        if multiprocess:
            self._shared = [self._shared_values(n, labels) for n, labels in
                            ((self._names[0], {}), (self._names[1], {"model_name": model_name}))]
        else:
            registry.register(self)

    def _shared_values(self, name: str, labels: dict):
        """The values a prometheus-client Histogram would keep in multiprocess mode, so that the multiprocess
        collector sums them with every other server's."""
        from prometheus_client import values

        names, label_values = tuple(labels), tuple(labels.values())
        buckets = [values.ValueClass("histogram", name, name + "_bucket", names + ("le",),
                                     label_values + (floatToGoString(b),), self._doc) for b in self._bounds]
        return buckets, values.ValueClass("histogram", name, name + "_sum", names, label_values, self._doc)

    def observe(self, value: float, count: int = 1):
        i = bisect.bisect_left(self._bounds, value)  # the first bucket whose upper bound holds the value
        if self._shared is not None:
            for buckets, total in self._shared:
                buckets[i].inc(count)
                total.inc(value * count)
            return
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip(self._bounds, counts):
            running += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        ours = HistogramMetricFamily(self._names[0], self._doc, buckets=cumulative, sum_value=total)
        theirs = HistogramMetricFamily(self._names[1], self._doc, labels=["model_name"])
        theirs.add_metric([self._model_name], cumulative, total)
        return [ours, theirs]

    def describe(self):
        return self.collect()


class ServerMetrics:
    """Counters, histograms and gauges of one server. Thread-safe (prometheus-client locks each metric).

    Every metric exists twice: `peagle_<name>` and vLLM's `vllm:<name>` (labelled with `model_name`). The speculative
    counters mirror vLLM's `spec_decode_*`: drafting rounds, proposed draft tokens, accepted draft tokens and
    accepted tokens per draft position, so acceptance length = 1 + accepted / drafts; peagle adds the draft tokens
    the target verified (`spec_decode_num_verified_tokens`: fewer than proposed under a draft confidence cutoff).
    """

    def __init__(self, num_speculative_tokens: int = 0, model_name: str = "", prefix_caching: bool = False):
        self.registry = CollectorRegistry(auto_describe=True)
        self.multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ  # several API servers

        def twin(kind, name, doc, labels=(), **kw):
            return _Twin(kind, name, doc, self.registry, model_name, labels, **kw)

        self.num_drafts = twin(Counter, "spec_decode_num_drafts", "Drafting rounds verified.")
        self.num_draft_tokens = twin(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = twin(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.num_verified_tokens = twin(Counter, "spec_decode_num_verified_tokens",
                                        "Draft tokens verified by the target (proposed ones past the draft confidence "
                                        "cutoff are not).")
        self.accepted_per_pos = twin(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position (0 = first draft).",
                                     ("position",))
        self.prompt_tokens = twin(Counter, "prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = twin(Counter, "generation_tokens", "Tokens generated.")
        self.request_success = twin(Counter, "request_success", "Finished requests by finish reason.",
                                    ("finished_reason",))
        self.ttft = twin(Histogram, "time_to_first_token_seconds", "Time from arrival to the first output token.",
                         buckets=TTFT_BUCKETS)
        self.itl = _StepHistogram("inter_token_latency_seconds", "Time per output token after the first (a step's "
                                  "interval shared by its tokens).", ITL_BUCKETS, self.registry, model_name,
                                  self.multiprocess)
        self.e2e = twin(Histogram, "e2e_request_latency_seconds", "Time from arrival to the last output token.",
                        buckets=E2E_BUCKETS)
        self.num_running = twin(Gauge, "num_requests_running", "Requests in the running batch.",
                                 multiprocess_mode="mostrecent")
        self.num_waiting = twin(Gauge, "num_requests_waiting", "Requests waiting for admission.",
                                 multiprocess_mode="mostrecent")
        self.kv_usage = twin(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                                 multiprocess_mode="mostrecent")
        # vLLM's prefix-cache counters (tokens), with --enable-prefix-caching only: hit rate = hits / queries.
        self.prefix_cache_queries = self.prefix_cache_hits = None
        if prefix_caching:
            self.prefix_cache_queries = twin(Counter, "prefix_cache_queries", "Prompt tokens looked up in the "
                                                                              "prefix cache.")
            self.prefix_cache_hits = twin(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.totals = Totals(accepted_per_pos=[0] * num_speculative_tokens)  # the same counts, for the stats log
        # Label values known up front are created now, so that a scrape before any traffic shows zeros.
        for pos in range(num_speculative_tokens):
            self.accepted_per_pos.labels(position=str(pos))
        for reason in ("stop", "length"):
            self.request_success.labels(finished_reason=reason)

    def on_prompt(self, num_tokens: int):
        """A request admitted with a prompt of `num_tokens`."""
        self.prompt_tokens.inc(num_tokens)
        self.totals.prompt_tokens += num_tokens
        if self.prefix_cache_queries is not None:
            self.prefix_cache_queries.inc(num_tokens)
            self.totals.prefix_cache_queries += num_tokens

    def on_step_tokens(self, num_tokens: int, intervals: list[tuple[float, int]]):
        """One engine step's tokens: `num_tokens` in all, and per request that had tokens before (time since its
        previous tokens, tokens now): each token's inter-token latency is its request's interval over its count."""
        if num_tokens:
            self.generation_tokens.inc(num_tokens)
            self.totals.generation_tokens += num_tokens
        for interval_s, n in intervals:
            self.itl.observe(interval_s / n, n)

    def on_finished(self, finish_reason: str, metrics: RequestMetrics | None):
        self.request_success.labels(finished_reason=finish_reason).inc()
        if metrics is None:
            return
        t = self.totals
        if metrics.num_drafting_rounds:
            self.num_drafts.inc(metrics.num_drafting_rounds)
            self.num_draft_tokens.inc(metrics.num_draft_tokens)
            self.num_accepted_tokens.inc(metrics.num_accepted_tokens)
            self.num_verified_tokens.inc(metrics.num_verified_tokens)
            t.num_drafts += metrics.num_drafting_rounds
            t.num_draft_tokens += metrics.num_draft_tokens
            t.num_accepted_tokens += metrics.num_accepted_tokens
            t.num_verified_tokens += metrics.num_verified_tokens
            for pos, n in enumerate(metrics.accepted_per_position):
                self.accepted_per_pos.labels(position=str(pos)).inc(n)
                if pos >= len(t.accepted_per_pos):
                    t.accepted_per_pos.append(0)
                t.accepted_per_pos[pos] += n
        if self.prefix_cache_hits is not None:
            self.prefix_cache_hits.inc(metrics.num_cached_tokens)
            t.prefix_cache_hits += metrics.num_cached_tokens
        if metrics.ttft_s is not None:
            self.ttft.observe(metrics.ttft_s)
        if metrics.e2e_s is not None:
            self.e2e.observe(metrics.e2e_s)

    def set_engine_stats(self, num_running: int, num_waiting: int, kv_usage: float):
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)


@dataclass
class Totals:
    """Running totals of what the stats log reports (the Prometheus counters count the same)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verified_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def copy(self) -> "Totals":
        return Totals(**{**self.__dict__, "accepted_per_pos": list(self.accepted_per_pos)})


class StatLogger:
    """vLLM's periodic log lines: every `interval_s` while requests run or arrive, the interval's prompt and
    generation throughput, running and waiting requests, KV-cache usage and prefix-cache hit rate, and with
    speculation the acceptance of the requests that finished in it (mean acceptance length, per-position acceptance
    rate, draft acceptance rate). `maybe_log` is called by the engine thread after each iteration.

    At most one line per `interval_s`: a burst that drains sooner is logged when the engine goes idle if the last
    line is that old, else once it is (`pending_s` tells the idle engine thread when). Idle time is not part of an
    interval, so a line's throughput is over the time requests ran."""

    def __init__(self, metrics: ServerMetrics, interval_s: float = 10.0, clock=time.monotonic):
        if interval_s <= 0:
            raise ValueError(f"the stats interval must be > 0 s, got {interval_s}")
        self.metrics, self.interval_s, self.clock = metrics, interval_s, clock
        self._last_time, self._last = clock(), metrics.totals.copy()  # the window: its start (less idle time), counts
        self._last_line = -math.inf  # when the last line was logged
        self._idle_since: float | None = None  # set while the engine is idle

    def restart_window(self) -> None:
        """The engine woke from idle: the time it idled is left out of the window (what ran before it is in the
        window still, unless its line was logged)."""
        now = self.clock()
        if self._idle_since is None:
            self._last_time = now
        else:
            self._last_time += now - self._idle_since
            self._idle_since = None

    def pending_s(self) -> float | None:
        """While idle, the seconds until the drained burst's line may be logged; None when nothing waits for one."""
        cur, last = self.metrics.totals, self._last
        if self._idle_since is None or (cur.prompt_tokens, cur.generation_tokens) == (last.prompt_tokens,
                                                                                      last.generation_tokens):
            return None
        return max(0.0, self._last_line + self.interval_s - self.clock())

    def maybe_log(self, num_running: int, num_waiting: int, kv_usage: float, idle: bool = False) -> list[str]:
        """The lines logged now: none before the interval is over (when the engine just went `idle`: before
        `interval_s` has passed since the last line), or when nothing ran in it."""
        if not idle and self._idle_since is not None:
            self.restart_window()  # woken without a restart_window call (the engine process's relay)
        now = self.clock()
        if idle and self._idle_since is None:
            self._idle_since = now
        dt = (now if self._idle_since is None else self._idle_since) - self._last_time  # the time requests ran
        if dt < self.interval_s and not (idle and now - self._last_line >= self.interval_s):
            return []
        cur, last = self.metrics.totals.copy(), self._last
        prompt, generated = cur.prompt_tokens - last.prompt_tokens, cur.generation_tokens - last.generation_tokens
        if not (prompt or generated or num_running or num_waiting):
            return []
        self._last_time, self._last, self._last_line = now, cur, now
        if self._idle_since is not None:
            self._idle_since = now  # the window starts now: idle time from here on is left out of it
        dt = max(dt, 1e-9)
        line = (f"Avg prompt throughput: {prompt / dt:.1f} tokens/s, Avg generation throughput: {generated / dt:.1f} "
                f"tokens/s, Running: {num_running} reqs, Waiting: {num_waiting} reqs, KV cache usage: "
                f"{100 * kv_usage:.1f}%")
        queries = cur.prefix_cache_queries - last.prefix_cache_queries
        if self.metrics.prefix_cache_hits is not None and queries:
            line += f", Prefix cache hit rate: {100 * (cur.prefix_cache_hits - last.prefix_cache_hits) / queries:.1f}%"
        lines = [line]
        drafts = cur.num_drafts - last.num_drafts
        if drafts:
            accepted = cur.num_accepted_tokens - last.num_accepted_tokens
            drafted = cur.num_draft_tokens - last.num_draft_tokens
            per_pos = [(c - (last.accepted_per_pos[i] if i < len(last.accepted_per_pos) else 0)) / drafts
                       for i, c in enumerate(cur.accepted_per_pos)]
            verified = cur.num_verified_tokens - last.num_verified_tokens
            # vLLM's line, with the drafts verified where a confidence cutoff left some out
            cut = f"Verified: {verified} tokens, " if 0 < verified < drafted else ""
            lines.append(f"SpecDecoding metrics (requests finished in the last {dt:.0f} s): Mean acceptance length: "
                         f"{1 + accepted / drafts:.2f}, Accepted: {accepted} tokens, Drafted: {drafted} tokens, {cut}"
                         f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
                         f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%")
        for text in lines:
            logger.info("%s", text)
        return lines
