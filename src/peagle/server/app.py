"""The FastAPI application: OpenAI routes under /v1; vLLM's /tokenize, /detokenize, /version; /health and /metrics;
OpenAI-style error bodies."""

from __future__ import annotations

import hmac
import json
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from peagle.server import DEFAULT_MAX_QUEUE, DEFAULT_MAX_REQUEST_BYTES
from peagle.server.async_engine import AsyncEngine, RequestFailed
from peagle.server.protocol import ApiError, DetokenizeRequest, ModelCard, ModelList, TokenizeRequest, parse_request
from peagle.server.serving import ClientGone, Serving
from peagle.server.tool_calls import template_supports_tools


def create_app(engine, served_model_name: str | list[str], api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, trust_request_chat_template: bool = False,
               sampling_defaults: dict | None = None, log_stats_interval_s: float | None = None,
               request_id_headers: bool = False, reasoning_parser: str | None = None, log_requests: bool = False,
               max_log_len: int | None = None, stream_interval: int = 1,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """An app serving `engine` (an LLMEngine, or an EngineProcess: the engine in a child process) as `served_model_name` (several names: requests may name any, responses
    name the first, as vLLM's --served-model-name).

    The engine loop starts with the app (lifespan) and stops with it. At most `max_num_seqs + max_queue` requests
    are in flight; beyond that requests get 503 with Retry-After. With `api_key`, /v1 routes need
    `Authorization: Bearer <api_key>`; /health and /metrics stay open for probes and scrapers. A request's own
    `chat_template` is rendered only with `trust_request_chat_template` (vLLM's --trust-request-chat-template).
    `sampling_defaults` (`model_sampling_defaults`) fill the sampling fields a request leaves out. With
    `log_stats_interval_s`, vLLM's periodic stats lines are logged (`metrics.StatLogger`). With
    `request_id_headers` (vLLM's --enable-request-id-headers) every response carries X-Request-Id: the request's own
    header, else a new id. With `reasoning_parser` (vLLM's --reasoning-parser: qwen3, deepseek_r1) chat responses
    carry the model's thinking apart from its answer (`peagle.server.reasoning`). With `log_requests` (vLLM's
    --enable-log-requests) each request is logged at INFO as it arrives, its prompt cut to `max_log_len` characters.
    `stream_interval` (vLLM's --stream-interval): after a request's first output, its tokens go to the client once
    that many have gathered, and when it finishes. A request body over `max_request_bytes` answers 413 unread.
    """
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("served_model_name must be a non-empty string or a list of them")
    engine_cls = AsyncEngine
    if getattr(engine, "remote", False):  # an EngineProcess: the engine runs in a child process
        from peagle.server.engine_client import ProcessAsyncEngine as engine_cls
    async_engine = engine_cls(engine, model_name=names[0], log_stats_interval_s=log_stats_interval_s,
                              stream_interval=stream_interval)
    serving = Serving(async_engine, names, engine.config.max_num_seqs + max_queue,
                      trust_request_chat_template, sampling_defaults, reasoning_parser,
                      log_requests=log_requests, max_log_len=max_log_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="peagle", lifespan=lifespan)
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes)
    app.state.async_engine = async_engine
    app.state.serving = serving
    _add_error_handlers(app)
    if request_id_headers:
        @app.middleware("http")
        async def add_request_id(request: Request, call_next):
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            response = await call_next(request)
            response.headers["X-Request-Id"] = request_id
            return response
    app.include_router(_v1_router(serving, engine, api_key))
    app.include_router(_tokenizer_router(serving))
    app.include_router(_sagemaker_router(serving, api_key))

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # SageMaker's health check (as vLLM's)
    async def health() -> Response:
        if not async_engine.is_alive:
            return JSONResponse(ApiError(503, "the engine loop is not running").body(), status_code=503)
        return JSONResponse({})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": _version()})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _v1_router(serving: Serving, engine, api_key: str | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_key_check(api_key))])
    cards = {name: ModelCard(id=name, root=str(engine.config.model), max_model_len=engine.max_model_len)
             for name in serving.model_names}

    @router.get("/models")
    async def models() -> dict:
        return ModelList(data=list(cards.values())).model_dump()

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        serving.check_model(model_id)
        return cards[model_id].model_dump()

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request)

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @router.post("/responses")
    async def responses(request: Request) -> Response:
        return await serving.responses(request)

    @router.api_route("/responses/{response_id}", methods=["GET", "DELETE"])
    @router.post("/responses/{response_id}/cancel")
    async def stored_response(response_id: str) -> Response:
        raise ApiError(404, f"no response '{response_id}': this server stores no responses (each is answered once, "
                            f"as with store: false)", param="response_id", code="not_found")

    return router


