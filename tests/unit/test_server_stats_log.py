"""vLLM's periodic stats lines: the interval's throughput, load and speculative acceptance, from the same counts the
Prometheus metrics take; and the server logging them while it serves."""

from __future__ import annotations

import logging
import queue

import httpx
import pytest
from server_fixtures import make_engine, make_head, serve

from peagle.engine.outputs import RequestMetrics
from peagle.server import create_app
from peagle.server.metrics import ServerMetrics, StatLogger


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def finished(rounds=10, drafted=30, accepted=15, per_pos=(8, 5, 2), cached=40):
    return RequestMetrics(num_drafting_rounds=rounds, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                          accepted_per_position=list(per_pos), num_cached_tokens=cached)


def test_a_line_reports_the_interval_only():
    metrics, clock = ServerMetrics(3, "m", prefix_caching=True), Clock()
    log = StatLogger(metrics, interval_s=10.0, clock=clock)
    metrics.on_prompt(100)
    metrics.on_step_tokens(50, [])
    metrics.on_finished("stop", finished())
    clock.now += 9.0
    assert log.maybe_log(2, 1, 0.25) == []  # before the interval is over
    clock.now += 1.0
    general, spec = log.maybe_log(2, 1, 0.25)
    assert general == ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 2 "
                       "reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 40.0%")
    assert "Mean acceptance length: 2.50" in spec and "Accepted: 15 tokens, Drafted: 30 tokens" in spec
    assert "Per-position acceptance rate: 0.800, 0.500, 0.200" in spec and "Avg Draft acceptance rate: 50.0%" in spec
    # the next interval counts only what came after: 20 tokens in 10 s, no request finished (no acceptance line)
    metrics.on_step_tokens(20, [(0.1, 20)])
    clock.now += 10.0
    lines = log.maybe_log(1, 0, 0.1)
    assert len(lines) == 1 and "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.0" in lines[0]
    clock.now += 10.0
    assert log.maybe_log(0, 0, 0.0) == []  # nothing ran: no line


def test_verified_drafts_are_counted_and_logged_where_a_cutoff_left_some_out():
    metrics, clock = ServerMetrics(3, "m"), Clock()
    log = StatLogger(metrics, interval_s=10.0, clock=clock)
    metrics.on_step_tokens(50, [])
    cut = finished()
    cut.num_verified_tokens = 18  # 30 drafted, 18 verified, 15 accepted
    metrics.on_finished("stop", cut)
    text = metrics.render().decode()
    assert 'peagle_spec_decode_num_verified_tokens_total 18.0' in text
    assert 'vllm:spec_decode_num_verified_tokens_total{model_name="m"} 18.0' in text
    clock.now += 10.0
    _, spec = log.maybe_log(1, 0, 0.1)
    assert "Accepted: 15 tokens, Drafted: 30 tokens, Verified: 18 tokens, Per-position" in spec
    uncut = finished()
    uncut.num_verified_tokens = 30
    metrics.on_finished("stop", uncut)
    clock.now += 10.0
    assert "Verified" not in log.maybe_log(1, 0, 0.1)[1]  # vLLM's line as it is without a cutoff


def test_a_drained_burst_is_logged_at_once_and_idle_time_is_not_counted():
    metrics, clock = ServerMetrics(0, "m"), Clock()
    log = StatLogger(metrics, interval_s=10.0, clock=clock)
    metrics.on_prompt(10)
    metrics.on_step_tokens(40, [])
    clock.now += 2.0
    lines = log.maybe_log(0, 0, 0.0, idle=True)  # the engine went idle 2 s into the interval
    assert len(lines) == 1 and "Avg generation throughput: 20.0 tokens/s" in lines[0]
    assert "Prefix cache" not in lines[0]  # not counted without prefix caching
    clock.now += 300.0  # idle, then a request wakes the engine
    log.restart_window()
    metrics.on_step_tokens(30, [])
    clock.now += 10.0
    assert "Avg generation throughput: 3.0 tokens/s" in log.maybe_log(1, 0, 0.0)[0]
    with pytest.raises(ValueError, match="interval"):
        StatLogger(metrics, interval_s=0)


