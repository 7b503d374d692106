"""The engine in a process of its own (`peagle serve --engine-process`): the server's Python and the engine's host loop
stop sharing one GIL.

`EngineProcess.start(config)` spawns a child that builds the `LLMEngine` and runs it: it takes commands (add, abort,
shutdown) from a pipe between steps and sends every step's outputs back with the engine's stats. The parent holds an
`EngineProcess`, which answers what the server reads of an engine (tokenizer, EOS ids, max_model_len, config,
model_config, K, stats) without loading the weights, and `ProcessAsyncEngine` (an `AsyncEngine`) in place of the
engine thread: its thread relays commands to the child and the child's outputs to the event loop, with the same
metrics, stream interval and failure handling as the in-process thread.

Requests travel pickled. A structured-output grammar compiled in the server (for its tokenizer, possibly to start
after the reasoning's end) travels as its request and start, and the child compiles it again for its own tokenizer.
If a step raises, the child aborts every request it holds and reports the failure (the server answers 500 for
them) and keeps serving; if the child dies, every request in flight fails, /health answers 503 and new requests
are refused.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import socket
import threading
from multiprocessing.connection import Connection, wait

from peagle.server.async_engine import AsyncEngine, RequestFailed, RequestStream, _deliver, _settle

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800.0  # a large model's load and CUDA graph capture


class EngineProcessError(RuntimeError):
    """The engine process could not start (its error, as the child raised it)."""


class EngineProcess:
    """The parent's handle on an engine running in a child process. Build it with `start`."""

    remote = True  # create_app drives it with ProcessAsyncEngine

    def __init__(self, process, conn: Connection, config, info: dict):
        self.process = process
        self.conn = conn
        self.config = config
        self.tokenizer = info["tokenizer"]
        self.eos_token_ids = info["eos_token_ids"]
        self.max_model_len = info["max_model_len"]
        self.model_config = info["model_config"]
        self.k = info["k"]
        self.last_stats = info["stats"]

    @classmethod
    def start(cls, config, tokenizer: str | None = None, timeout_s: float = READY_TIMEOUT_S) -> "EngineProcess":
        """Spawns the engine process for `config` (an EngineConfig; `tokenizer`: another directory's tokenizer, as
        LLMEngine.use_tokenizer) and waits until its engine is built. If it fails: ValueError with the child's
        error where that was a ValueError or a missing file (bad input), else EngineProcessError."""
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_child_main, args=(child, config, tokenizer), name="peagle-engine",
                              daemon=True)
        process.start()
        child.close()
        try:
            if not parent.poll(timeout_s):
                raise EngineProcessError(f"the engine process did not become ready in {timeout_s:g} s")
            kind, payload = parent.recv()
        except EOFError:
            process.join(5)
            raise EngineProcessError(f"the engine process exited while starting (exit code {process.exitcode})") \
                from None
        except BaseException:
            process.kill()
            raise
        if kind != "ready":
            process.join(5)
            message, bad_input = payload
            # a bad model directory or option: the ValueError the engine thread would have raised, for a clean message
            raise (ValueError if bad_input else EngineProcessError)(f"the engine process failed to start: {message}")
        return cls(process, parent, config, payload)

    def stats(self):
        return self.last_stats

    def has_unfinished_requests(self) -> bool:
        return self.last_stats.num_running + self.last_stats.num_waiting > 0

    def close(self, timeout_s: float = 30.0):
        """Asks the child to stop, waits for it, kills it if it does not."""
        try:
            self.conn.send(("shutdown",))
        except (OSError, ValueError):
            pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


