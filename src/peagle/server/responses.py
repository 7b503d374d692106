"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it, over the chat machinery.

A request's `instructions` and `input` (a string, or items: messages, function calls, their outputs, earlier
reasoning) become chat messages; its tools, tool_choice and text.format become the chat request's tools,
tool_choice and response_format; it then runs as a chat completion and is answered as a response: output items
(a reasoning item with a reasoning parser, the message, function calls), usage in input/output tokens, and, streamed,
the Responses events (response.created ... response.completed, each with its sequence number).

Nothing is stored: `store` true, `previous_response_id`, `include`, `background`, `reasoning` effort, `top_logprobs`
and `truncation: "auto"` are refused naming the field, as are input item and content kinds other than text.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from peagle.server.async_engine import RequestFailed
from peagle.server.protocol import ApiError, ChatCompletionRequest, UsageInfo, _Request, field_error

_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesTextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema: a text format of type json_schema takes a schema, and only it does")
        return self


class ResponsesText(_Request):
    format: ResponsesTextFormat = ResponsesTextFormat()


class ResponsesFunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponsesToolChoice(_Request):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: Literal[False] | None = None  # nothing is kept: a response cannot be read back or continued
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    service_tier: Literal["auto", "default"] | None = None

    @field_validator("include")
    @classmethod
    def _nothing_extra(cls, include):
        if include:
            raise ValueError(f"include: {include} is not supported (nothing beyond the output is returned)")
        return include

    @field_validator("input")
    @classmethod
    def _some_input(cls, value):
        if not value:
            raise ValueError("input must not be empty")
        return value

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (ApiError naming the Responses field that does not convert)."""
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        for name in ("temperature", "top_p", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, ResponsesToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            error = field_error(e.errors()[0])
            param = "input" if (error.param or "").startswith("messages") else error.param
            raise ApiError(400, error.message, param=param) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        thinking: str | None = None  # an earlier reasoning item, for the assistant turn after it
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            where = f"input[{i}]"
            if kind == "message":
                message = {"role": item.get("role"), "content": _text(item.get("content"), where)}
                if message["role"] == "assistant" and thinking is not None:
                    message["reasoning"], thinking = thinking, None
                messages.append(message)
            elif kind == "function_call":
                call = {"id": _field(item, "call_id", where), "type": "function", "function": {
                    "name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and thinking is None:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
                    if thinking is not None:
                        turn["reasoning"], thinking = thinking, None
                    messages.append(turn)
            elif kind == "function_call_output":
                output = _field(item, "output", where)
                messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                                 "content": output if isinstance(output, str) else _text(output, where)})
            elif kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                thinking = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            else:
                raise ApiError(400, f"{where}.type: input items of type {kind!r} are not supported (message, "
                                    f"function_call, function_call_output, reasoning)", param=f"{where}.type")
        return messages


def _field(item: dict, name: str, where: str):
    if item.get(name) is None:
        raise ApiError(400, f"{where}.{name} is required for an item of type {item.get('type')!r}",
                       param=f"{where}.{name}")
    return item[name]


def _text(content, where: str) -> str:
    """A message's content: a string, or text parts joined; other parts (images, files) refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{j}]: content parts of type {kind!r} are not supported (text "
                                f"only)", param=f"{where}.content[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat:
    """Builds a response body and its stream's events for one request."""

    def __init__(self, model: str, request: ResponsesRequest, request_id: str | None = None):
        self.caller_id = request_id or None
        self.id = f"resp_{request_id}" if request_id else _id("resp")
        self.model = model
        self.request = request
        self.created = int(time.time())
        self._sequence = 0

    # ---- the whole response ----------------------------------------------------------------------------------

    def response(self, choices, usage: UsageInfo | None, status: str = "completed", output: list | None = None,
                 num_reasoning_tokens: int = 0) -> dict[str, Any]:
        """The response object: finished from `choices` (one Choice), or `status` with the `output` so far."""
        incomplete = None
        if choices:
            c = choices[0]
            output = self.output_items(c.reasoning, c.text, c.tool_calls or [])
            status = "incomplete" if c.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
            num_reasoning_tokens = c.num_reasoning_tokens
        r = self.request
        tools = [t.model_dump(exclude_none=True) for t in r.tools or []]
        tool_choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, ResponsesToolChoice) else (
            r.tool_choice or "auto")
        fmt = (r.text.format if r.text else ResponsesTextFormat()).model_dump(by_alias=True, exclude_none=True)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": incomplete, "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": self.model, "output": output or [], "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": r.temperature, "text": {"format": fmt}, "tool_choice": tool_choice, "tools": tools,
            "top_p": r.top_p, "truncation": "disabled", "user": r.user, "metadata": r.metadata or {},
            "usage": None if usage is None else _usage(usage, num_reasoning_tokens),
        }

    @staticmethod
    def output_items(reasoning: str | None, text: str, tool_calls: list[dict], ids: dict | None = None) -> list:
        ids = ids or {}
        items = []
        if reasoning:
            items.append(_reasoning_item(ids.get("reasoning") or _id("rs"), reasoning, "completed"))
        if text or not tool_calls:
            items.append(_message_item(ids.get("message") or _id("msg"), text, "completed"))
        for call in tool_calls:
            items.append(_call_item(call, "completed"))
        return items

    # ---- the stream ------------------------------------------------------------------------------------------

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self, choice, outputs: AsyncIterator, first, usage_of) -> AsyncIterator[str]:
        """The Responses events of one choice's outputs (`first`, then `outputs`), closing with response.completed
        (or response.incomplete when max_output_tokens cut it) that carries `usage_of()`."""
        ids = {"reasoning": _id("rs"), "message": _id("msg")}
        items: list[dict] = []  # finished output items, in order
        open_kind = None  # "reasoning" or "message": the item whose deltas are streaming
        texts = {"reasoning": "", "message": ""}
        events = [self.event("response.created", response=self.response(None, None, "in_progress")),
                  self.event("response.in_progress", response=self.response(None, None, "in_progress"))]

        def part(kind: str, text: str) -> dict:
            if kind == "reasoning":
                return {"type": "reasoning_text", "text": text}
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

        def open_item(kind: str):
            nonlocal open_kind
            index = len(items)
            item = (_reasoning_item(ids[kind], "", "in_progress") if kind == "reasoning"
                    else _message_item(ids[kind], "", "in_progress"))
            if kind == "message":
                item["content"] = []
            events.append(self.event("response.output_item.added", output_index=index, item=item))
            events.append(self.event("response.content_part.added", output_index=index, item_id=ids[kind],
                                     content_index=0, part=part(kind, "")))
            open_kind = kind

        def close_item():
            nonlocal open_kind
            kind, text, index = open_kind, texts[open_kind], len(items)
            done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(self.event(done, output_index=index, item_id=ids[kind], content_index=0, text=text,
                                     **extra))
            events.append(self.event("response.content_part.done", output_index=index, item_id=ids[kind],
                                     content_index=0, part=part(kind, text)))
            item = (_reasoning_item(ids[kind], text, "completed") if kind == "reasoning"
                    else _message_item(ids[kind], text, "completed"))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
            items.append(item)
            open_kind = None

        def delta(kind: str, text: str):
            if not text:
                return
            if open_kind != kind:
                if open_kind is not None:
                    close_item()
                open_item(kind)
            texts[kind] += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(self.event(name, output_index=len(items), item_id=ids[kind], content_index=0,
                                     delta=text, **extra))

        item = first
        try:
            while True:
                _, out = item
                text, _ = choice.feed(out)  # ApiError for an engine error
                delta("reasoning", choice.take_reasoning())
                delta("message", text)
                if out.finished:
                    break
                if events:
                    yield "".join(events)
                    events.clear()
                item = await outputs.__anext__()
        except (ApiError, RequestFailed) as e:
            error = e if isinstance(e, ApiError) else ApiError(500, str(e))
            events.append(self.event("error", code=error.code or error.type, message=error.message,
                                     param=error.param))
            yield "".join(events)
            return
        if open_kind is not None:
            close_item()
        if not any(i["type"] == "message" for i in items) and not choice.tool_calls:
            open_item("message")  # an empty answer is still a message
            close_item()
        for call in choice.tool_calls:
            wire = call.wire()
            index = len(items)
            fc_id = _id("fc")
            added = {**_call_item(wire, "in_progress"), "id": fc_id, "arguments": ""}
            events.append(self.event("response.output_item.added", output_index=index, item=added))
            events.append(self.event("response.function_call_arguments.delta", output_index=index, item_id=fc_id,
                                     delta=wire["function"]["arguments"]))
            events.append(self.event("response.function_call_arguments.done", output_index=index, item_id=fc_id,
                                     arguments=wire["function"]["arguments"], name=wire["function"]["name"]))
            done = {**_call_item(wire, "completed"), "id": fc_id}
            events.append(self.event("response.output_item.done", output_index=index, item=done))
            items.append(done)
        incomplete = choice.finish_reason == "length"
        body = self.response(None, usage_of(), "incomplete" if incomplete else "completed", items,
                             choice.num_reasoning_tokens)
        if incomplete:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        events.append(self.event("response.incomplete" if incomplete else "response.completed", response=body))
        yield "".join(events)


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict, status: str) -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def _usage(usage: UsageInfo, num_reasoning_tokens: int) -> dict:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": num_reasoning_tokens},
            "total_tokens": usage.total_tokens}
