"""The server runner against a small fake OpenAI-compatible server (real uvicorn on 127.0.0.1)."""

import asyncio
import json
import socket
import threading
import time

import pytest

from peagle.datasets import Prompt
from peagle.bench.http_runner import HttpRunner, counter_delta, read_spec_counters
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
