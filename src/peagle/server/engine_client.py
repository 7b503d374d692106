"""ProcessAsyncEngine: an API server's client of the engine process, run on the server's event loop.

No thread: the engine's socket is read by the event loop (`add_reader`), each frame holds one engine step's outputs
for this server's requests, and they go to the request streams at once, with the same metrics, stream interval and
failure handling as the engine thread (`AsyncEngine`). Commands go out buffered, so a handler never blocks on a full
socket.

If the engine process dies (its socket closes), every request in flight fails with RequestFailed (a stream ends
with an error event, a waiting request answers 500), /health answers 503, new requests are refused, and the
`on_engine_dead` callbacks run (`peagle serve` then exits non-zero).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable

from peagle.server import engine_wire as wire
from peagle.server.async_engine import AsyncEngine, RequestFailed, RequestStream, _deliver, _settle

logger = logging.getLogger(__name__)


class ProcessAsyncEngine(AsyncEngine):
    """AsyncEngine for an `EngineProcess`: the same interface, the engine in another process."""

    def __init__(self, engine, *args, **kwargs):
        super().__init__(engine, *args, **kwargs)
        self._sock = engine.sock
        self._frames = wire.FrameBuffer()
        self._unsent = bytearray()  # commands the socket did not take yet
        self._pending: dict[str, tuple[RequestStream, bool]] = {}  # sent, not yet taken: (stream, aborted)
        self._alive = False
        self._stats_timer: asyncio.TimerHandle | None = None
        self.on_engine_dead: list[Callable[[], None]] = []

    def start(self):
        if self._loop is not None:
            raise RuntimeError("ProcessAsyncEngine.start() was called twice")
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._on_readable)
        self._alive = True

    def shutdown(self, timeout: float | None = 30.0):
        """Stops reading the engine (requests still inside fail with RequestFailed) and closes this server's socket;
        where this process started the engine process, waits for it to exit."""
        if self._loop is None:
            return
        if self._alive:
            self._detach()
            self._fail_everything("the server is shutting down")
        self.engine.close(30.0 if timeout is None else timeout)

    @property
    def is_alive(self) -> bool:
        return self._alive

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params) -> RequestStream:
        if not self._alive:
            raise RequestFailed("the engine process is not running")
        stream = RequestStream(request_id, len(prompt_token_ids), self._loop)
        starts_after = None
        if params.compiled_grammar is not None:  # compiled for this server's tokenizer: the engine compiles its own
            starts_after = params.compiled_grammar.starts_after
            params = dataclasses.replace(params, compiled_grammar=None)
        self._pending[request_id] = (stream, False)
        self._write(wire.command_frame(("add", request_id, list(prompt_token_ids), params, starts_after)))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str):
        """Aborts the request in the engine (its blocks are freed before the next step); unknown ids are ignored."""
        if request_id in self._pending:
            self._pending[request_id] = (self._pending[request_id][0], True)
        elif self._streams.pop(request_id, None) is not None:
            self.metrics.on_finished("abort", None)
        else:
            return
        if self._alive:
            self._write(wire.command_frame(("abort", request_id)))

    # ---- the socket --------------------------------------------------------------------------------------------

    def _write(self, data: bytes):
        if self._unsent:
            self._unsent += data
            return
        try:
            n = self._sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError:  # the engine is gone: the reader sees the socket close
            return
        if n < len(data):
            self._unsent += data[n:]
            self._loop.add_writer(self._sock.fileno(), self._on_writable)

    def _on_writable(self):
        try:
            n = self._sock.send(self._unsent)
        except BlockingIOError:
            return
        except OSError:
            self._loop.remove_writer(self._sock.fileno())
            return
        del self._unsent[:n]
        if not self._unsent:
            self._loop.remove_writer(self._sock.fileno())

    def _on_readable(self):
        try:
            data = self._sock.recv(1 << 22)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._engine_gone()
            return
        for payload in self._frames.feed(data):
            self._on_message(wire.decode_engine_message(payload))

    def _on_message(self, message: wire.EngineMessage):
        if isinstance(message, wire.Step):
            deliveries = self._deliveries(message.outputs)
            if deliveries:
                _deliver(deliveries)
            self._set_stats(message.stats)
        elif isinstance(message, wire.Added):
            self._on_added(message)
        elif isinstance(message, wire.Failed):
            logger.error("engine step failed in the engine process; failing its %d requests: %s",
                         len(self._streams), message.error)
            self._fail_all(f"the engine failed while running this request: {message.error}")
            self._set_stats(message.stats)
        else:
            self._set_stats(message.stats)

    def _on_added(self, m: wire.Added):
        stream, aborted = self._pending.pop(m.request_id)
        if m.error is not None:
            _settle(stream.accepted, (ValueError if m.bad_input else RuntimeError)(m.error))
        elif aborted:  # the abort that followed reached the engine after the add
            _settle(stream.accepted, RequestFailed("aborted"))
        else:
            stream.prompt_logprobs = m.prompt_logprobs
            self._streams[m.request_id] = stream
            self.metrics.on_prompt(m.num_prompt_tokens)
            _settle(stream.accepted, None)

    def _engine_gone(self):
        self._detach()
        process = self.engine.process
        if process is not None:
            process.join(0.5)
        code = "unknown" if process is None else process.exitcode
        logger.error("the engine process ended (exit code %s); failing %d requests", code,
                     len(self._streams) + len(self._pending))
        self._fail_everything(f"the engine process ended (exit code {code}) while running this request")
        for callback in self.on_engine_dead:
            callback()

    def _detach(self):
        self._alive = False
        if self._stats_timer is not None:
            self._stats_timer.cancel()
        self._loop.remove_reader(self._sock.fileno())
        if self._unsent:
            self._loop.remove_writer(self._sock.fileno())

    def _fail_everything(self, message: str):
        pending, self._pending = self._pending, {}
        for stream, _ in pending.values():
            _settle(stream.accepted, RequestFailed(message))
        self._fail_all(message)

    def _fail_all(self, message: str):
        # the engine has aborted its requests already (a failed step) or is gone
        streams, self._streams = self._streams, {}
        for _ in streams:
            self.metrics.on_finished("error", None)
        _deliver([(s, RequestFailed(message)) for s in streams.values()])

    def _set_stats(self, stats):
        self.engine.last_stats = stats
        super()._set_stats(stats)
        if self.stat_logger is not None and not self.engine.has_unfinished_requests():
            # idle: the drained burst's stats line once it is due
            due = self.stat_logger.pending_s()
            if self._stats_timer is not None:
                self._stats_timer.cancel()
            if due is not None:
                self._stats_timer = self._loop.call_later(due, lambda: super(ProcessAsyncEngine, self)._set_stats(
                    self.engine.last_stats))
