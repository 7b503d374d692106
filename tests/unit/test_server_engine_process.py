"""`peagle serve --engine-process`: the engine in a child process serves what the engine thread serves, frees what
clients leave, and fails cleanly when the child dies or cannot start."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

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


# ---- faults, with the stand-in engine (peagle.server.stand_in) ------------------------------------------------------

_LAUNCH = """
import sys
from peagle.cli import build_parser
from peagle.server.launcher import launch
from peagle.server.stand_in import StandInConfig, StandInEngine
tokenizer, step_s = sys.argv[1], float(sys.argv[2])
args = build_parser().parse_args(["--log-level", "warning", "serve", "stand-in", "--disable-uvicorn-access-log",
                                  *sys.argv[3:]])
sys.exit(launch(args, StandInConfig(tokenizer=tokenizer, step_s=step_s, tokens_per_step=1),
                engine_factory=StandInEngine))
"""


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama", num_layers=2)


@contextmanager
def launched(tokenizer_dir, *options: str, step_s: float = 0.01):
    """`peagle serve`'s launcher over the stand-in engine in a subprocess; yields (process, base URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, str(tokenizer_dir), str(step_s), "--port", str(port),
                             *options])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or _up(url), what="the server to start", timeout_s=120)
        assert proc.poll() is None, "the server exited while starting"
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _children(pid: int) -> list[int]:
    """The processes `multiprocessing` spawned from `pid` (the engine, the API servers), not its resource tracker."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        kids += [int(k) for k in open(f"/proc/{pid}/task/{task}/children").read().split()]
    return [k for k in kids if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]


def _stream(url: str, max_tokens: int, out: list, i: int):
    """A streaming chat request run in a thread: its SSE lines land in out[i]."""
    body = {"model": "stand-in", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    lines = out[i] = []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            lines.append(r.status_code)
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    except httpx.HTTPError as e:
        lines.append(type(e).__name__)


def _streams(url: str, n: int, max_tokens: int) -> tuple[list[threading.Thread], list]:
    out: list = [None] * n
    threads = [threading.Thread(target=_stream, args=(url, max_tokens, out, i), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    wait_until(lambda: all(o is not None and len(o) >= 3 for o in out), what="every stream's first tokens")
    return threads, out


def test_a_killed_engine_process_ends_every_stream_with_an_error_and_the_server_exits_1(tokenizer_dir):
    with launched(tokenizer_dir) as (proc, url):
        threads, out = _streams(url, 4, max_tokens=60_000)
        engine, = _children(proc.pid)
        os.kill(engine, signal.SIGKILL)
        for t in threads:  # 60,000 tokens a stream: only the kill ends them within these joins
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        for lines in out:
            assert lines[0] == 200 and lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2][len("data: "):])["error"]
            assert error["type"] == "server_error" and "engine process ended" in error["message"]
        assert proc.wait(30) == 1


def test_sigterm_drains_the_requests_in_flight_then_exits_0(tokenizer_dir):
    with launched(tokenizer_dir, "--shutdown-timeout", "20") as (proc, url):
        engine, = _children(proc.pid)
        threads, out = _streams(url, 3, max_tokens=100)  # about a second each
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        for lines in out:  # every answer whole
            usage = json.loads(lines[-2][len("data: "):])["usage"]
            assert lines[-1] == "data: [DONE]" and usage["completion_tokens"] == 100
        assert proc.wait(30) == 0
        wait_until(lambda: not os.path.exists(f"/proc/{engine}") or b"Z" in open(f"/proc/{engine}/stat", "rb")
                   .read().split(b")")[1][:3], what="the engine process to exit")


def test_sigterm_cuts_what_outlasts_the_shutdown_timeout(tokenizer_dir):
    with launched(tokenizer_dir, "--shutdown-timeout", "1") as (proc, url):
        threads, out = _streams(url, 2, max_tokens=60_000)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # the streams would run for minutes: only the cut lets it exit within the wait
        for t in threads:
            t.join(10)
        assert all("data: [DONE]" not in lines for lines in out)  # cut off, not finished


def test_two_api_servers_share_the_engine_and_agree_on_metrics(tokenizer_dir):
    with launched(tokenizer_dir, "--api-server-count", "2") as (proc, url):
        assert len(_children(proc.pid)) == 3  # the engine and two API servers
        chat = {"model": "stand-in", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}
        for _ in range(8):  # new connections: either server may take each
            with httpx.Client() as client:
                assert client.post(url + "/v1/chat/completions", json=chat).json()["usage"]["completion_tokens"] == 5
        scrapes = []
        for _ in range(6):
            with httpx.Client() as client:
                samples = metric_samples(client.get(url + "/metrics").text)
            scrapes.append((samples[("peagle_request_success_total", (("finished_reason", "length"),))],
                            samples[("peagle_generation_tokens_total", ())],
                            samples[("vllm:generation_tokens_total", (("model_name", "stand-in"),))]))
        assert set(scrapes) == {(8, 40, 40)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_clients_that_leave_are_aborted_in_the_engine_process_and_free_their_blocks(tokenizer_dir):
    from peagle.server.stand_in import StandInConfig, StandInEngine

    engine, _ = EngineProcess.start(StandInConfig(tokenizer=str(tokenizer_dir), step_s=0.005, tokens_per_step=1),
                                    engine_factory=StandInEngine)
    app = create_app(engine, "m")
    with serve(app) as url:
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60_000, "stream": True}
        for _ in range(6):
            with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
                next(r.iter_lines())  # one chunk, then the client goes
        wait_until(lambda: app.state.async_engine.stats.num_running == 0, what="the aborts to reach the engine")
        assert app.state.async_engine.stats.kv_blocks_used == 0 and app.state.serving.num_in_flight == 0
        samples = metric_samples(httpx.get(url + "/metrics").text)
        assert samples[("peagle_request_success_total", (("finished_reason", "abort"),))] == 6


def test_garbage_never_reaches_the_engine(tokenizer_dir):
    from peagle.server.stand_in import StandInConfig, StandInEngine

    engine = StandInEngine(StandInConfig(tokenizer=str(tokenizer_dir)))
    app = create_app(engine, "m", max_request_bytes=4096)
    with serve(app) as url:
        post = url + "/v1/chat/completions"
        assert httpx.post(post, content=b"{not json").status_code == 400
        assert httpx.post(post, content=b"\xff\xfe").status_code == 400
        assert httpx.post(post, json=[1, 2]).status_code == 400
        assert httpx.post(post, json={"model": "m", "messages": "hello"}).status_code == 400
        assert httpx.post(post, json={"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": "many"}).status_code == 400
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 10_000}]}
        r = httpx.post(post, json=big)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        chunked = httpx.post(post, content=iter([b'{"model": "m", "messages": [', b" " * 8192, b"]}"]))
        assert chunked.status_code == 413
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mo")
        assert httpx.get(url + "/health").status_code == 200
        assert engine.num_added == 0
        ok = httpx.post(post, json={"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert ok.status_code == 200 and engine.num_added == 1


def test_a_server_that_is_behind_gets_the_steps_outputs_joined(tokenizer_dir):
    from peagle.engine.sampling_params import SamplingParams
    from peagle.server import engine_wire as wire
    from peagle.server.engine_process import EngineLoop
    from peagle.server.stand_in import StandInConfig, StandInEngine

    engine = StandInEngine(StandInConfig(tokenizer=str(tokenizer_dir), step_s=0.001, tokens_per_step=1))
    ours, theirs = socket.socketpair()
    loop = threading.Thread(target=EngineLoop(engine, [theirs]).run, daemon=True)
    loop.start()
    n, max_tokens = 64, 300
    for i in range(n):
        ours.sendall(wire.command_frame(("add", f"r{i}", [1, 2, 3], SamplingParams(max_tokens=max_tokens), None)))
    time.sleep(1.0)  # the server is busy elsewhere: the engine steps on, and the kernel's queue fills
    frames, messages, tokens = wire.FrameBuffer(), [], {}
    ours.settimeout(30)
    while sum(len(t) for t in tokens.values()) < n * max_tokens:
        for payload in frames.feed(ours.recv(1 << 20)):
            message = wire.decode_engine_message(payload)
            messages.append(message)
            for out in getattr(message, "outputs", []):
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    steps = [m for m in messages if isinstance(m, wire.Step)]
    assert len(steps) < max_tokens // 2  # one message a step would be 300
    assert all(tokens[f"r{i}"] == engine.text_ids[:max_tokens] for i in range(n))  # every token, in order
    ours.close()
    loop.join(10)
    assert not loop.is_alive()  # the engine loop ends when its last server's socket closes


def test_decoded_engine_messages_are_not_tracked_by_the_garbage_collector():
    """A server decodes thousands of engine messages a second: none of their structs counts toward (or is walked by)
    Python's cyclic collections."""
    import gc

    from peagle.engine.stats import EngineStats
    from peagle.server import engine_wire as wire

    step = wire.Step([wire.Output("r1", [1, 2, 3]), wire.Output("r2", [4], True, "length", None, wire.Metrics(1, 7))],
                     EngineStats(2, 0, 3, 10))
    frames = wire.FrameBuffer().feed(wire.engine_frame(step))
    decoded = wire.decode_engine_message(frames[0])
    assert decoded == step
    assert not any(gc.is_tracked(s) for s in (decoded, *decoded.outputs, decoded.outputs[1].metrics))


def test_serving_processes_freeze_their_startup_heap_and_thaw_it_at_exit():
    """After start-up a serving process's objects are out of the cyclic collector's reach; at exit they are back in
    it, so the interpreter's last collection frees them (no extension module reports leaks)."""
    code = ("import atexit, gc\n"
            "from peagle.server.engine_process import freeze_startup_heap\n"
            "atexit.register(lambda: print('frozen at exit', gc.get_freeze_count()))  # runs after the thaw\n"
            "held = [[i] for i in range(1000)]\n"
            "freeze_startup_heap()\n"
            "assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "frozen at exit 0", done.stdout
