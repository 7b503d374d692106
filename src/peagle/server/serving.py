"""Serving: chat and completion requests in, engine requests through the AsyncEngine, OpenAI responses out.

Every request holds one in-flight slot from admission until its response is done (sent, failed, or its client
gone); beyond `max_in_flight` slots new requests get 503 with Retry-After. A request whose client disconnects is
aborted in the engine at once, streaming or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Awaitable, TypeVar

import jinja2
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from peagle.engine.outputs import StepOutput
from peagle.engine.sampling_params import SamplingParams
from peagle.server.async_engine import AsyncEngine, RequestFailed, RequestStream
from peagle.server.output_text import OutputText
from peagle.server.protocol import (
    ApiError, ChatCompletionRequest, ChatFormat, CompletionFormat, CompletionRequest, SamplingFields, UsageInfo,
    parse_request,
)

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
RETRY_AFTER_S = 1
T = TypeVar("T")
Format = ChatFormat | CompletionFormat


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class Serving:
    def __init__(self, async_engine: AsyncEngine, served_model_name: str, max_in_flight: int):
        self.engine = async_engine
        self.tokenizer = async_engine.engine.tokenizer
        self.max_model_len = async_engine.engine.max_model_len
        self.model_name = served_model_name
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0  # event loop only

    async def chat(self, request: Request) -> Response:
        req = parse_request(await request.body(), ChatCompletionRequest)
        self._check_model(req.model)
        prompt_ids = self._chat_prompt(req)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(prompt_ids, req.max_completion_tokens or req.max_tokens, "messages", param)
        return await self._generate(request, req, prompt_ids, max_tokens, ChatFormat(self.model_name))

    async def completions(self, request: Request) -> Response:
        req = parse_request(await request.body(), CompletionRequest)
        self._check_model(req.model)
        prompt_ids = self._completion_prompt(req)
        requested = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
        max_tokens = self._max_tokens(prompt_ids, requested, "prompt", "max_tokens")
        return await self._generate(request, req, prompt_ids, max_tokens, CompletionFormat(self.model_name))

    # ---- request checks --------------------------------------------------------------------------------------

    def _check_model(self, name: str | None):
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so chat messages cannot be rendered; "
                                "send token ids to /v1/completions instead", param="messages")
        try:
            return self.tokenizer.encode_chat(req.template_messages())
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    def _completion_prompt(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, list):
            return req.prompt
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return self.tokenizer.encode(req.prompt, add_special_tokens=True)

    def _max_tokens(self, prompt_ids: list[int], requested: int | None, prompt_param: str, param: str) -> int:
        n, limit = len(prompt_ids), self.max_model_len
        if n >= limit:
            raise ApiError(400, f"the prompt has {n} tokens but max_model_len is {limit}: at most {limit - 1} "
                                f"prompt tokens fit", param=prompt_param, code="context_length_exceeded")
        room = limit - n
        if requested is not None and requested > room:
            raise ApiError(400, f"{param} is {requested} but only {room} tokens fit after the {n}-token prompt "
                                f"(max_model_len {limit})", param=param, code="context_length_exceeded")
        return room if requested is None else requested

    # ---- generation ------------------------------------------------------------------------------------------

    async def _generate(self, request: Request, req: SamplingFields, prompt_ids: list[int], max_tokens: int,
                        fmt: Format) -> Response:
        try:
            params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                    max_tokens=max_tokens, stop=req.stop, seed=req.seed, ignore_eos=req.ignore_eos)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        stream = await self._submit(fmt.id, prompt_ids, params)
        text = OutputText(self.tokenizer, prompt_ids, params.stop)
        if not req.stream:
            try:
                return await _unless_disconnected(request, self._collect(stream, text, fmt))
            finally:
                self._close(stream)
        try:
            # Headers wait for the first output, so a request the engine refuses still gets a proper status.
            first = await _unless_disconnected(request, stream.next_output())
            _check_finish(first, 0)
        except BaseException:
            self._close(stream)
            raise
        events = self._events(stream, first, text, fmt, req.include_usage)
        return _EventStream(events, on_close=lambda: self._close(stream))

    async def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        if self.num_in_flight >= self.max_in_flight:
            raise ApiError(503, f"the server is at capacity ({self.num_in_flight} requests in flight); "
                                f"retry in {RETRY_AFTER_S}s", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_in_flight += 1
        try:
            return await self.engine.add_request(request_id, prompt_ids, params)
        except ValueError as e:
            self.num_in_flight -= 1
            raise ApiError(400, str(e)) from None
        except BaseException:
            self.num_in_flight -= 1
            raise

    def _close(self, stream: RequestStream):
        """Ends a request's slot; aborts it in the engine if it has not finished (its client is gone)."""
        if not stream.done:
            self.engine.abort(stream.request_id)
        self.num_in_flight -= 1

    async def _collect(self, stream: RequestStream, text: OutputText, fmt: Format) -> JSONResponse:
        num_tokens, last = 0, None
        async for out in stream:
            _check_finish(out, num_tokens)
            num_tokens += len(out.new_token_ids)
            text.feed(out.new_token_ids)
            last = out
        text.finish()
        usage = UsageInfo.of(stream.num_prompt_tokens, num_tokens)
        return JSONResponse(fmt.response(text.text, last.finish_reason, usage).model_dump())

    async def _events(self, stream: RequestStream, out: StepOutput, text: OutputText, fmt: Format,
                      include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per step that completes text, a finish chunk, usage if asked, [DONE]."""
        head = fmt.head_chunk()
        if head is not None:
            yield _sse(head)
        num_tokens = 0
        try:
            while True:
                _check_finish(out, num_tokens)
                num_tokens += len(out.new_token_ids)
                delta = text.feed(out.new_token_ids) + (text.finish() if out.finished else "")
                if delta:
                    yield _sse(fmt.chunk(delta))
                if out.finished:
                    break
                out = await stream.next_output()
        except (ApiError, RequestFailed) as e:
            error = e if isinstance(e, ApiError) else ApiError(500, str(e))
            yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        yield _sse(fmt.chunk("", finish_reason=out.finish_reason))
        if include_usage:
            yield _sse(fmt.usage_chunk(UsageInfo.of(stream.num_prompt_tokens, num_tokens)))
        yield "data: [DONE]\n\n"


def _check_finish(out: StepOutput, num_tokens_before: int):
    """An engine "error" finish: a refused prompt (no tokens yet, 400) or a failure mid-request (500)."""
    if out.finish_reason == "error":
        status = 400 if num_tokens_before == 0 and not out.new_token_ids else 500
        raise ApiError(status, out.error or "the engine could not run this request")


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, or raises ClientGone (cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself is being cancelled
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone()


async def _disconnected(request: Request):
    # The body has been read, so the next message the server delivers is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends: completed, failed, client gone."""

    def __init__(self, events: AsyncIterator[str], on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