def _sagemaker_router(serving: Serving, api_key: str | None) -> APIRouter:
    """SageMaker's inference route, as vLLM serves it: POST /invocations with a chat completion request (a body with
    "messages") or a completion request ("prompt"), answered as /v1 answers it. It takes the API key as /v1 does."""
    router = APIRouter(dependencies=[Depends(_key_check(api_key))])

    @router.post("/invocations")
    async def invocations(request: Request) -> Response:
        try:
            body = json.loads(await request.body())  # the body stays cached for the handler
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if isinstance(body, dict) and "messages" in body:
            return await serving.chat(request)
        if isinstance(body, dict) and "prompt" in body:
            return await serving.completions(request)
        raise ApiError(400, "/invocations takes a chat completion request (a JSON object with 'messages') or a "
                            "completion request (with 'prompt')")

    return router


def _tokenizer_router(serving: Serving) -> APIRouter:
    """vLLM's /tokenize and /detokenize (outside /v1, so open like vLLM's)."""
    router = APIRouter()

    def tokenizer():
        if serving.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        return serving.tokenizer

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse_request(await request.body(), TokenizeRequest)
        serving.check_model(req.model)
        tok = tokenizer()
        if req.messages is not None:
            tok = serving.tokenizer_for(req.chat_template)
            if req.tools and not template_supports_tools(tok.chat_template):
                raise ApiError(400, "this model's chat template does not render tools", param="tools")
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = serving.render_chat([m.template_message() for m in req.messages], req.add_generation_prompt,
                                      False, tools, req.chat_template_kwargs, req.continue_final_message, tok)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids})

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse_request(await request.body(), DetokenizeRequest)
        serving.check_model(req.model)
        tok = tokenizer()
        if any(not 0 <= t < tok.vocab_size for t in req.tokens):
            raise ApiError(400, f"tokens must be ids in [0, {tok.vocab_size})", param="tokens")
        return JSONResponse({"prompt": tok.decode(req.tokens)})

    return router


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("peagle")
    except PackageNotFoundError:
        return "unknown"


def _key_check(api_key: str | None):
    expected = api_key.encode() if api_key else None

    async def check(request: Request):
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest runs in time independent of where the strings differ.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    return check


def _add_error_handlers(app: FastAPI):
    async def api_error(request: Request, exc: ApiError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def request_failed(request: Request, exc: RequestFailed) -> Response:
        return await api_error(request, ApiError(500, str(exc)))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # Unknown routes (404) and wrong methods (405) answer in the same format as everything else.
        return await api_error(request, ApiError(exc.status_code, str(exc.detail), headers=exc.headers))

    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    async def internal_error(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after answering, so the server logs the traceback.
        return await api_error(request, ApiError(500, f"internal error: {type(exc).__name__}"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestFailed, request_failed)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, internal_error)


class _BodyLimit:
    """413 for a request body over `max_bytes`: by its Content-Length before any of it is read, or as a chunked body
    grows past it (the handler then sees the client as gone)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit() or int(value) > self.max_bytes:
                    return await self._refuse(send)
                return await self.app(scope, receive, send)
        seen, started, refused = 0, False, False

        async def limited_receive():
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    if not started and not refused:
                        refused = True
                        await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message):
            nonlocal started
            if refused:  # the app answering a body it never got whole: the 413 went out instead
                return
            started = True
            await send(message)

        return await self.app(scope, limited_receive, tracking_send)

    async def _refuse(self, send):
        body = json.dumps(ApiError(413, f"the request body is larger than this server takes ({self.max_bytes} "
                                        f"bytes; --max-request-bytes)").body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