class ProcessAsyncEngine(AsyncEngine):
    """AsyncEngine for an EngineProcess: its thread relays commands to the child and outputs back."""

    def __init__(self, engine: EngineProcess, *args, **kwargs):
        super().__init__(engine, *args, **kwargs)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._pending: dict[str, tuple[RequestStream, bool]] = {}  # sent to the child, not yet taken: (stream, aborted)
        # Messages to the child go out from a thread of their own, so that the relay thread never blocks on a full
        # pipe while the child blocks sending it outputs (a burst of long prompts under load would deadlock both).
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None

    def start(self):
        super().start()
        self._sender = threading.Thread(target=self._send_loop, name="peagle-engine-send", daemon=True)
        self._sender.start()

    def _post(self, message):
        self._outbox.put(message)

    def _send_loop(self):
        while (message := self._outbox.get()) is not None:
            try:
                self.engine.conn.send(message)
            except (OSError, ValueError):  # the child is gone: the relay thread sees its pipe close
                return

    def shutdown(self, timeout: float | None = 30.0):
        """Stops the relay thread (requests still inside fail with RequestFailed), then the engine process."""
        if self._thread is None:
            return
        self._send(None)
        self._thread.join(timeout)
        self._outbox.put(None)
        if self._sender is not None:
            self._sender.join(timeout)
        self.engine.close()

    def _send(self, command):
        self._commands.put(command)
        try:
            self._wake_w.send(b"x")  # the relay thread waits on the child's pipe and on this socket
        except OSError:  # the thread is gone; nothing to wake
            pass

    # ---- relay thread ----------------------------------------------------------------------------------------

    def _run(self):
        conn = self.engine.conn
        try:
            while True:
                stats_due = None if self.stat_logger is None else self.stat_logger.pending_s()
                ready = wait([conn, self._wake_r], timeout=stats_due)
                if not ready:  # idle, and the drained burst's stats line is due
                    self._set_stats(self.engine.last_stats)
                    continue
                if self._wake_r in ready:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except BlockingIOError:
                        pass
                if not self._relay_commands():
                    return
                while conn.poll():
                    self._on_message(conn.recv())
        except (EOFError, OSError) as e:
            logger.error("the engine process ended (exit code %s): %s", self.engine.process.exitcode, e)
            self._fail_pending("the engine process ended")
            self._fail_all("the engine process ended while running this request")

    def _relay_commands(self) -> bool:
        """Sends the queued commands to the child; False after a shutdown."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                self._fail_pending("the server is shutting down")
                self._fail_all("the server is shutting down")
                return False
            try:
                command()
            except Exception:
                logger.exception("engine command failed")

    def _add(self, stream: RequestStream, prompt_token_ids: list[int], params):
        starts_after = None
        if params.compiled_grammar is not None:  # compiled for the server's tokenizer: the child compiles its own
            starts_after = params.compiled_grammar.starts_after
            params = dataclasses.replace(params, compiled_grammar=None)
        self._pending[stream.request_id] = (stream, False)
        self._post(("add", stream.request_id, prompt_token_ids, params, starts_after))

    def _abort(self, request_id: str):
        if request_id in self._pending:
            self._pending[request_id] = (self._pending[request_id][0], True)
            self._post(("abort", request_id))
            return
        if self._streams.pop(request_id, None) is None:
            return
        self._post(("abort", request_id))
        self.metrics.on_finished("abort", None)

    def _on_message(self, message):
        kind = message[0]
        if kind == "added":
            _, request_id, error, prompt_logprobs, num_prompt_tokens = message
            stream, aborted = self._pending.pop(request_id)
            if error is not None:
                self._loop.call_soon_threadsafe(_settle, stream.accepted, error)
                return
            if aborted:  # the abort that followed reached the child after the add
                self._loop.call_soon_threadsafe(_settle, stream.accepted, RequestFailed("aborted"))
                return
            stream.prompt_logprobs = prompt_logprobs
            self._streams[request_id] = stream
            self.metrics.on_prompt(num_prompt_tokens)
            self._loop.call_soon_threadsafe(_settle, stream.accepted, None)
        elif kind == "step":
            _, outputs, stats = message
            self._handle_outputs(outputs)
            self._set_stats(stats)
        elif kind == "failed":
            _, error, stats = message
            logger.error("engine step failed in the engine process; failing its %d requests: %s",
                         len(self._streams), error)
            self._fail_all(f"the engine failed while running this request: {error}")
            self._set_stats(stats)
        elif kind == "stats":
            self._set_stats(message[1])
        else:
            logger.error("unknown message from the engine process: %r", kind)

    def _fail_all(self, message: str):
        # the child has aborted its requests already (a failed step, a shutdown) or is gone
        streams, self._streams = self._streams, {}
        for _ in streams:
            self.metrics.on_finished("error", None)
        if streams:
            self._loop.call_soon_threadsafe(_deliver, [(s, RequestFailed(message)) for s in streams.values()])

    def _fail_pending(self, message: str):
        pending, self._pending = self._pending, {}
        for stream, _ in pending.values():
            self._loop.call_soon_threadsafe(_settle, stream.accepted, RequestFailed(message))

    def _set_stats(self, stats):
        self.engine.last_stats = stats
        super()._set_stats(stats)


# ---- the child ---------------------------------------------------------------------------------------------------

def _child_main(conn: Connection, config, tokenizer: str | None):
    import signal

    from peagle.engine.llm_engine import LLMEngine

    # Ctrl-C reaches the whole process group: the server shuts down and then stops this process itself (a server
    # that dies leaves this one a closed pipe, and it exits)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        engine = LLMEngine(config)
        if tokenizer is not None:
            from peagle.models.loader import load_tokenizer

            engine.use_tokenizer(load_tokenizer(tokenizer))
        info = {"tokenizer": engine.tokenizer, "eos_token_ids": engine.eos_token_ids,
                "max_model_len": engine.max_model_len, "model_config": engine.model_config, "k": engine.k,
                "stats": engine.stats()}
    except BaseException as e:
        conn.send(("error", (f"{type(e).__name__}: {e}", isinstance(e, (ValueError, FileNotFoundError)))))
        conn.close()
        return
    conn.send(("ready", info))
    live: set[str] = set()
    try:
        while True:
            messages = [] if engine.has_unfinished_requests() else [conn.recv()]
            while conn.poll():
                messages.append(conn.recv())
            for message in messages:
                if message[0] == "shutdown":
                    for request_id in live:
                        engine.abort_request(request_id)
                    return
                _child_command(engine, conn, live, message)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:
                    logging.getLogger(__name__).exception("engine step failed")
                    for request_id in live:
                        engine.abort_request(request_id)
                    live.clear()
                    conn.send(("failed", f"{type(e).__name__}: {e}", engine.stats()))
                    continue
                for out in outputs:
                    if out.finished:
                        live.discard(out.request_id)
                conn.send(("step", outputs, engine.stats()))
            else:
                conn.send(("stats", engine.stats()))
    except (EOFError, OSError):  # the server went away
        return


def _child_command(engine, conn: Connection, live: set[str], message):
    kind = message[0]
    if kind == "abort":
        if message[1] in live:
            live.discard(message[1])
            engine.abort_request(message[1])
        return
    if kind != "add":
        raise ValueError(f"unknown command {kind!r}")
    _, request_id, prompt_token_ids, params, starts_after = message
    try:
        if params.structured_outputs is not None and starts_after is not None:
            from peagle.engine.structured_output import with_grammar

            params = with_grammar(params, engine.tokenizer, engine.model_config.vocab_size, starts_after)
        seq = engine.add_request(request_id, prompt_token_ids, params)
    except Exception as e:  # ValueError: the request's fault (400); anything else reaches the caller as 500
        conn.send(("added", request_id, _picklable(e), None, 0))
        return
    live.add(request_id)
    conn.send(("added", request_id, None, seq.prompt_logprobs, len(prompt_token_ids)))


def _picklable(error: Exception) -> Exception:
    import pickle

    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return (ValueError if isinstance(error, ValueError) else RuntimeError)(f"{type(error).__name__}: {error}")
