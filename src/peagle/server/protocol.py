"""The OpenAI wire format: request models (validated, naming the bad field), response and chunk models, errors.

Requests are parsed from the raw body here rather than by FastAPI so that every mistake answers 400 with an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}` instead of FastAPI's 422 detail list.
No field is ever accepted and ignored: a field of OpenAI's or vLLM's API that peagle does not implement answers 400
naming it, unless its value is the one that changes nothing (`tools: []`, `response_format: {"type": "text"}`,
`echo: false`, `best_of` equal to `n`, ...); unknown fields answer 400 too.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, TypeVar

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from peagle.engine.sampling_params import MAX_LOGPROBS, StructuredOutputsParams


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

# Fields of OpenAI's and vLLM's request bodies that peagle does not implement, with the values that change nothing
# (answered as if absent). Any other value answers 400 naming the field.
_NO_OP_VALUES: dict[str, tuple] = {
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False), "functions": ([],),
    "echo": (False,), "suffix": ("",), "logprobs": (False,),
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "bad_words": ([],),
    "spaces_between_special_tokens": (True,), "priority": (0,),
    "store": (False,), "modalities": (["text"],), "service_tier": ("auto", "default"), "logits_processors": ([],),
    "structural_tag": (), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
}
_NOT_SUPPORTED_WHY = {
    "tools": "tools belong to /v1/chat/completions", "tool_choice": "tools belong to /v1/chat/completions",
    "functions": "function calling is not supported", "function_call": "function calling is not supported",
    "guided_decoding_backend": "peagle has one structured-output backend (llguidance)",
    "guided_whitespace_pattern": "JSON is written with ', ' and ': ' separators and no other whitespace",
    "structural_tag": "structural tags are not supported",
    "best_of": "best_of > n is not supported", "use_beam_search": "beam search is not supported",
    "suffix": "suffix (insertion) is not supported",
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        # Many clients send `"temperature": null` for "not given"; the default then applies. A no-op value of a
        # field peagle lacks is "not given" too.
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None and not (k not in cls.model_fields and v in _NO_OP_VALUES.get(k, ()))}


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: response_format type json_schema takes a json_schema, and only it does")
        return self


class SamplingFields(_Request):
    """The sampling options both endpoints share. Extensions beyond OpenAI's (top_k, min_p, min_tokens, ...) are
    vLLM's extra parameters, with vLLM's meanings. Each endpoint's request spells logprobs its own way and says
    what it asked for as `num_logprobs` (top alternatives per token, None for none)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = Field(1, ge=1, le=16)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # vLLM's: keep only the prompt's last k tokens (left truncation); -1: the last max_model_len
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    bad_words: list[str] | None = None  # vLLM's: words the output never completes
    # vLLM's: each prompt token's logprob (after the first) with this many alternatives, as `prompt_logprobs`
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    user: str | None = None  # an end-user id for the caller's own records; it changes no output
    # vLLM's: the response's id is "chatcmpl-<request_id>" / "cmpl-<request_id>" (else the X-Request-Id header's)
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # Structured output (OpenAI's response_format, vLLM's guided_* and structured_outputs); at most one.
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the response needs (None: no prompt logprobs)."""
        return self.prompt_logprobs

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not sent in streamed responses; ask without stream")
        return self

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_keeps_a_token(cls, k):
        if k == 0:
            raise ValueError("truncate_prompt_tokens must be >= 1 (keep the prompt's last k tokens) or -1 (its last "
                             "max_model_len)")
        return k

    def structured_output(self) -> tuple[str, StructuredOutputsParams] | None:
        """(the field that asked, its constraint), or None; ApiError(400) naming the field if it is malformed."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            given.append(("response_format", {"json": rf.json_schema.schema_} if rf.json_schema else
                          {"json_object": True}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs))
        if not given:
            return None
        if len(given) > 1:
            names = [n for n, _ in given]
            raise ApiError(400, f"give one structured-output constraint, not {names}", param=names[1])
        name, value = given[0]
        try:
            return name, StructuredOutputsParams.of(value)
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"invalid value for '{name}': {e}", param=name) from None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of them")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias):
        if bias and any(not -100 <= v <= 100 for v in bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return bias

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: best_of > n is not supported (best_of must equal n)")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CalledFunction(_Request):
    name: str
    arguments: str  # JSON text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments must be JSON text: {e}") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object")
        return arguments


class MessageToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None  # passed to the chat template, which decides what it means
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # an assistant turn's thinking, as responses with a reasoning parser carry it (either name); to the template
    reasoning: str | None = None
    reasoning_content: str | None = None

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

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: content is required (only an assistant turn with tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant turns carry tool_calls")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only tool turns carry tool_call_id")
        for name in ("reasoning", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"{name}: only assistant turns carry {name}")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning_content: reasoning and reasoning_content are one field: give one of them")
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates read it (tool-call arguments as objects)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:  # Qwen3's templates read reasoning_content
            out["reasoning_content"] = out["reasoning"] = reasoning
        return out


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # forced calls always follow the schema


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


# Names the server passes to a chat template itself; chat_template_kwargs may not set them.
TEMPLATE_OWN_NAMES = ("messages", "add_generation_prompt", "continue_final_message", "tools", "documents")


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    taken = sorted(set(kwargs or ()) & set(TEMPLATE_OWN_NAMES))
    if taken:
        raise ValueError(f"chat_template_kwargs: {', '.join(taken)} are set by the request's own fields")
    return kwargs


def _check_continue(req) -> None:
    if req.continue_final_message and req.add_generation_prompt:
        raise ValueError("continue_final_message: continue_final_message and add_generation_prompt cannot both be "
                         "true (send add_generation_prompt: false to continue the last message)")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's: further variables for the chat template (e.g. {"enable_thinking": false} for Qwen3's)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the last message (an assistant turn begun) is left open for the model to continue
    continue_final_message: bool = False
    chat_template: str | None = None  # vLLM's: the request's own template, with --trust-request-chat-template only
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: false drops the thinking a reasoning parser splits off

    @model_validator(mode="after")
    def _template_kwargs(self):
        _check_template_kwargs(self.chat_template_kwargs)
        _check_continue(self)
        return self

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: tool_choice other than 'none' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names:
            raise ValueError(f"tool_choice: '{choice.function.name}' is not one of the tools {self.tool_names}")
        return self

    @property
    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    @property
    def calls_tools(self) -> bool:
        """Whether the output is parsed for tool calls (tools given and tool_choice not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> tuple[bool, str | None]:
        """(calls are forced, the function they must call or None for any)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function.name
        return self.tool_choice == "required", None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]


