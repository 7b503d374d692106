"""Many clients at once, clients that leave, a full queue and a failing engine step: nothing is lost or leaked."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from server_fixtures import StepControl, make_engine, metric_samples, serve, wait_until

from peagle.server import create_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def target_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama", num_layers=4)


@pytest.fixture(scope="module")
def slow_engine(target_dir):
    """Two slots and a step slowed to 20 ms, so requests stay in flight long enough to act on them."""
    engine = make_engine(target_dir, max_num_seqs=2)
    return engine, StepControl(engine, delay_s=0.02)


def _idle(app) -> bool:
    stats = app.state.async_engine.stats
    return (stats.kv_blocks_used, stats.num_running, stats.num_waiting, app.state.serving.num_in_flight) == (0, 0, 0, 0)


def _counter(url: str, name: str, **labels) -> float:
    return metric_samples(httpx.get(url + "/metrics").text).get((name, tuple(sorted(labels.items()))), 0.0)


def test_32_concurrent_streaming_clients_complete(target_dir):
    engine = make_engine(target_dir, max_num_seqs=8)
    app = create_app(engine, "tiny")
    with serve(app) as url:
        async def one(client: openai.AsyncOpenAI, i: int):
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Question number {i}?"}], temperature=0,
                max_tokens=16, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            reasons, usage = [], None
            async for chunk in stream:
                reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
                usage = chunk.usage or usage
            return reasons, usage

        async def all_clients():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
                return await asyncio.gather(*(one(client, i) for i in range(32)))

        results = asyncio.run(all_clients())
        assert len(results) == 32
        for reasons, usage in results:
            assert reasons == ["length"] and usage.completion_tokens == 16
        assert _counter(url, "peagle_request_success_total", finished_reason="length") == 32
        wait_until(lambda: _idle(app), what="the server to go idle")


def test_disconnect_mid_stream_frees_blocks(slow_engine):
    engine, _ = slow_engine
    app = create_app(engine, "tiny")
    with serve(app) as url:
        body = {**CHAT, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            data = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
            assert data and app.state.async_engine.stats.kv_blocks_used > 0
        wait_until(lambda: _idle(app), what="the aborted request's blocks to be freed")
        assert _counter(url, "peagle_request_success_total", finished_reason="abort") == 1
        assert _counter(url, "peagle_generation_tokens_total") < 200  # aborted, not run to the end
        out = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3}, timeout=30).json()
        assert out["usage"]["completion_tokens"] == 3


def test_disconnect_while_waiting_for_a_non_streamed_answer(slow_engine):
    engine, _ = slow_engine
    app = create_app(engine, "tiny")
    with serve(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 200}, timeout=0.5)
        wait_until(lambda: _idle(app), what="the abandoned request's blocks to be freed")
        assert _counter(url, "peagle_request_success_total", finished_reason="abort") == 1


def test_full_queue_answers_503_with_retry_after(slow_engine):
    engine, control = slow_engine
    app = create_app(engine, "tiny", max_queue=1)  # 2 slots + 1 waiting = 3 requests in flight at most
    with serve(app) as url:
        answers = []

        def request():
            answers.append(httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=30))

        control.gate.clear()  # hold the engine so the first three stay in flight
        try:
            threads = [threading.Thread(target=request) for _ in range(3)]
            for t in threads:
                t.start()
            wait_until(lambda: app.state.serving.num_in_flight == 3, what="three requests in flight")
            refused = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=30)
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "server_overloaded"
            with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
                with pytest.raises(openai.APIStatusError) as e:
                    client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
                assert e.value.status_code == 503
        finally:
            control.gate.set()
        for t in threads:
            t.join(30)
        assert [a.status_code for a in answers] == [200, 200, 200]
        wait_until(lambda: _idle(app), what="the server to go idle")
        assert httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=30).status_code == 200


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(slow_engine):
    engine, control = slow_engine
    app = create_app(engine, "tiny")
    with serve(app) as url:
        answers = []
        plain = threading.Thread(target=lambda: answers.append(
            httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 200}, timeout=30)))
        body = {**CHAT, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data:")
            plain.start()
            wait_until(lambda: app.state.async_engine.stats.num_running == 2, what="both requests running")
            control.fail_next.set()
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
        plain.join(30)

        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "injected step failure" in error["message"]
        assert answers[0].status_code == 500 and "injected step failure" in answers[0].json()["error"]["message"]
        wait_until(lambda: _idle(app), what="the failed requests' blocks to be freed")
        out = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3}, timeout=30)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3


def test_a_stopped_engine_loop_fails_health_and_requests_cleanly(slow_engine):
    engine, _ = slow_engine
    app = create_app(engine, "tiny")
    with serve(app) as url:
        assert httpx.get(url + "/health").status_code == 200
        app.state.async_engine.shutdown()
        assert httpx.get(url + "/health").status_code == 503
        response = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=30)
        assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
        assert app.state.serving.num_in_flight == 0
