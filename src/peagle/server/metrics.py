"""Prometheus metrics under `peagle_` and under vLLM's own `vllm:` names, in a registry owned by one server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from peagle.engine.outputs import RequestMetrics

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


class ServerMetrics:
    """Counters, histograms and gauges of one server. Thread-safe (prometheus-client locks each metric).

    Every metric exists twice: `peagle_<name>` and vLLM's `vllm:<name>` (labelled with `model_name`). The speculative
    counters mirror vLLM's `spec_decode_*`: drafting rounds, proposed draft tokens, accepted draft tokens and
    accepted tokens per draft position, so acceptance length = 1 + accepted / drafts.
    """

    def __init__(self, num_speculative_tokens: int = 0, model_name: str = "", prefix_caching: bool = False):
        self.registry = CollectorRegistry(auto_describe=True)

        def twin(kind, name, doc, labels=(), **kw):
            return _Twin(kind, name, doc, self.registry, model_name, labels, **kw)

        self.num_drafts = twin(Counter, "spec_decode_num_drafts", "Drafting rounds verified.")
        self.num_draft_tokens = twin(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = twin(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = twin(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position (0 = first draft).",
                                     ("position",))
        self.prompt_tokens = twin(Counter, "prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = twin(Counter, "generation_tokens", "Tokens generated.")
        self.request_success = twin(Counter, "request_success", "Finished requests by finish reason.",
                                    ("finished_reason",))
        self.ttft = twin(Histogram, "time_to_first_token_seconds", "Time from arrival to the first output token.",
                         buckets=TTFT_BUCKETS)
        self.itl = twin(Histogram, "inter_token_latency_seconds",
                        "Time per output token after the first (a step's interval shared by its tokens).",
                        buckets=ITL_BUCKETS)
        self.e2e = twin(Histogram, "e2e_request_latency_seconds", "Time from arrival to the last output token.",
                        buckets=E2E_BUCKETS)
        self.num_running = twin(Gauge, "num_requests_running", "Requests in the running batch.")
        self.num_waiting = twin(Gauge, "num_requests_waiting", "Requests waiting for admission.")
        self.kv_usage = twin(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        # vLLM's prefix-cache counters (tokens), with --enable-prefix-caching only: hit rate = hits / queries.
        self.prefix_cache_queries = self.prefix_cache_hits = None
        if prefix_caching:
            self.prefix_cache_queries = twin(Counter, "prefix_cache_queries", "Prompt tokens looked up in the "
                                                                              "prefix cache.")
            self.prefix_cache_hits = twin(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # Label values known up front are created now, so that a scrape before any traffic shows zeros.
        for pos in range(num_speculative_tokens):
            self.accepted_per_pos.labels(position=str(pos))
        for reason in ("stop", "length"):
            self.request_success.labels(finished_reason=reason)

    def on_tokens(self, num_tokens: int, interval_s: float | None):
        """One step's tokens for one request; `interval_s` is the time since its previous tokens (None: first)."""
        self.generation_tokens.inc(num_tokens)
        if interval_s is not None:
            for _ in range(num_tokens):
                self.itl.observe(interval_s / num_tokens)

    def on_finished(self, finish_reason: str, metrics: RequestMetrics | None):
        self.request_success.labels(finished_reason=finish_reason).inc()
        if metrics is None:
            return
        if metrics.num_drafting_rounds:
            self.num_drafts.inc(metrics.num_drafting_rounds)
            self.num_draft_tokens.inc(metrics.num_draft_tokens)
            self.num_accepted_tokens.inc(metrics.num_accepted_tokens)
            for pos, n in enumerate(metrics.accepted_per_position):
                self.accepted_per_pos.labels(position=str(pos)).inc(n)
        if self.prefix_cache_hits is not None:
            self.prefix_cache_hits.inc(metrics.num_cached_tokens)
        if metrics.ttft_s is not None:
            self.ttft.observe(metrics.ttft_s)
        if metrics.e2e_s is not None:
            self.e2e.observe(metrics.e2e_s)

    def set_engine_stats(self, num_running: int, num_waiting: int, kv_usage: float):
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
