"""The OpenAI wire format: request models (validated, naming the bad field), response and chunk models, errors.

Requests are parsed from the raw body here rather than by FastAPI so that every mistake answers 400 with an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}` instead of FastAPI's 422 detail list.
Unknown fields are ignored, as OpenAI-compatible servers do, so clients sending options peagle lacks still work.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ApiError(Exception):
    """An error answered to the client as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- requests ------------------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        # Many clients send `"temperature": null` for "not given"; the default then applies.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """The sampling options both endpoints share. Extensions beyond OpenAI's (top_k, ignore_eos) are vLLM's."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    stop: list[str] = []
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of them")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content):
        # OpenAI also sends content as a list of parts; text parts are joined, other kinds are refused.
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
        ):
            return "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError("content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts")
        return content


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


class CompletionRequest(SamplingFields):
    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, prompt):
        # OpenAI takes a string, token ids, or a batch of either; a batch must hold exactly one prompt here.
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a token-id prompt must be a list of integers")
        if not isinstance(prompt, (str, list)):
            raise ValueError("prompt must be a string or a list of token ids")
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt


RequestT = TypeVar("RequestT", bound=_Request)


def parse_request(raw: bytes, model: type[RequestT]) -> RequestT:
    """The request from a raw JSON body; ApiError(400) naming the first invalid field."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param_name(err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"invalid value for '{param}': {message}", param=param) from None


def _param_name(loc: tuple) -> str:
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else str(part)
    return name


# ---- responses -----------------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # only the keys this chunk carries: role on the first, content after
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "peagle"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- the two endpoints' shapes -------------------------------------------------------------------------------


class ChatFormat:
    """Builds /v1/chat/completions bodies and stream chunks for one request."""

    def __init__(self, model: str):
        self.id = new_id("chatcmpl")
        self.model = model
        self.created = int(time.time())

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def head_chunk(self) -> ChatCompletionChunk | None:
        return self._chunk([ChatChunkChoice(delta={"role": "assistant", "content": ""})])

    def chunk(self, text: str, finish_reason: str | None = None) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(delta={"content": text} if text else {}, finish_reason=finish_reason)])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, text: str, finish_reason: str | None, usage: UsageInfo) -> ChatCompletionResponse:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                      usage=usage)


class CompletionFormat:
    """Builds /v1/completions bodies and stream chunks for one request."""

    def __init__(self, model: str):
        self.id = new_id("cmpl")
        self.model = model
        self.created = int(time.time())

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def head_chunk(self) -> CompletionResponse | None:
        return None

    def chunk(self, text: str, finish_reason: str | None = None) -> CompletionResponse:
        return self._body([CompletionChoice(text=text, finish_reason=finish_reason)])

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self._body([], usage)

    def response(self, text: str, finish_reason: str | None, usage: UsageInfo) -> CompletionResponse:
        return self._body([CompletionChoice(text=text, finish_reason=finish_reason)], usage)
