"""`peagle serve --engine-process`: the engine in a child process serves what the engine thread serves, frees what
clients leave, and fails cleanly when the child dies or cannot start."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import httpx
import openai
import pytest
from server_fixtures import K, make_engine, make_head, metric_samples, serve, wait_until

from peagle.engine.config import EngineConfig, SpeculativeConfig
from peagle.server import create_app
from peagle.cli import build_parser
from peagle.server.engine_process import EngineProcess, EngineProcessError


@pytest.fixture(scope="module")
def target_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama", num_layers=2)


@pytest.fixture(scope="module")
def head(target_dir, tmp_path_factory):
    return make_head(target_dir, "peagle", tmp_path_factory.mktemp("head") / "peagle")


def _config(target_dir, head=None, **kw) -> EngineConfig:
    spec = None
    if head is not None:
        spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": str(head), "num_speculative_tokens": K,
                                            "parallel_drafting": True})
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("num_kv_blocks", 128)
    return EngineConfig(model=str(target_dir), device="cpu", dtype="float32", max_model_len=256, speculative=spec,
                        **kw)


def _requests(url: str) -> dict:
    """Chat, completion, streamed, logprobs and structured answers, and an engine-refused request's status."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = {}
    for i, prompt in enumerate(["Tell me a story", "What is 2 + 2?", "List three colours"]):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           temperature=0, max_tokens=24, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
        out[f"chat{i}"] = (r.choices[0].message.content, r.usage.completion_tokens,
                           [(t.token, round(t.logprob, 4)) for t in r.choices[0].logprobs.content])
    r = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=20,
                                  extra_body={"ignore_eos": True})
    out["completion"] = r.choices[0].text
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Count to ten"}],
                                            temperature=0, max_tokens=20, stream=True,
                                            extra_body={"ignore_eos": True})
    out["stream"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Give me JSON"}],
                                       temperature=0, max_tokens=24,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    out["choice"] = r.choices[0].message.content
    seeded = client.completions.create(model="tiny", prompt="Hello", temperature=1.0, seed=7, max_tokens=16,
                                       extra_body={"ignore_eos": True})
    out["seeded"] = seeded.choices[0].text
    # prompt token ids outside the vocabulary: refused by the engine's add_request (400), not by the server
    refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [10 ** 6], "max_tokens": 4})
    out["refused"] = (refused.status_code, refused.json()["error"]["type"])
    return out


@pytest.mark.parametrize("with_head", [False, True], ids=["none", "peagle"])
def test_the_engine_process_serves_what_the_engine_thread_serves(target_dir, head, with_head):
    h = head if with_head else None
    with serve(create_app(make_engine(target_dir, h, "peagle" if h else "none"), "tiny")) as url:
        expected = _requests(url)
    engine, _ = EngineProcess.start(_config(target_dir, h))
    assert engine.process.pid != os.getpid() and engine.process.is_alive()
    assert engine.k == (K if h else 0)
    app = create_app(engine, "tiny")
    with serve(app) as url:
        got = _requests(url)
        assert httpx.get(url + "/health").status_code == 200
        samples = metric_samples(httpx.get(url + "/metrics").text)
    assert got == expected
    assert expected["choice"] in ("yes", "no", "maybe")
    assert expected["refused"][0] == 400
    assert samples[("peagle_request_success_total", (("finished_reason", "length"),))] >= 6
    assert samples[("peagle_generation_tokens_total", ())] >= 6 * 16
    assert not engine.process.is_alive()  # the app's shutdown stopped the child


def test_many_clients_and_clients_that_leave_free_every_block(target_dir):
    engine, _ = EngineProcess.start(_config(target_dir, max_num_seqs=4))
    app = create_app(engine, "tiny", max_queue=64)
    with serve(app) as url:
        async def one(client: openai.AsyncOpenAI, i: int, leave: bool):
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"Question number {i}?"}], temperature=0,
                max_tokens=200 if leave else 16, stream=True, extra_body={"ignore_eos": True})
            n = 0
            async for chunk in stream:
                n += sum(1 for c in chunk.choices if c.delta.content)
                if leave and n >= 2:
                    await stream.close()  # the client goes away mid-answer
                    return None
            return n

        async def all_clients():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
                return await asyncio.gather(*(one(client, i, leave=i % 4 == 0) for i in range(16)))

        results = asyncio.run(all_clients())
        assert sum(r is None for r in results) == 4 and all(r and r > 0 for r in results if r is not None)

        def idle():
            s = app.state.async_engine.stats
            return (s.kv_blocks_used, s.num_running, s.num_waiting, app.state.serving.num_in_flight) == (0, 0, 0, 0)

        wait_until(idle, what="the engine process to free every block")
        samples = metric_samples(httpx.get(url + "/metrics").text)
        assert samples[("peagle_request_success_total", (("finished_reason", "length"),))] == 12
        assert samples[("peagle_request_success_total", (("finished_reason", "abort"),))] == 4


def test_a_dead_engine_process_fails_health_and_requests(target_dir):
    engine, _ = EngineProcess.start(_config(target_dir))
    app = create_app(engine, "tiny")
    with serve(app) as url:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert httpx.post(url + "/v1/chat/completions", json=chat).status_code == 200
        os.kill(engine.process.pid, signal.SIGKILL)
        wait_until(lambda: httpx.get(url + "/health").status_code == 503, what="/health to fail")
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code >= 500 and "engine" in r.json()["error"]["message"]


def test_an_engine_that_cannot_start_reports_the_childs_error(tmp_path, target_dir):
    # a bad model directory: the engine's own ValueError / missing file, as the engine thread would raise it
    with pytest.raises(ValueError, match="the engine process failed to start: FileNotFoundError"):
        EngineProcess.start(EngineConfig(model=str(tmp_path / "missing"), device="cpu", dtype="float32"), timeout_s=120)
    # anything else: EngineProcessError with the child's error
    config = dataclasses.replace(_config(target_dir), device="no-such-device")
    with pytest.raises(EngineProcessError, match="failed to start: RuntimeError"):
        EngineProcess.start(config, timeout_s=120)


def test_the_engine_process_is_the_default():
    args = build_parser().parse_args(["serve", "m"])
    assert (args.engine_thread, args.api_server_count) == (False, 1)
    assert build_parser().parse_args(["serve", "m", "--engine-thread"]).engine_thread is True
    assert build_parser().parse_args(["serve", "m", "--engine-process"]).engine_thread is False
