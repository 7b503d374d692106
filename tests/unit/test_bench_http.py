"""The server runner against a small fake OpenAI-compatible server (real uvicorn on 127.0.0.1)."""

import asyncio
import json
import socket
import threading
import time

import pytest

from peagle.datasets import Prompt
from peagle.bench.http_runner import (HttpRunner, client_processes_for, counter_delta, read_spec_counters,
                                     stream_shares)
from peagle.bench.measurement import SpecCounts

METRICS_TEXT = """\
# HELP peagle_spec_decode_num_drafts_total Drafting rounds.
# TYPE peagle_spec_decode_num_drafts_total counter
peagle_spec_decode_num_drafts_total{model_name="m"} 10.0
# HELP peagle_spec_decode_num_draft_tokens_total Draft tokens.
# TYPE peagle_spec_decode_num_draft_tokens_total counter
peagle_spec_decode_num_draft_tokens_total{model_name="m"} 30.0
# HELP peagle_spec_decode_num_accepted_tokens_total Accepted draft tokens.
# TYPE peagle_spec_decode_num_accepted_tokens_total counter
peagle_spec_decode_num_accepted_tokens_total{model_name="m"} 17.0
# HELP peagle_spec_decode_num_accepted_tokens_per_pos_total Accepted per position.
# TYPE peagle_spec_decode_num_accepted_tokens_per_pos_total counter
peagle_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 8.0
peagle_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 3.0
peagle_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 6.0
# HELP other_requests_total Something else.
# TYPE other_requests_total counter
other_requests_total 99.0
"""


def test_read_spec_counters_and_delta():
    counts = read_spec_counters(METRICS_TEXT)
    # a server without the verified counter verified every drafted token
    assert counts == SpecCounts(rounds=10, drafted=30, accepted=17, accepted_per_position=[8, 6, 3], verified=30)
    assert read_spec_counters("") == SpecCounts()
    delta = counter_delta(SpecCounts(rounds=4, drafted=12, accepted=5, accepted_per_position=[3, 2], verified=12),
                          counts)
    assert delta == SpecCounts(rounds=6, drafted=18, accepted=12, accepted_per_position=[5, 4, 3], verified=18)
    cut = read_spec_counters(METRICS_TEXT + "peagle_spec_decode_num_verified_tokens_total 21.0\n")
    assert (cut.drafted, cut.verified) == (30, 21)


TOKENS_PER_CHUNK, CHUNKS, ACCEPTED_PER_ROUND = 2, 3, 1