class CompletionRequest(SamplingFields):
    # OpenAI's prompt: a string, token ids, or a batch of either; kept as the batch (a lone prompt is a batch of one)
    prompt: list[str | list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the response needs: `prompt_logprobs`'s, or with `echo`, `logprobs`'s (the
        echoed prompt's tokens get logprobs too, as OpenAI's API gives them)."""
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(wanted) if wanted else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_batch(cls, prompt):
        # Choices of a batch are numbered prompt by prompt: choice prompt_index * n + i (OpenAI's, vLLM's order).
        if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or
                                                    all(isinstance(p, list) for p in prompt)):
            batch, name = prompt, "prompt[{}]"
        elif isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("a batch of prompts must hold only strings or only lists of token ids")
        else:
            batch, name = [prompt], "prompt"
        for i, one in enumerate(batch):
            where = name.format(i)
            if isinstance(one, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in one):
                raise ValueError(f"{where}: a token-id prompt must be a list of integers")
            if not isinstance(one, (str, list)):
                raise ValueError(f"{where}: a prompt must be a string or a list of token ids")
            if not one:
                raise ValueError(f"{where}: the prompt is empty")
        return batch


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        if self.chat_template_kwargs is not None and self.messages is None:
            raise ValueError("chat_template_kwargs: only with messages")
        _check_template_kwargs(self.chat_template_kwargs)
        _check_continue(self)
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


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
        raise field_error(e.errors()[0]) from None


def field_error(err: dict) -> ApiError:
    param = _param_name(err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        name = param.rsplit(".", 1)[-1]
        why = _NOT_SUPPORTED_WHY.get(name, "peagle does not implement it")
        return ApiError(400, f"'{param}' is not supported: {why}", param=param, code="unsupported_parameter")
    # A validator that names a field of its own ("best_of: ...") answers for that field.
    head, sep, rest = message.partition(": ")
    if sep and head.isidentifier() and err["type"] == "value_error" and head != param.rsplit(".", 1)[-1]:
        param = _param_name((*err["loc"], head)) if err["loc"] else head
        message = rest
    return ApiError(400, f"invalid value for '{param}': {message}", param=param)


def _param_name(loc: tuple) -> str:
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else str(part)
    return name


# ---- responses -----------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with prefix caching: tokens served from the cache

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> "UsageInfo":
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] = []
    reasoning: str | None = None  # vLLM's, with a reasoning parser: the thinking before the answer
    reasoning_content: str | None = None  # the same, by the name vLLM used before and many clients read


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class PromptLogprob(BaseModel):
    """vLLM's Logprob in a response's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the echoed prompt's first token (nothing before it to predict it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended the choice


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, with prompt_logprobs


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]  # only the keys this chunk carries: role on the first, then reasoning, content, tool_calls
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, with prompt_logprobs


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

# Token logprobs as the engine reports them, with each token's text: [(text, logprob, [(text, logprob)] top)].
TextLogprobs = list[tuple[str, float, list[tuple[str, float]]]]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


_TEXT = "peagle-text-slot"  # stands for a chunk's text in TextEvents' templates


