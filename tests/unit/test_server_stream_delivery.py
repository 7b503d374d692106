"""How step outputs reach a response: outputs that queue up while the event loop is busy are taken as one (one chunk,
one socket write), and `--stream-interval N` (vLLM's) holds a request's tokens until N have gathered, its first
output and its last never held. Text, logprobs and finish reasons come out the same either way."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_fixtures import make_engine, serve

from peagle.engine.outputs import RequestMetrics, StepOutput
from peagle.server import create_app
from peagle.server.async_engine import AsyncEngine, RequestFailed, RequestStream


def _out(ids, finished=False, logprobs=None, reason=None):
    return StepOutput("r", list(ids), finished, reason, logprobs=logprobs,
                      metrics=RequestMetrics(num_output_tokens=9) if finished else None)


def test_queued_outputs_are_taken_as_one_and_a_failure_after_them_still_arrives():
    async def scenario():
        stream = RequestStream("r", 3, asyncio.get_running_loop())
        stream.put(_out([1, 2]))
        stream.put(_out([3], logprobs=["a"]))
        stream.put(_out([4, 5], logprobs=["b", "c"]))
        first = await stream.next_output()
        assert (first.new_token_ids, first.logprobs, first.finished) == ([1, 2, 3, 4, 5], ["a", "b", "c"], False)

        waiting = asyncio.ensure_future(stream.next_output())  # nothing queued: it waits for the next delivery
        await asyncio.sleep(0)
        assert not waiting.done()
        stream.put(_out([6]))
        stream.put(RequestFailed("boom"))
        assert (await waiting).new_token_ids == [6]  # the outputs before a failure are not lost in it
        with pytest.raises(RequestFailed):
            await stream.next_output()
        assert stream.done

        ended = RequestStream("r", 3, asyncio.get_running_loop())
        ended.put(_out([7]))
        ended.put(_out([8], finished=True, reason="length"))
        last = await ended.next_output()
        assert (last.new_token_ids, last.finished, last.finish_reason, last.logprobs) == ([7, 8], True, "length", None)
        assert last.metrics.num_output_tokens == 9 and ended.done

    asyncio.run(scenario())


class _OneTokenEngine:
    """Each step gives every request its next token; request "r" ends after `length` tokens. With `empty_first`, the
    first step's output holds no token."""

    def __init__(self, length: int, empty_first: bool = False):
        self.length, self.emitted, self.empty_first = length, 0, empty_first
        self.config = type("C", (), {"enable_prefix_caching": False})()
        self.k = 0

    def stats(self):
        from peagle.engine.llm_engine import EngineStats
        return EngineStats(1, 0, 1, 10)

    def step(self):
        if self.empty_first:
            self.empty_first = False
            return [_out([])]
        self.emitted += 1
        return [_out([self.emitted], finished=self.emitted == self.length, reason="length")]


@pytest.mark.parametrize("empty_first", [False, True])
def test_stream_interval_holds_tokens_until_enough_gathered(empty_first):
    engine = _OneTokenEngine(length=8, empty_first=empty_first)
    async_engine = AsyncEngine(engine, stream_interval=3)
    delivered = []

    class Loop:  # records what the engine thread hands to the event loop, step by step
        def call_soon_threadsafe(self, fn, deliveries):
            delivered.append([out.new_token_ids for _, out in deliveries])

    async_engine._loop = Loop()
    stream = RequestStream.__new__(RequestStream)
    stream.request_id, stream.last_token_time, stream.held, stream.sent_any = "r", None, None, False
    async_engine._streams["r"] = stream
    for _ in range(8 + empty_first):
        async_engine._step()
    # the first token at once (an output without tokens before it does not count); then three at a time; the end
    # flushes what is held
    assert delivered == [[[]]] * empty_first + [[[1]], [[2, 3, 4]], [[5, 6, 7]], [[8]]]
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncEngine(engine, stream_interval=0)


@pytest.fixture(scope="module")
def target_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama", num_layers=4)


def _stream_chunks(url: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def test_a_server_with_a_stream_interval_sends_the_same_text_in_fewer_chunks(target_dir):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    with serve(create_app(make_engine(target_dir), "tiny")) as every, \
            serve(create_app(make_engine(target_dir), "tiny", stream_interval=5)) as held:
        want = httpx.post(every + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        for url, most_chunks in ((every, 24), (held, 1 + 23 // 5 + 1)):
            chunks = _stream_chunks(url, body)
            assert "".join(c["choices"][0]["text"] for c in chunks) == want["text"]
            tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
            assert tokens == want["logprobs"]["tokens"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert len(chunks) <= most_chunks + 1  # + the finish chunk
        assert len(_stream_chunks(held, body)) < len(_stream_chunks(every, body))


def test_text_events_are_the_chunks_pydantic_renders():
    from peagle.server.protocol import ChatFormat, CompletionFormat

    for fmt in (ChatFormat("m"), ChatFormat("m", "caller-id", reasoning=True), CompletionFormat("m")):
        for text in ["Hello", 'a "quote" and a \\ backslash', "controls \x00\x1f\n\t", "é 中文 \u2028 😀", "</script>"]:
            for index in (0, 3):
                assert fmt.text_event(text, index) == f"data: {fmt.chunk(text, index=index).model_dump_json()}\n\n"