def fake_server_app():
    """Streams CHUNKS chunks of TOKENS_PER_CHUNK tokens; each chunk is one round accepting ACCEPTED_PER_ROUND."""
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse, StreamingResponse

    app = FastAPI()
    state = {"rounds": 0, "accepted": 0, "requests": []}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# TYPE peagle_spec_decode_num_drafts_total counter\n"
            f"peagle_spec_decode_num_drafts_total {state['rounds']}\n"
            "# TYPE peagle_spec_decode_num_draft_tokens_total counter\n"
            f"peagle_spec_decode_num_draft_tokens_total {3 * state['rounds']}\n"
            "# TYPE peagle_spec_decode_num_accepted_tokens_total counter\n"
            f"peagle_spec_decode_num_accepted_tokens_total {state['accepted']}\n")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state["requests"].append(body)
        if body["messages"][-1]["content"] == "fail":
            return PlainTextResponse("bad request", status_code=400)
        if body["messages"][-1]["content"] == "down":
            return PlainTextResponse("engine down", status_code=500)
        if body["messages"][-1]["content"] == "garbled" and body["max_tokens"] > 16:  # the timed requests only
            return StreamingResponse(iter(["data: {not json\n\n"]), media_type="text/event-stream")

        async def events():
            chunks = min(CHUNKS, body["max_tokens"])
            for _ in range(chunks):
                await asyncio.sleep(0.002)
                state["rounds"] += 1
                state["accepted"] += ACCEPTED_PER_ROUND
                delta = {"choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None}]}
                yield f"data: {json.dumps(delta)}\n\n"
            usage = {"prompt_tokens": 5, "completion_tokens": chunks * TOKENS_PER_CHUNK, "total_tokens": 0}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, state


@pytest.fixture
def fake_server():
    import uvicorn

    app, state = fake_server_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_http_runner_measures_streams_and_counter_deltas(fake_server):
    url, state = fake_server
    prompts = [Prompt.user(f"p{i}", f"question {i}") for i in range(4)] + [Prompt.user("bad", "fail")]
    m = HttpRunner(url, max_tokens=64).measure(prompts, 2)
    assert m.num_prompts == 4 and m.num_failed == 1
    assert m.output_tokens == 4 * CHUNKS * TOKENS_PER_CHUNK
    # Warm-up requests (2, before the counters are first read) must not leak into the acceptance numbers.
    assert m.acceptance_length == pytest.approx(1 + ACCEPTED_PER_ROUND)
    assert m.draft_acceptance_rate == pytest.approx(1 / 3)
    assert m.ttft_p50_ms > 0 and m.itl_p50_ms > 0
    assert 0 < m.client_cpu_per_s < 4  # the client's own CPU s/s, beside its rows
    # Warm-up: the first 2 prompts at once, then all 5 staggered (8 + i mod 2 tokens), then the point.
    warmup, staggered, measured = state["requests"][:2], state["requests"][2:7], state["requests"][7:]
    assert all(r["max_tokens"] == 8 for r in warmup) and all(r["max_tokens"] == 64 for r in measured)
    assert sorted(r["max_tokens"] for r in staggered) == [8, 8, 8, 9, 9] and len(measured) == 5
    assert all(r["model"] == "fake-model" and r["stream"] and r["temperature"] == 0.0 for r in measured)


def test_client_processes_auto_and_shares(monkeypatch):
    monkeypatch.setattr("peagle.bench.http_runner._cpus", lambda: 16)
    assert [client_processes_for("auto", c) for c in (1, 8, 16, 17, 32, 64, 1024)] == [1, 1, 1, 2, 2, 4, 8]
    monkeypatch.setattr("peagle.bench.http_runner._cpus", lambda: 1)
    assert client_processes_for("auto", 64) == 1
    assert client_processes_for(3, 64) == 3 and client_processes_for(8, 2) == 2  # never more than the streams
    assert stream_shares(5, 2) == [3, 2] and stream_shares(64, 4) == [16] * 4
    with pytest.raises(ValueError, match="at least 1"):
        HttpRunner("http://127.0.0.1:1", max_tokens=8, client_processes=0)


def test_client_processes_split_the_point_and_merge_it(fake_server):
    url, state = fake_server
    prompts = [Prompt.user(f"p{i}", f"question {i}") for i in range(8)]
    m = HttpRunner(url, max_tokens=64, client_processes=2).measure(prompts, 4)
    assert m.client_processes == 2
    assert m.num_prompts == 8 and m.num_failed == 0
    assert m.output_tokens == 8 * CHUNKS * TOKENS_PER_CHUNK
    assert m.acceptance_length == pytest.approx(1 + ACCEPTED_PER_ROUND)  # the parent's counters, warm-up left out
    assert m.ttft_p50_ms > 0 and m.itl_p50_ms > 0 and m.wall_s > 0
    assert 0 < m.client_cpu_per_process_max <= m.client_cpu_per_s
    # Warm-up: the first wave (4 at 8 tokens), all 8 staggered (8 + i mod 4), then every planned prompt once.
    measured = [r for r in state["requests"] if r["max_tokens"] == 64]
    assert len(state["requests"]) == 4 + 8 + 8
    assert sorted(r["messages"][-1]["content"] for r in measured) == sorted(p.messages[-1]["content"] for p in prompts)
    warmup = sorted(r["max_tokens"] for r in state["requests"] if r["max_tokens"] != 64)
    assert warmup == [8] * 4 + [8, 8, 9, 9, 10, 10, 11, 11]
    assert all(r["model"] == "fake-model" and r["stream"] for r in measured)


def test_client_processes_count_failed_requests(fake_server):
    url, _ = fake_server
    prompts = [Prompt.user(f"p{i}", "down") for i in range(4)]
    m = HttpRunner(url, max_tokens=64, client_processes=2).measure(prompts, 2)
    assert (m.num_prompts, m.num_failed, m.output_tokens) == (0, 4, 0)


def _measure_in_thread(runner, prompts, concurrency):
    """runner.measure in a thread: (finished, result or exception); a hang shows as not finished."""
    out = {}

    def target():
        try:
            out["result"] = runner.measure(prompts, concurrency)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=120)
    return not thread.is_alive(), out


