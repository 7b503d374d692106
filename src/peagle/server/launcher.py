"""The processes of `peagle serve`, as vLLM arranges them.

- By default the engine runs in a process of its own (`engine_process`) and one API server (uvicorn, the app) runs
  in the main process. `--engine-thread` runs the engine in a thread of the API server instead (for debugging).
- `--api-server-count N` (N > 1): N API server processes accept on one listening socket, bound here before anything
  loads and handed to each, all talking to the one engine process; this process supervises them. Their /metrics
  agree: prometheus-client's multiprocess mode sums every server's counters and histograms (the engine's gauges are
  the most recent server's). The periodic stats lines are off (each server sees only its share); read /metrics.

Faults: when the engine process dies, every request in flight ends with an error (an SSE error event, or 500) and
the server exits with status 1 (a supervisor restarts it; the engine is not restarted in place). SIGTERM drains:
the servers stop accepting, let the requests in flight finish for up to `--shutdown-timeout` seconds, cancel the
rest (aborting them in the engine), stop the engine and exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

logger = logging.getLogger("peagle.server.cli")

EXIT_ENGINE_DEAD = 1


def launch(args: argparse.Namespace, config, template: str | None = None, defaults: dict | None = None,
           engine_factory=None, tokenizer=None) -> int:
    """Serves `config` as `args` (serve's options) say; returns the exit status. `engine_factory` builds the engine
    from the config (LLMEngine by default; the stand-in engine in tests); `tokenizer`: a loaded tokenizer for the
    engine thread (the engine process loads args.tokenizer itself)."""
    listener = bind_socket(args.host, args.port)  # before the engine loads: a taken port fails at once
    try:
        if args.engine_thread:
            if engine_factory is None:
                from peagle.engine.llm_engine import LLMEngine as engine_factory
            engine = engine_factory(config)
            if tokenizer is not None:
                engine.use_tokenizer(tokenizer)
            return run_api_server(args, engine, template, defaults, listener)
        from peagle.server.engine_process import EngineProcess

        engine, others = EngineProcess.start(config, tokenizer=args.tokenizer, engine_factory=engine_factory,
                                             num_api_servers=args.api_server_count)
        try:
            if args.api_server_count == 1:
                return run_api_server(args, engine, template, defaults, listener)
            return _supervise(args, engine, others, template, defaults, listener)
        finally:
            engine.close()  # the app's shutdown closed it already, unless the server never started
    finally:
        listener.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening), as uvicorn would bind it."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name: resolve it
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose protocol says TCP, and
    # without it Nagle holds each streamed chunk until the client's delayed ACK (40 ms) once a response has begun
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by the accepted sockets on Linux
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def run_api_server(args: argparse.Namespace, engine, template, defaults, listener: socket.socket) -> int:
    """One API server over `engine` (an LLMEngine, or an EngineProcess handle) on `listener`, until SIGTERM or
    SIGINT (0) or the engine process's death (1)."""
    import uvicorn

    app = build_app(args, engine, template, defaults)
    scheme = "https" if args.ssl_certfile else "http"
    where = "a thread of the server" if args.engine_thread else "a process of its own"
    logger.info("serving %s as %s at %s://%s:%d%s/v1 (speculation: %s; the engine in %s)", args.model,
                " / ".join(map(repr, args.served_model_name or [args.model])), scheme, args.host, args.port,
                args.root_path, getattr(engine.config, "speculative", None) or "off", where)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=args.uvicorn_log_level or logging.getLogger().getEffectiveLevel(),
        access_log=not args.disable_uvicorn_access_log, root_path=args.root_path, ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile, timeout_graceful_shutdown=args.shutdown_timeout))
    status = [0]

    def engine_dead():
        status[0] = EXIT_ENGINE_DEAD
        server.should_exit = True  # the failed streams end first: uvicorn waits for open connections

    if hasattr(app.state.async_engine, "on_engine_dead"):
        app.state.async_engine.on_engine_dead.append(engine_dead)
    from peagle.server.engine_process import freeze_startup_heap

    freeze_startup_heap()
    with _signals_end_cleanly():
        server.run(sockets=[listener])
    return status[0]