class TextEvents:
    """The SSE events of stream chunks that carry only text (the common one, a chunk per step): the format's own
    chunk, rendered by pydantic once per choice index with a placeholder, then the text encoded by msgspec into it,
    so that each chunk costs one string encoding rather than building and dumping pydantic models."""

    def __init__(self, fmt):
        self._fmt = fmt
        self._templates: dict[int, tuple[str, str]] = {}

    def __call__(self, text: str, index: int) -> str:
        template = self._templates.get(index)
        if template is None:
            rendered = f"data: {self._fmt.chunk(_TEXT, index=index).model_dump_json()}\n\n"
            head, _, tail = rendered.partition(f'"{_TEXT}"')
            template = self._templates[index] = (head, tail)
        return template[0] + msgspec.json.encode(text).decode() + template[1]


class ChatFormat:
    """Builds /v1/chat/completions bodies and stream chunks for one request (`request_id`: the caller's, as the id's
    tail; else a random one). With `reasoning` (a reasoning parser split the output) an empty answer is null."""

    def __init__(self, model: str, request_id: str | None = None, reasoning: bool = False):
        self.reasoning = reasoning
        self.caller_id = request_id or None
        self.id = f"chatcmpl-{request_id}" if request_id else new_id("chatcmpl")
        self.model = model
        self.created = int(time.time())
        self.text_event = TextEvents(self)

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    @staticmethod
    def logprobs(entries: TextLogprobs | None) -> ChatLogprobs | None:
        if entries is None:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(token=t, logprob=lp, bytes=_bytes(t),
                         top_logprobs=[TopLogprob(token=a, logprob=b, bytes=_bytes(a)) for a, b in top])
            for t, lp, top in entries])

    def head_chunk(self, index: int = 0) -> ChatCompletionChunk | None:
        return self._chunk([ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""})])

    def chunk(self, text: str, finish_reason: str | None = None, *, index: int = 0,
              logprobs: TextLogprobs | None = None, stop_reason=None,
              tool_calls: list[dict] | None = None, reasoning: str = "") -> ChatCompletionChunk:
        delta: dict[str, Any] = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return self._chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                            logprobs=self.logprobs(logprobs), stop_reason=stop_reason)])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def _message(self, c: "Choice") -> AssistantMessage:
        content = c.text if c.text or not (c.tool_calls or self.reasoning) else None
        return AssistantMessage(content=content, tool_calls=c.tool_calls or [], reasoning=c.reasoning,
                                reasoning_content=c.reasoning)

    def response(self, choices: list["Choice"], usage: UsageInfo) -> ChatCompletionResponse:
        body = [ChatChoice(index=c.index, message=self._message(c), finish_reason=c.finish_reason,
                           logprobs=self.logprobs(c.logprobs), stop_reason=c.stop_reason) for c in choices]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=body, usage=usage,
                                      prompt_logprobs=choices[0].prompt_logprobs if choices else None)


class CompletionFormat:
    """Builds /v1/completions bodies and stream chunks for one request (`request_id` as ChatFormat's)."""

    def __init__(self, model: str, request_id: str | None = None):
        self.caller_id = request_id or None
        self.id = f"cmpl-{request_id}" if request_id else new_id("cmpl")
        self.model = model
        self.created = int(time.time())
        self.text_event = TextEvents(self)

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    @staticmethod
    def logprobs(entries: TextLogprobs | None, offset: int = 0) -> CompletionLogprobs | None:
        if entries is None:
            return None
        offsets = []
        for t, _, _ in entries:
            offsets.append(offset)
            offset += len(t)
        return CompletionLogprobs(tokens=[t for t, _, _ in entries], token_logprobs=[lp for _, lp, _ in entries],
                                  top_logprobs=[None if top is None else dict(top) for _, _, top in entries],
                                  text_offset=offsets)

    def head_chunk(self, index: int = 0) -> CompletionResponse | None:
        return None

    def chunk(self, text: str, finish_reason: str | None = None, *, index: int = 0,
              logprobs: TextLogprobs | None = None, stop_reason=None, offset: int = 0) -> CompletionResponse:
        return self._body([CompletionChoice(index=index, text=text, finish_reason=finish_reason,
                                            logprobs=self.logprobs(logprobs, offset), stop_reason=stop_reason)])

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self._body([], usage)

    def response(self, choices: list["Choice"], usage: UsageInfo) -> CompletionResponse:
        return self._body([CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                            logprobs=self.logprobs(c.logprobs), stop_reason=c.stop_reason,
                                            prompt_logprobs=c.prompt_logprobs)
                           for c in choices], usage)


class Choice(BaseModel):
    """One finished choice, the same for both endpoints."""

    index: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: Any = None  # TextLogprobs
    tool_calls: list[dict] | None = None  # wire format, chat only
    reasoning: str | None = None  # chat only, with a reasoning parser (None: none, or the request dropped it)
    num_reasoning_tokens: int = 0  # output tokens of the thinking (the Responses API's usage)
    prompt_logprobs: list | None = None  # vLLM's wire format, with prompt_logprobs