def test_a_failing_client_process_fails_the_point(fake_server):
    url, _ = fake_server
    prompts = [Prompt.user("p0", "question 0"), Prompt.user("p1", "garbled")] * 2  # process 2 streams garbage
    finished, out = _measure_in_thread(HttpRunner(url, max_tokens=64, client_processes=2), prompts, 2)
    assert finished, "the point hung on a failed client process"
    error = out.get("error")
    assert isinstance(error, RuntimeError), out
    assert "bench client process 2 of 2 failed" in str(error) and "JSONDecodeError" in str(error)


def test_an_unreachable_server_fails_the_point():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    finished, out = _measure_in_thread(HttpRunner(f"http://127.0.0.1:{port}", max_tokens=8, client_processes=2,
                                                  timeout_s=5), [Prompt.user("p", "q")] * 4, 4)
    assert finished and "ConnectError" in type(out.get("error")).__name__ + str(out.get("error")), out


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_client_processes_are_refused_by_name(value, capsys):
    from peagle.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--url", "http://x", "--methods", "peagle", "--client-processes", value])
    err = capsys.readouterr().err
    assert "--client-processes" in err and "integer >= 1" in err


def test_client_processes_reach_the_runner_and_results_config():
    from peagle.bench.cli import sweep_config_from_args
    from peagle.bench.sweep import SweepConfig, open_http_runner
    from peagle.cli import build_parser

    def config(*extra):
        return sweep_config_from_args(build_parser().parse_args(
            ["bench", "--url", "http://127.0.0.1:1", "--methods", "peagle", "--k", "7", *extra]))

    assert config().client_processes == "auto" and config().to_json()["client_processes"] == "auto"
    two = config("--client-processes", "2")
    assert json.loads(json.dumps(two.to_json()))["client_processes"] == 2
    with open_http_runner(two, "peagle", 7) as runner:
        assert runner.client_processes == 2
    with pytest.raises(ValueError, match="client_processes"):
        SweepConfig(url="http://x", methods=("peagle",), ks=(7,), client_processes=0)


def test_the_table_marks_a_point_by_its_busiest_client_process():
    from peagle.bench.measurement import Measurement
    from peagle.bench.report import _full_table, make_point

    def point(k, total, busiest):
        m = Measurement(num_prompts=64, num_failed=0, output_tokens=6400, wall_s=1.0, tokens_per_s=6400.0,
                        acceptance_length=2.0, per_position_acceptance=[0.5], draft_acceptance_rate=0.5,
                        ttft_p50_ms=1.0, ttft_p99_ms=2.0, itl_p50_ms=1.0, itl_p99_ms=2.0, client_cpu_per_s=total,
                        client_cpu_per_process_max=busiest, client_processes=4)
        return make_point("humaneval", "peagle", k, 64, m)

    points = [point(5, 2.4, 0.6), point(7, 2.4, 0.95)]  # four processes: a sum over 1 is not client-bound
    assert points[0]["client_processes"] == 4 and points[0]["client_cpu_per_process_max"] == 0.6
    rows = [r for r in _full_table(points, "humaneval") if r.startswith("| P-EAGLE")]
    assert rows[0].endswith("| 6400 (2.00) |") and rows[1].endswith("| 6400 (2.00) c |")
    old = {key: v for key, v in point(7, 0.95, 0.95).items() if key != "client_cpu_per_process_max"}
    assert [r for r in _full_table([points[0], old], "humaneval") if r.startswith("| P-EAGLE")][1].endswith(" c |")