def test_short_bursts_log_at_most_one_line_per_interval():
    # A request every 3 s, each done in 1 s: the engine goes idle after each. One line per 10 s, not one per burst;
    # the burst held back is logged once 10 s have passed since the last line, over the time requests ran.
    metrics, clock = ServerMetrics(0, "m"), Clock()
    log = StatLogger(metrics, interval_s=10.0, clock=clock)
    times = []
    for _ in range(7):
        log.restart_window()  # a request wakes the engine
        metrics.on_step_tokens(10, [])
        clock.now += 1.0
        if log.maybe_log(0, 0, 0.0, idle=True):
            times.append(clock.now)
        assert log.pending_s() == (None if times[-1] == clock.now else times[-1] + 10.0 - clock.now)
        clock.now += 2.0
    assert times == [101.0, 113.0]  # and not 101, 104, 107, ...
    clock.now = times[-1] + 9.0  # idle since 119: the burst that drained then waits until 123
    assert log.pending_s() == 1.0
    assert log.maybe_log(0, 0, 0.0, idle=True) == []
    clock.now += 1.0
    assert log.pending_s() == 0.0
    lines = log.maybe_log(0, 0, 0.0, idle=True)
    assert len(lines) == 1 and "Avg generation throughput: 10.0 tokens/s" in lines[0]  # 20 tokens in 2 s of work
    assert log.pending_s() is None
    clock.now += 50.0
    log.restart_window()
    metrics.on_step_tokens(50, [])
    clock.now += 10.0
    assert "Avg generation throughput: 5.0 tokens/s" in log.maybe_log(1, 0, 0.0)[0]  # idle time is not counted


def test_the_idle_engine_thread_logs_a_held_back_line_when_it_is_due(caplog):
    class Engine:
        k, config = 0, type("Config", (), {"enable_prefix_caching": False})

        def stats(self):
            return type("Stats", (), {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0})

        def has_unfinished_requests(self):
            return False

    class Commands:  # the engine thread's queue: nothing comes while a timed wait runs, then a command does
        def __init__(self):
            self.timeouts = []

        def get(self, timeout=None):
            self.timeouts.append(timeout)
            if timeout is None:
                return "command"
            clock.now += timeout
            raise queue.Empty

    from peagle.server.async_engine import AsyncEngine

    metrics, clock = ServerMetrics(0, "m"), Clock()
    engine = AsyncEngine(Engine(), metrics=metrics, log_stats_interval_s=10.0)
    engine.stat_logger = log = StatLogger(metrics, interval_s=10.0, clock=clock)
    engine._commands = commands = Commands()
    caplog.set_level(logging.INFO, logger="peagle.server.stats")
    for tokens in (10, 30):  # two bursts of 1 s, 2 s apart: the second drains too soon after the first's line
        log.restart_window()
        metrics.on_step_tokens(tokens, [])
        clock.now += 1.0
        engine._publish_stats()
        clock.now += 2.0
    assert len(caplog.records) == 1
    assert engine._next_command_when_idle() == "command"
    assert commands.timeouts == [5.0, None]  # waited until 10 s after the first line, then for the next command
    assert len(caplog.records) == 2 and "Avg generation throughput: 30.0 tokens/s" in caplog.records[1].message
    no_logger = AsyncEngine(Engine(), metrics=ServerMetrics(0, "m"))
    no_logger._commands = commands = Commands()
    assert no_logger._next_command_when_idle() == "command" and commands.timeouts == [None]


def test_the_server_logs_stats_while_it_serves(tiny_hf_checkpoint, tmp_path, caplog):
    target = tiny_hf_checkpoint("llama", num_layers=4)
    engine = make_engine(target, make_head(target, "peagle", tmp_path / "head"), "peagle")
    caplog.set_level(logging.INFO, logger="peagle.server.stats")
    with serve(create_app(engine, "tiny", log_stats_interval_s=0.01)) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "The quick brown fox",
                                                      "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
    text = "\n".join(m for name, _, m in caplog.record_tuples if name == "peagle.server.stats")
    assert "Avg generation throughput" in text and "Mean acceptance length" in text


def test_stats_lines_are_off_unless_asked(tiny_hf_checkpoint):
    engine = make_engine(tiny_hf_checkpoint("llama", num_layers=4))
    assert create_app(engine, "tiny").state.async_engine.stat_logger is None


def test_a_steps_inter_token_latencies_export_as_prometheus_own_histogram_would():
    # A step's tokens share their request's interval: observed once with a count, exported under both names with the
    # same samples as prometheus-client's Histogram observing each token.
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from peagle.server.metrics import ITL_BUCKETS

    registry = CollectorRegistry()
    reference = Histogram("peagle_inter_token_latency_seconds", "x", buckets=ITL_BUCKETS, registry=registry)
    for value in (0.002, 0.002, 0.01, 0.01, 0.01, 7.0, 0.0, 0.0025):
        reference.observe(value)
    metrics = ServerMetrics(0, "tiny")
    metrics.on_step_tokens(8, [(0.004, 2), (0.03, 3), (7.0, 1), (0.0, 1), (0.0025, 1)])

    def samples(text: bytes, name: str) -> list[str]:
        return [line for line in text.decode().splitlines() if line.startswith(name) and "_created" not in line]

    want = samples(generate_latest(registry), "peagle_inter_token_latency_seconds_")
    assert samples(metrics.render(), "peagle_inter_token_latency_seconds_") == want
    theirs = samples(metrics.render(), "vllm:inter_token_latency_seconds_")
    assert len(theirs) == len(want) and all('model_name="tiny"' in line for line in theirs)
    assert 'vllm:inter_token_latency_seconds_count{model_name="tiny"} 8.0' in theirs
