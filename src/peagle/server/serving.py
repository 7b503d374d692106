"""Serving: chat and completion requests in, engine requests through the AsyncEngine, OpenAI responses out.

Every request holds one in-flight slot from admission until its response is done (sent, failed, or its client
gone); beyond `max_in_flight` slots new requests get 503 with Retry-After. A request whose client disconnects is
aborted in the engine at once, streaming or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from typing import AsyncIterator, Awaitable, TypeVar

import jinja2
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from peagle.engine.outputs import StepOutput
from peagle.engine.sampling_params import (SamplingParams, StructuredOutputsParams, truncate_prompt,
                                           with_bad_words)
from peagle.server.async_engine import AsyncEngine, RequestFailed, RequestStream
from peagle.server.output_text import OutputText
from peagle.server.reasoning import REASONING_PARSERS, ReasoningSplitter
from peagle.server.responses import ResponsesFormat, ResponsesRequest
from peagle.server.tool_calls import ToolCall, ToolCallParser, forcing_grammar, template_supports_tools
from peagle.server.protocol import (
    ApiError, ChatCompletionRequest, ChatFormat, Choice, CompletionFormat, CompletionRequest, RequestT,
    SamplingFields, UsageInfo, parse_request,
)

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
RETRY_AFTER_S = 1
T = TypeVar("T")
Format = ChatFormat | CompletionFormat | ResponsesFormat


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class Serving:
    def __init__(self, async_engine: AsyncEngine, served_model_name: str | list[str], max_in_flight: int,
                 trust_request_chat_template: bool = False, sampling_defaults: dict | None = None,
                 reasoning_parser: str | None = None, log_requests: bool = False, max_log_len: int | None = None):
        self.engine = async_engine
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        self.tokenizer = async_engine.engine.tokenizer
        self.eos_token_ids = async_engine.engine.eos_token_ids
        self.max_model_len = async_engine.engine.max_model_len
        self.prefix_caching = async_engine.engine.config.enable_prefix_caching
        self.trust_request_chat_template = trust_request_chat_template
        self.sampling_defaults = dict(sampling_defaults or {})  # for fields a request leaves out
        self.model_names = ((served_model_name,) if isinstance(served_model_name, str)
                            else tuple(served_model_name))  # requests may name any; responses name the first
        self.model_name = self.model_names[0]
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0  # event loop only
        self.reasoning = None  # (the ReasoningParser, its end-of-thinking token id)
        if reasoning_parser is not None:
            if reasoning_parser not in REASONING_PARSERS:
                raise ValueError(f"--reasoning-parser {reasoning_parser!r}: expected one of "
                                 f"{', '.join(REASONING_PARSERS)}")
            if self.tokenizer is None:
                raise ValueError(f"--reasoning-parser {reasoning_parser}: this model has no tokenizer, so there is "
                                 f"no text to split")
            parser = REASONING_PARSERS[reasoning_parser]
            self.reasoning = parser, parser.end_token_id(self.tokenizer)

    async def chat(self, request: Request) -> Response:
        req = self._with_defaults(parse_request(await request.body(), ChatCompletionRequest))
        prompt, thinking = self._chat_inputs(req)
        fmt = ChatFormat(self.model_name, _caller_id(request, req), reasoning=self.reasoning is not None)
        return await self._generate(request, req, [prompt], fmt, tools=req.calls_tools, thinking=thinking)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: the request as a chat completion, answered as a response."""
        responses_req = parse_request(await request.body(), ResponsesRequest)
        req = self._with_defaults(responses_req.chat_request())
        prompt, thinking = self._chat_inputs(req, prompt_param="input", tokens_param="max_output_tokens")
        fmt = ResponsesFormat(self.model_name, responses_req, request.headers.get("x-request-id"))
        return await self._generate(request, req, [prompt], fmt, tools=req.calls_tools, thinking=thinking)

    def _chat_inputs(self, req: ChatCompletionRequest, prompt_param: str = "messages",
                     tokens_param: str | None = None) -> tuple["_Prompt", bool | None]:
        """The rendered prompt with its max_tokens, and whether its output begins with thinking (None without a
        reasoning parser)."""
        self.check_model(req.model)
        prompt_ids = truncate_prompt(self._chat_prompt(req), req.truncate_prompt_tokens, self.max_model_len)
        param = tokens_param or ("max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        requested = req.max_completion_tokens or req.max_tokens or self.sampling_defaults.get("max_tokens")
        max_tokens = self._max_tokens(prompt_ids, requested, prompt_param, param)
        thinking = None  # without a reasoning parser: no split
        if self.reasoning is not None:
            thinking = self.reasoning[0].thinking(req.chat_template_kwargs)
        elif not req.include_reasoning:
            raise ApiError(400, "include_reasoning: false needs a server started with --reasoning-parser (without "
                                "one, the thinking is not split from the answer)", param="include_reasoning")
        return _Prompt(prompt_ids, max_tokens), thinking

    async def completions(self, request: Request) -> Response:
        """A prompt or a batch of them: each prompt's n choices, numbered prompt by prompt (prompt_index * n + i),
        one usage for all (prompt tokens summed over the prompts)."""
        req = self._with_defaults(parse_request(await request.body(), CompletionRequest))
        self.check_model(req.model)
        requested = req.max_tokens or self.sampling_defaults.get("max_tokens", DEFAULT_COMPLETION_TOKENS)
        prompts = []
        for i, prompt in enumerate(req.prompt):
            where = "prompt" if len(req.prompt) == 1 else f"prompt[{i}]"
            ids = self._completion_prompt(prompt, req.add_special_tokens, where)
            truncated = truncate_prompt(ids, req.truncate_prompt_tokens, self.max_model_len)
            echo = None
            if req.echo:  # the prompt as the model read it
                echo = prompt if isinstance(prompt, str) and truncated is ids else self._decode(truncated)
            prompts.append(_Prompt(truncated, self._max_tokens(truncated, requested, where, "max_tokens"), echo))
        return await self._generate(request, req, prompts, CompletionFormat(self.model_name, _caller_id(request, req)))

    def _with_defaults(self, req: RequestT) -> RequestT:
        """The request with the model's sampling defaults in the fields it left out (max_tokens: see the callers)."""
        unset = {k: v for k, v in self.sampling_defaults.items() if k != "max_tokens" and k not in req.model_fields_set}
        return req.model_copy(update=unset) if unset else req

    # ---- request checks --------------------------------------------------------------------------------------

    def check_model(self, name: str | None):
        if name is not None and name not in self.model_names:
            served = " or ".join(f"'{n}'" for n in self.model_names)
            raise ApiError(404, f"the model '{name}' does not exist; this server serves {served}",
                           param="model", code="model_not_found")

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so chat messages cannot be rendered; "
                                "send token ids to /v1/completions instead", param="messages")
        tools = None
        tokenizer = self.tokenizer_for(req.chat_template)
        supported = template_supports_tools(tokenizer.chat_template)
        if req.tools:
            if not supported:
                raise ApiError(400, "this model's chat template does not render tools in the Hermes <tool_call> "
                                    "format, the one peagle parses", param="tools")
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        calls = next((i for i, m in enumerate(req.messages) if m.tool_calls), None)
        if calls is not None and not supported:
            raise ApiError(400, "this model's chat template does not render tool_calls, so the turn's calls would "
                                "be lost", param=f"messages[{calls}].tool_calls")
        return self.render_chat(req.template_messages(), req.add_generation_prompt, req.add_special_tokens, tools,
                                req.chat_template_kwargs, req.continue_final_message, tokenizer)

    def tokenizer_for(self, chat_template: str | None):
        """The tokenizer that renders a request: with the request's own template (its text, never a path on this
        machine) only when the server trusts request templates."""
        if chat_template is None:
            return self.tokenizer
        if not self.trust_request_chat_template:
            raise ApiError(400, "chat_template: this server does not render templates sent with requests "
                                "(start it with --trust-request-chat-template)", param="chat_template")
        return self.tokenizer.with_chat_template(chat_template)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    continue_final_message: bool = False, tokenizer=None) -> list[int]:
        tokenizer = tokenizer or self.tokenizer  # tokenizer_for's, for a request with its own template
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tools=tools,
                                                 **(template_kwargs or {}))
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        # The template writes the special tokens itself; add_special_tokens (vLLM's, default off) adds more.
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _completion_prompt(self, prompt: str | list[int], add_special_tokens: bool, param: str) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as a list of token ids", param=param)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

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

    @staticmethod
    def _constraint(req: SamplingFields) -> tuple[str, StructuredOutputsParams] | None:
        structured = req.structured_output()
        forced, name = req.forced_tool if isinstance(req, ChatCompletionRequest) and req.tools else (False, None)
        if not forced:
            return structured
        if structured is not None:
            raise ApiError(400, f"tool_choice forces tool calls, which {structured[0]} would constrain too: give "
                                f"one of them", param=structured[0])
        tools = [t.function.model_dump() for t in req.tools]
        return "tool_choice", StructuredOutputsParams(grammar=forcing_grammar(tools, name, req.parallel_tool_calls))

    def _sampling_params(self, req: SamplingFields, max_tokens: int, thinking: bool | None = None) -> SamplingParams:
        """With `thinking`, structured output constrains what follows the end-of-thinking token (as vLLM's)."""
        structured = self._constraint(req)
        try:
            params = SamplingParams(
                n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, max_tokens=max_tokens, min_tokens=req.min_tokens,
                stop=req.stop, stop_token_ids=req.stop_token_ids, seed=req.seed, ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens, logprobs=req.num_logprobs, logit_bias=req.logit_bias,
                allowed_token_ids=req.allowed_token_ids, structured_outputs=structured and structured[1],
                bad_words=req.bad_words or None, prompt_logprobs=req.num_prompt_logprobs,
            )
            params = with_bad_words(params, self.tokenizer, self.engine.engine.model_config.vocab_size)
        except ValueError as e:
            field = str(e).split(" ", 1)[0].rstrip(":")  # SamplingParams' messages start with the field's name
            raise ApiError(400, str(e), param=field if field in SamplingFields.model_fields else None) from None
        if structured is None:
            return params
        from peagle.engine.structured_output import with_grammar

        starts_after = self.reasoning[1] if thinking else None
        try:  # compiled here, so that a bad schema answers 400 naming the field that sent it
            return with_grammar(params, self.tokenizer, self.engine.engine.model_config.vocab_size, starts_after)
        except ValueError as e:
            raise ApiError(400, f"invalid value for '{structured[0]}': {e}", param=structured[0]) from None

    # ---- generation ------------------------------------------------------------------------------------------

    async def _generate(self, request: Request, req: SamplingFields, prompts: list["_Prompt"], fmt: Format,
                        tools: bool = False, thinking: bool | None = None) -> Response:
        """`thinking`: None without a reasoning parser, else whether the output begins with thinking."""
        first = self._sampling_params(req, prompts[0].max_tokens, thinking)  # a grammar compiled once for the batch
        params = [first] + [dataclasses.replace(first, max_tokens=p.max_tokens) for p in prompts[1:]]
        # The engine's ids stay unique when callers reuse theirs: a random tail after a caller's id.
        engine_id = fmt.id if fmt.caller_id is None else f"{fmt.id}-{uuid.uuid4().hex[:8]}"
        reasoning = None
        if thinking is not None:
            reasoning = _Reasoning(*self.reasoning, thinking, getattr(req, "include_reasoning", True))
        if self.log_requests:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                self._log_request(engine_id if len(prompts) == 1 else f"{engine_id}-{i}", prompt.ids, p)
        choices = await self._submit(engine_id, prompts, params, tools, req.prompt_logprobs, reasoning)

        def close():
            for c in choices:
                self._close(c.stream)

        if not req.stream:
            try:
                return await _unless_disconnected(request, self._collect(choices, fmt))
            finally:
                close()
        outputs = _merged([c.stream for c in choices])
        try:
            # Headers wait for the first output, so a request the engine refuses still gets a proper status.
            first = await _unless_disconnected(request, outputs.__anext__())
            _check_finish(first[1], 0)
        except BaseException:
            close()
            raise
        if isinstance(fmt, ResponsesFormat):
            events = fmt.events(choices[0], outputs, first, lambda: self._usage(choices))
        else:
            events = self._events(choices, outputs, first, fmt, req.include_usage)
        return _EventStream(events, on_close=close)

    def _log_request(self, request_id: str, ids: list[int], params: SamplingParams):
        """vLLM's request log line: the id, the prompt (its text and token ids cut to max_log_len), the parameters."""
        cut = self.max_log_len
        text = self._decode(ids if cut is None else ids[:cut])  # bounded work: tokens rarely decode to < 1 char
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s (%d tokens)", request_id,
                    text[:cut], params, ids[:cut], len(ids))

    async def _submit(self, request_id: str, prompts: list["_Prompt"], params: list[SamplingParams],
                      tools: bool = False, num_prompt_logprobs: int | None = None,
                      reasoning: "_Reasoning | None" = None) -> list["_Choice"]:
        """Every prompt's n sequences into the engine, all or none (a batch that does not fit is refused whole)."""
        children = [p.parallel_children() for p in params]
        count = sum(len(c) for c in children)
        if count > self.max_in_flight:  # could never run, however long the client waits
            raise ApiError(400, f"the request has {count} sequences (prompts x n) but this server runs at most "
                                f"{self.max_in_flight} at once (--max-num-seqs plus --max-queue)",
                           param="prompt" if len(prompts) > 1 else "n")
        if self.num_in_flight + count > self.max_in_flight:
            raise ApiError(503, f"the server is at capacity ({self.num_in_flight} requests in flight); "
                                f"retry in {RETRY_AFTER_S}s", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        choices: list[_Choice] = []
        try:
            for p, (prompt, kids) in enumerate(zip(prompts, children)):
                for i, child in enumerate(kids):
                    rid = request_id if count == 1 else (
                        f"{request_id}-{i}" if len(prompts) == 1 else f"{request_id}-{p}-{i}")
                    self.num_in_flight += 1
                    try:
                        stream = await self.engine.add_request(rid, prompt.ids, child)
                    except BaseException:
                        self.num_in_flight -= 1
                        raise
                    if i == 0:  # the prompt's first sequence computed its prompt logprobs (if asked) for all
                        prompt.logprobs = stream.prompt_logprobs
                    choices.append(_Choice(len(choices), stream, child, self.tokenizer, prompt, self.eos_token_ids,
                                           tools, first_of_prompt=i == 0, num_prompt_logprobs=num_prompt_logprobs,
                                           reasoning=reasoning))
        except BaseException as e:
            for c in choices:  # the siblings already queued
                self._close(c.stream)
            if isinstance(e, ValueError):
                raise ApiError(400, str(e)) from None
            raise
        return choices

    def _usage(self, choices: list["_Choice"]) -> UsageInfo:
        """Usage of a finished request: prompt tokens summed over its prompts (the n sequences of one prompt count it
        once), and with prefix caching those of them served from the cache (each prompt's first sequence's)."""
        firsts = [c for c in choices if c.first_of_prompt]
        cached = sum(c.num_cached_tokens for c in firsts) if self.prefix_caching else None
        return UsageInfo.of(sum(c.stream.num_prompt_tokens for c in firsts), sum(c.num_tokens for c in choices),
                            cached)

    def _close(self, stream: RequestStream):
        """Ends a request's slot; aborts it in the engine if it has not finished (its client is gone)."""
        if not stream.done:
            self.engine.abort(stream.request_id)
        self.num_in_flight -= 1

    async def _collect(self, choices: list["_Choice"], fmt: Format) -> JSONResponse:
        async for index, out in _merged([c.stream for c in choices]):
            choices[index].feed(out)
        usage = self._usage(choices)
        done = [Choice(index=c.index, text=(c.echo or "") + c.content, finish_reason=c.finish_reason,
                       stop_reason=c.stop_reason, logprobs=c.logprobs, prompt_logprobs=c.prompt_logprobs,
                       tool_calls=[t.wire() for t in c.tool_calls] or None, reasoning=c.reasoning,
                       num_reasoning_tokens=c.num_reasoning_tokens)
                for c in choices]
        body = fmt.response(done, usage)
        return JSONResponse(body if isinstance(body, dict) else body.model_dump())

    async def _events(self, choices: list["_Choice"], outputs: AsyncIterator[tuple[int, StepOutput]],
                      first: tuple[int, StepOutput], fmt: Format, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: per choice, one chunk per step that completes text, a finish chunk; then usage if
        asked, and [DONE]. The events ready together go out as one write (the head with the first text; the last
        text with the finish, usage and [DONE])."""
        events: list[str] = []
        for c in choices:
            head = fmt.head_chunk(c.index)
            if head is not None:
                events.append(_sse(head))
            if c.echo:
                events.append(_sse(fmt.chunk(c.echo, index=c.index, logprobs=c.echo_logprobs)))
        item = first
        try:
            while True:
                index, out = item
                c = choices[index]
                offset = c.echo_chars + len(c.text.text)  # text_offset counts the echoed prompt's tokens first
                delta, logprobs = c.feed(out)
                thought = c.take_reasoning()
                if delta and logprobs is None and not thought:
                    events.append(fmt.text_event(delta, index))
                elif delta or logprobs or thought:
                    extra = {"offset": offset} if isinstance(fmt, CompletionFormat) else {"reasoning": thought}
                    events.append(_sse(fmt.chunk(delta, index=index, logprobs=logprobs, **extra)))
                if out.finished and c.tool_calls:
                    tool_calls = [t.wire(i) for i, t in enumerate(c.tool_calls)]
                    events.append(_sse(fmt.chunk("", index=index, tool_calls=tool_calls)))
                if out.finished:
                    events.append(_sse(fmt.chunk("", finish_reason=c.finish_reason, index=index,
                                                 stop_reason=c.stop_reason)))
                    if all(other.stream.done for other in choices):
                        break
                if events:
                    yield "".join(events)
                    events.clear()
                try:
                    item = await outputs.__anext__()
                except StopAsyncIteration:
                    break
        except (ApiError, RequestFailed) as e:
            error = e if isinstance(e, ApiError) else ApiError(500, str(e))
            yield "".join(events) + f"data: {json.dumps(error.body())}\n\n" + "data: [DONE]\n\n"
            return
        if include_usage:
            events.append(_sse(fmt.usage_chunk(self._usage(choices))))
        yield "".join(events) + "data: [DONE]\n\n"


class _Prompt:
    """One prompt of a request: its token ids, its max_tokens, its text for `echo` (None: not echoed) and, once
    submitted with prompt logprobs asked, the engine's TokenLogprobs of its tokens after the first."""

    def __init__(self, ids: list[int], max_tokens: int, echo: str | None = None):
        self.ids = ids
        self.max_tokens = max_tokens
        self.echo = echo
        self.logprobs: list | None = None


class _Reasoning:
    """A chat request's reasoning split: the server's parser, its end-of-thinking token id, whether the output begins
    with thinking, and whether the response carries the thinking (include_reasoning)."""

    def __init__(self, parser, end_token_id: int, thinking: bool, include: bool):
        self.parser, self.end_token_id, self.thinking, self.include = parser, end_token_id, thinking, include


class _Choice:
    """One of a request's sequences (n per prompt): its engine stream, text, logprobs and why it ended; with a
    reasoning parser, the thinking apart from the answer."""

    def __init__(self, index: int, stream: RequestStream, params: SamplingParams, tokenizer, prompt: _Prompt,
                 eos_token_ids: frozenset[int], tools: bool = False, first_of_prompt: bool = True,
                 num_prompt_logprobs: int | None = None, reasoning: _Reasoning | None = None):
        self.index = index
        self.stream = stream
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.echo = prompt.echo
        self.first_of_prompt = first_of_prompt  # the sequence whose prompt tokens the usage counts
        self.text = OutputText(tokenizer, prompt.ids, params.stop, include_stop_str=params.include_stop_str_in_output,
                               skip_special_tokens=params.skip_special_tokens)
        self.num_tokens = 0
        self.num_cached_tokens = 0  # from the finished output's metrics
        self.logprobs: list | None = [] if params.logprobs is not None else None
        # echo with logprobs (OpenAI's completions): the echoed prompt's tokens lead the logprobs, the first
        # without a value; text_offset counts their text before the answer's
        self.echo_logprobs: list | None = None
        self.echo_chars = 0
        if self.echo is not None and self.logprobs is not None and prompt.logprobs is not None:
            first = (self._token_text(prompt.ids[0]), None, None)
            self.echo_logprobs = [first] + [self._text_logprobs(e) for e in prompt.logprobs]
            self.echo_chars = sum(len(t) for t, _, _ in self.echo_logprobs)
            self.logprobs = list(self.echo_logprobs)
        # vLLM's prompt_logprobs field: None for the first token, then {id: {logprob, rank, decoded_token}}
        self.prompt_logprobs: list | None = None
        if num_prompt_logprobs is not None and prompt.logprobs is not None:
            self.prompt_logprobs = [None] + [self._wire_logprobs(e, num_prompt_logprobs) for e in prompt.logprobs]
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.tool_parser = ToolCallParser() if tools else None
        self.tool_calls: list[ToolCall] = []
        self._content = ""  # the text sent as content (all of it without tools or a reasoning split)
        self.splitter: ReasoningSplitter | None = None
        self._show_reasoning = False
        self._thinking_until: int | None = None  # the end-of-thinking token id while the thinking goes on
        self.num_reasoning_tokens = 0  # output tokens up to and with the end of the thinking
        if reasoning is not None:
            self.splitter = reasoning.parser.splitter(reasoning.thinking)
            self._show_reasoning = reasoning.include
            self._thinking_until = reasoning.end_token_id if reasoning.thinking else None
        self._unsent_reasoning = ""

    @property
    def content(self) -> str:
        return self._content

    @property
    def reasoning(self) -> str | None:
        """The thinking (None without a reasoning split, when the request dropped it, or when there was none)."""
        if not self._show_reasoning or not self.splitter.reasoning:
            return None
        return self.splitter.reasoning

    def take_reasoning(self) -> str:
        """The thinking the last `feed` completed, once (empty when the request drops it)."""
        out, self._unsent_reasoning = self._unsent_reasoning, ""
        return out if self._show_reasoning else ""

    def feed(self, out: StepOutput) -> tuple[str, list | None]:
        """The text this output completes and its tokens' logprobs (None when not asked for)."""
        _check_finish(out, self.num_tokens)
        self.num_tokens += len(out.new_token_ids)
        if out.finished and out.metrics is not None:
            self.num_cached_tokens = out.metrics.num_cached_tokens
        ids = out.new_token_ids
        if self._thinking_until is not None:
            end = self._thinking_until
            self.num_reasoning_tokens += ids.index(end) + 1 if end in ids else len(ids)
            self._thinking_until = None if end in ids else end
        if out.finished and out.finish_reason == "stop" and ids and self._stop_token(ids[-1]):
            self.stop_reason = ids[-1] if ids[-1] in self.params.stop_token_ids else None
            if not self.params.include_stop_str_in_output:  # vLLM leaves the stopping token's text out
                ids = ids[:-1]
        delta = self.text.feed(ids) + (self.text.finish() if out.finished else "")
        if self.splitter is not None:  # the answer goes on; the thinking waits for take_reasoning
            thought, delta = self.splitter.feed(delta)
            if out.finished:
                rest, _ = self.splitter.finish()
                thought += rest
            self._unsent_reasoning += thought
        if self.tool_parser is not None:
            delta = self.tool_parser.feed(delta)
            if out.finished:
                rest, self.tool_calls = self.tool_parser.finish()
                delta += rest
        self._content += delta
        if out.finished:
            self.finish_reason = "tool_calls" if self.tool_calls else out.finish_reason
            if self.text.stop_string is not None:
                self.stop_reason = self.text.stop_string
        logprobs = None
        if self.logprobs is not None:
            logprobs = [self._text_logprobs(e) for e in out.logprobs or []]
            self.logprobs.extend(logprobs)
        return delta, logprobs

    def _stop_token(self, token_id: int) -> bool:
        return token_id in self.params.stop_token_ids or (
            not self.params.ignore_eos and token_id in self.eos_token_ids)

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"  # vLLM's spelling for tokens shown as ids
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _wire_logprobs(self, entry, num_top: int) -> dict[str, dict]:
        token_id, logprob, rank, top = entry
        out = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": self._token_text(token_id)}}
        for r, (t, lp) in enumerate(top[:num_top], 1):
            out.setdefault(str(t), {"logprob": lp, "rank": r, "decoded_token": self._token_text(t)})
        return out

    def _text_logprobs(self, entry):
        token_id, logprob, _, top = entry
        return (self._token_text(token_id), logprob,
                [(self._token_text(t), lp) for t, lp in top[:self.params.logprobs]])


def _check_finish(out: StepOutput, num_tokens_before: int):
    """An engine "error" finish: a refused prompt (no tokens yet, 400) or a failure mid-request (500)."""
    if out.finish_reason == "error":
        status = 400 if num_tokens_before == 0 and not out.new_token_ids else 500
        raise ApiError(status, out.error or "the engine could not run this request")


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StepOutput]]:
    """(index, output) from several request streams as their outputs arrive, each stream's in order."""
    if len(streams) == 1:  # the common case, without a task per output
        stream = streams[0]
        while not stream.done:
            yield 0, await stream.next_output()
        return
    pending = {asyncio.ensure_future(s.next_output()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                index = pending.pop(task)
                out = task.result()
                if not out.finished:
                    pending[asyncio.ensure_future(streams[index].next_output())] = index
                yield index, out
    finally:
        for task in pending:
            task.cancel()


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


def _caller_id(request: Request, req) -> str | None:
    """The caller's request id, as vLLM takes it: the body's `request_id`, else the X-Request-Id header."""
    return req.request_id or request.headers.get("x-request-id") or None
