"""AsyncEngine: the engine loop in one dedicated thread, with an asyncio stream of step outputs per request.

The engine is not thread-safe, so only its thread touches it. Handlers send commands (add, abort) through a
thread-safe queue; the thread runs them between steps, so an abort frees the request's KV blocks before the next
step. Outputs travel back to the event loop with `call_soon_threadsafe`, one batch per step.

If a step raises, every request in the engine at that moment fails with `RequestFailed` (the server answers 500)
and is aborted so its blocks are freed; the loop keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from functools import partial
from typing import AsyncIterator, Callable

from peagle.engine.outputs import StepOutput
from peagle.engine.sampling_params import SamplingParams
from peagle.server.engine_wire import joined
from peagle.server.metrics import ServerMetrics, StatLogger

logger = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """The engine failed while running this request; it was aborted."""


class RequestStream:
    """One request's step outputs, in order, ending with the finished one. Iterate it on the event loop."""

    def __init__(self, request_id: str, num_prompt_tokens: int, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.done = False  # the finished output (or a failure) has been taken from the stream
        self.accepted: asyncio.Future[None] = loop.create_future()
        self._loop = loop
        self._items: collections.deque[StepOutput | Exception] = collections.deque()  # delivered, not yet taken
        self._waiter: asyncio.Future[None] | None = None
        self.last_token_time: float | None = None  # engine thread only, for the inter-token latency
        self.held: StepOutput | None = None  # engine thread only: tokens kept back for the stream interval
        self.sent_any = False  # engine thread only: tokens went out (the first are never kept back)
        self.prompt_logprobs: list | None = None  # TokenLogprobs of prompt tokens 1.. (prompt_logprobs requests)

    async def next_output(self) -> StepOutput:
        """The next output, joined with every output queued behind it (the steps a busy event loop has not caught up
        with yet: one response chunk and one socket write for all of them); raises RequestFailed if the engine
        failed. Not to be called once `done`."""
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, Exception):
            self.done = True
            raise item
        while not item.finished and self._items and not isinstance(self._items[0], Exception):
            item = joined(item, self._items.popleft())
        self.done = item.finished
        return item

    def put(self, item: StepOutput | Exception):
        """Delivers an output (or the engine's failure); event loop only."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> AsyncIterator[StepOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[StepOutput]:
        while not self.done:
            yield await self.next_output()


class AsyncEngine:
    """Drives an `LLMEngine` from its own thread. `start()` and every coroutine run on one event loop."""

    def __init__(self, engine, metrics: ServerMetrics | None = None, model_name: str = "",
                 log_stats_interval_s: float | None = None, stream_interval: int = 1):
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        self.engine = engine
        # vLLM's --stream-interval: after a request's first output, its tokens go out once this many have gathered
        # (and when it finishes), so that a busy server writes fewer, larger chunks
        self.stream_interval = stream_interval
        self.metrics = metrics or ServerMetrics(engine.k, model_name, engine.config.enable_prefix_caching)
        # vLLM's periodic stats lines (None: off)
        self.stat_logger = None if log_stats_interval_s is None else StatLogger(self.metrics, log_stats_interval_s)
        self.stats = engine.stats()  # a snapshot, replaced by the engine thread after each iteration
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only: requests inside the engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side -------------------------------------------------------------------------------------

    def start(self):
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was called twice")
        self._loop = asyncio.get_running_loop()
        from peagle.kernels.compile_watch import WATCH

        WATCH.serving()  # a kernel compiled from here on stalls the requests in its step: each is logged
        self._thread = threading.Thread(target=self._run, name="peagle-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0):
        """Stops the engine thread after its current step; requests still inside fail with RequestFailed."""
        if self._thread is None:
            return
        self._send(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          sampling_params: SamplingParams) -> RequestStream:
        """Queues the request and waits until the engine took it (ValueError if it refused it)."""
        if not self.is_alive:
            raise RequestFailed("the engine is not running")
        stream = RequestStream(request_id, len(prompt_token_ids), self._loop)
        self._send(partial(self._add, stream, list(prompt_token_ids), sampling_params))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still run; the abort queued after it undoes it
            raise
        return stream

    def abort(self, request_id: str):
        """Aborts the request before the engine's next step (its blocks are freed then); unknown ids are ignored."""
        self._send(partial(self._abort, request_id))

    def _send(self, command: Callable[[], None] | None):
        """Queues a command for the engine thread (None: stop)."""
        self._commands.put(command)

    # ---- engine thread ---------------------------------------------------------------------------------------

    def _run(self):
        while True:
            for command in self._take_commands():
                if command is None:
                    self._fail_all("the server is shutting down")
                    return
                try:
                    command()
                except Exception:
                    logger.exception("engine command failed")
            if self.engine.has_unfinished_requests():
                self._step()
            self._publish_stats()

    def _take_commands(self) -> list[Callable[[], None] | None]:
        # Idle: sleep until a command comes. Busy: take what has arrived and step again.
        commands = []
        if not self.engine.has_unfinished_requests():
            commands.append(self._next_command_when_idle())
            if self.stat_logger is not None:
                self.stat_logger.restart_window()
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _next_command_when_idle(self) -> Callable[[], None] | None:
        """The next command, waited for; meanwhile the drained burst's stats line once one is due (at most one per
        interval: a line logged shortly before the burst drained holds it back)."""
        wait = None if self.stat_logger is None else self.stat_logger.pending_s()
        if wait is not None:
            try:
                return self._commands.get(timeout=wait)
            except queue.Empty:
                self._publish_stats()
        return self._commands.get()

    def _add(self, stream: RequestStream, prompt_token_ids: list[int], params: SamplingParams):
        try:
            seq = self.engine.add_request(stream.request_id, prompt_token_ids, params)
        except Exception as e:  # ValueError: the request's fault (400); anything else reaches the caller as 500
            self._loop.call_soon_threadsafe(_settle, stream.accepted, e)
            return
        stream.prompt_logprobs = seq.prompt_logprobs  # set before `accepted` settles: the handler reads it then
        self._streams[stream.request_id] = stream
        self.metrics.on_prompt(len(prompt_token_ids))
        self._loop.call_soon_threadsafe(_settle, stream.accepted, None)

    def _abort(self, request_id: str):
        if self._streams.pop(request_id, None) is None:
            return  # finished (or refused) already
        self.engine.abort_request(request_id)
        self.metrics.on_finished("abort", None)

    def _step(self):
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing its %d requests", len(self._streams))
            self._fail_all(f"the engine failed while running this request: {type(e).__name__}: {e}")
            return
        self._handle_outputs(outputs)

    def _handle_outputs(self, outputs: list[StepOutput]):
        """One step's outputs: metrics, the stream interval's holding back, delivery to the event loop."""
        deliveries = self._deliveries(outputs)
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _deliveries(self, outputs: list[StepOutput]) -> list[tuple[RequestStream, StepOutput]]:
        """The metrics of one step's outputs, and what goes to the streams now (the stream interval holds the
        rest back)."""
        now = time.monotonic()
        deliveries = []
        num_tokens, intervals = 0, []  # the step's tokens, and (interval, tokens) per request that had some before
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.new_token_ids:
                num_tokens += len(out.new_token_ids)
                if stream.last_token_time is not None:
                    intervals.append((now - stream.last_token_time, len(out.new_token_ids)))
                stream.last_token_time = now
            if out.finished:
                self.metrics.on_finished(out.finish_reason or "stop", out.metrics)
                del self._streams[out.request_id]
            if stream.held is not None:
                out, stream.held = joined(stream.held, out), None
            if stream.sent_any and not out.finished and len(out.new_token_ids) < self.stream_interval:
                stream.held = out
                continue
            stream.sent_any = stream.sent_any or bool(out.new_token_ids)  # the first tokens are never held
            deliveries.append((stream, out))
        self.metrics.on_step_tokens(num_tokens, intervals)
        return deliveries

    def _fail_all(self, message: str):
        streams, self._streams = self._streams, {}
        for request_id in streams:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort request %s after an engine failure", request_id)
            self.metrics.on_finished("error", None)
        if streams:
            self._loop.call_soon_threadsafe(_deliver, [(s, RequestFailed(message)) for s in streams.values()])

    def _publish_stats(self):
        try:
            stats = self.engine.stats()
        except Exception:
            logger.exception("engine stats failed")
            return
        self._set_stats(stats)

    def _set_stats(self, stats):
        self.stats = stats
        self.metrics.set_engine_stats(stats.num_running, stats.num_waiting, stats.kv_usage)
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(stats.num_running, stats.num_waiting, stats.kv_usage,
                                       idle=not self.engine.has_unfinished_requests())


def _settle(future: asyncio.Future, error: Exception | None):
    if future.done():  # the waiting handler was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(deliveries: list[tuple[RequestStream, StepOutput | Exception]]):
    for stream, item in deliveries:
        stream.put(item)