def build_app(args: argparse.Namespace, engine, template, defaults):
    """The app of `peagle serve` for a built engine (an LLMEngine or an EngineProcess)."""
    from fastapi.middleware.cors import CORSMiddleware

    from peagle.server.app import create_app
    from peagle.server.cli import STATS_INTERVAL_S
    from peagle.server.tool_calls import template_supports_tools

    if template is not None:
        engine.tokenizer.chat_template = template
    if args.tool_call_parser and not template_supports_tools(engine.tokenizer and engine.tokenizer.chat_template):
        raise ValueError("--tool-call-parser hermes: this model's chat template does not render tools in the Hermes "
                         "<tool_call> format (give one that does with --chat-template)")
    names = args.served_model_name or [args.model]
    api_key = args.api_key or os.environ.get("PEAGLE_API_KEY") or None
    log_stats = not args.disable_log_stats and args.api_server_count == 1
    app = create_app(engine, names, api_key=api_key, max_queue=args.max_queue,
                     trust_request_chat_template=args.trust_request_chat_template, sampling_defaults=defaults,
                     log_stats_interval_s=STATS_INTERVAL_S if log_stats else None,
                     request_id_headers=args.enable_request_id_headers, reasoning_parser=args.reasoning_parser,
                     log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                     stream_interval=args.stream_interval, max_request_bytes=args.max_request_bytes)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
                       allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)
    if defaults:
        logger.info("default sampling parameters from the model's generation config: %s (requests that give a field "
                    "override it; --generation-config vllm ignores them)", defaults)
    return app


@contextlib.contextmanager
def _signals_end_cleanly():
    """uvicorn drains on SIGTERM (and SIGINT) and then raises the signal again under the handler it found: a
    handler that does nothing, so that a drained server exits 0 rather than dying by the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


# ---- several API servers --------------------------------------------------------------------------------------------

def _supervise(args, engine, others, template, defaults, listener: socket.socket) -> int:
    """Runs args.api_server_count API server processes over the engine process until SIGTERM / SIGINT (0) or until
    one of them or the engine ends (1: the others are stopped)."""
    metrics_dir = tempfile.mkdtemp(prefix="peagle-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by each server when it imports prometheus-client
    ctx = multiprocessing.get_context("spawn")
    socks = [engine.sock, *others]
    servers = [ctx.Process(target=_api_server_main, name=f"peagle-api-server-{i}",
                           args=(args, i, s, engine.config, engine.info, template, defaults, listener))
               for i, s in enumerate(socks)]
    stopping = threading.Event()

    def stop(signum, _frame):
        if not stopping.is_set():
            logger.info("%s: draining the API servers (up to %g s)", signal.Signals(signum).name,
                        args.shutdown_timeout)
        stopping.set()
        for p in servers:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    before = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for p in servers:
            p.start()
        for s in socks:
            s.close()  # the servers' copies only: the engine sees a server's death as its socket closing
        status = _watch(servers, engine.process, stopping)
        if status:
            stop(signal.SIGTERM, None)
        deadline = time.monotonic() + args.shutdown_timeout + 10
        for p in servers:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                logger.error("API server %s did not stop by the shutdown deadline; killing it", p.name)
                p.kill()
                p.join(5)
        engine.close()  # the engine exits once every server's socket is closed
        return status
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for p in servers:
            if p.is_alive():
                p.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def _watch(servers, engine_process, stopping: threading.Event) -> int:
    """Waits for a stop (0) or for a server or the engine to end unasked (1)."""
    from multiprocessing.connection import wait

    while not stopping.is_set():
        wait([p.sentinel for p in servers] + [engine_process.sentinel], timeout=0.5)
        if stopping.is_set():
            break
        for p in servers:
            if not p.is_alive():
                logger.error("API server %s exited (status %s); stopping the others", p.name, p.exitcode)
                return 1
        if not engine_process.is_alive():
            logger.error("the engine process ended (exit code %s); stopping the API servers", engine_process.exitcode)
            return EXIT_ENGINE_DEAD
    return 0


def _api_server_main(args, index: int, sock, config, info: dict, template, defaults, listener) -> None:
    import sys

    from peagle.server.engine_process import EngineProcess

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, lambda *_: None)  # Ctrl-C reaches the group: the supervisor sends SIGTERM
    _term_with_parent()
    engine = EngineProcess(sock, config, info)
    with _signals_end_cleanly():
        code = run_api_server(args, engine, template, defaults, listener)
    logger.info("API server %d exits (%d)", index, code)
    sys.exit(code)


def _term_with_parent():
    """SIGTERM (a drain) when the supervising process dies, so that no server outlives it on the port (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
