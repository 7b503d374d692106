"""The engine in a process of its own (the default of `peagle serve`, as vLLM runs its engine core): the API
servers' Python (HTTP, detokenising, streaming) and the engine's host loop stop sharing one GIL.

`EngineProcess.start(config, num_api_servers=N)` spawns a child that builds the engine and runs `EngineLoop`: between
steps it reads commands (add, abort) from one Unix socket per API server, and after each step it sends each API
server one message with all of that server's outputs and the engine's stats (`engine_wire`); to a server that has
not taken the last message yet, the next steps' outputs go joined per request in one message once it has. The parent
holds an
`EngineProcess`, which answers what the server reads of an engine (tokenizer, EOS ids, max_model_len, config,
model_config, K, stats) without loading the weights; `engine_client.ProcessAsyncEngine` drives it from the event
loop.

Lifetimes follow the sockets: an API server that goes away (its socket closes) has its requests aborted, and the
engine process exits once every API server has gone. It ignores SIGINT and SIGTERM (the API servers drain first and
then close their sockets). If a step raises, the engine aborts every request it holds, reports the failure (the
servers answer 500 for those requests) and goes on. A structured-output grammar compiled in a server (for its
tokenizer, possibly to start after the reasoning's end) travels as its request and start, and the child compiles it
again for its own tokenizer.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import select
import socket
import time

from peagle.server import engine_wire as wire

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800.0  # a large model's load and CUDA graph capture
SEND_BUFFER_BYTES = 16 << 10  # the engine's side of each server's socket: a few steps of 64 outputs


class EngineProcessError(RuntimeError):
    """The engine process could not start (its error, as the child raised it)."""


class EngineProcess:
    """An API server's handle on the engine process: `sock` reaches it; `process` is set in the process that
    started it (the one that stops it)."""

    remote = True  # create_app drives it with ProcessAsyncEngine

    def __init__(self, sock: socket.socket, config, info: dict, process=None):
        self.sock = sock
        self.process = process
        self.config = config
        self.info = info
        self.tokenizer = info["tokenizer"]
        self.eos_token_ids = info["eos_token_ids"]
        self.max_model_len = info["max_model_len"]
        self.model_config = info["model_config"]
        self.k = info["k"]
        self.last_stats = info["stats"]

    @classmethod
    def start(cls, config, tokenizer: str | None = None, timeout_s: float = READY_TIMEOUT_S,
              engine_factory=None, num_api_servers: int = 1) -> tuple["EngineProcess", list[socket.socket]]:
        """Spawns the engine process for `config` (an EngineConfig; `tokenizer`: another directory's tokenizer, as
        LLMEngine.use_tokenizer; `engine_factory`: what builds the engine from the config, LLMEngine by default)
        and waits until its engine is built. Returns the handle for the first API server and the sockets of the
        others. If it fails: ValueError with the child's error where that was a ValueError or a missing file (bad
        input), else EngineProcessError."""
        if num_api_servers < 1:
            raise ValueError(f"num_api_servers must be >= 1, got {num_api_servers}")
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        pairs = [socket.socketpair() for _ in range(num_api_servers)]
        process = ctx.Process(target=_child_main, args=([c for _, c in pairs], config, tokenizer, engine_factory),
                              name="peagle-engine", daemon=True)
        process.start()
        for _, child_end in pairs:
            child_end.close()  # the child's copies only, so that its death reads as EOF here
        ours = [p for p, _ in pairs]
        # closed before multiprocessing joins its children at exit: the engine exits on its sockets' EOF
        atexit.register(_close_sockets, ours)
        try:
            kind, payload = _handshake(ours[0], process, timeout_s)
        except BaseException:
            process.kill()
            process.join(5)
            for s in ours:
                s.close()
            raise
        if kind != "ready":
            process.join(5)
            for s in ours:
                s.close()
            message, bad_input = payload
            # a bad model directory or option: the ValueError the engine thread would have raised, for a clean message
            raise (ValueError if bad_input else EngineProcessError)(f"the engine process failed to start: {message}")
        return cls(ours[0], config, payload, process), ours[1:]

    def stats(self):
        return self.last_stats

    def has_unfinished_requests(self) -> bool:
        return self.last_stats.num_running + self.last_stats.num_waiting > 0

    def close(self, timeout_s: float = 30.0):
        """Closes this server's socket; where this process started the engine, waits for it to exit (it does once
        every server's socket is closed) and kills it if it does not."""
        try:
            self.sock.close()
        except OSError:
            pass
        if self.process is None:
            return
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("the engine process did not exit in %g s; killing it", timeout_s)
            self.process.kill()
            self.process.join(5)


def _close_sockets(socks: list[socket.socket]):
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


def _handshake(sock: socket.socket, process, timeout_s: float) -> tuple[str, object]:
    """The child's first frame (ready, or its start-up error), waited for up to `timeout_s`."""
    frames, deadline = wire.FrameBuffer(), time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise EngineProcessError(f"the engine process did not become ready in {timeout_s:g} s")
        if not select.select([sock], [], [], min(left, 1.0))[0]:
            if not process.is_alive():
                raise EngineProcessError(f"the engine process exited while starting (exit code {process.exitcode})")
            continue
        data = sock.recv(1 << 20)
        if not data:
            process.join(5)
            raise EngineProcessError(f"the engine process exited while starting (exit code {process.exitcode})")
        got = frames.feed(data)
        if got:
            return wire.decode_command(got[0])


# ---- the child ---------------------------------------------------------------------------------------------------

def _child_main(socks: list[socket.socket], config, tokenizer: str | None, engine_factory):
    import signal

    # Ctrl-C and a SIGTERM to the process group reach this process too: the servers drain first, then close their
    # sockets, and this process exits then (or is killed by the one that started it, after its deadline)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if engine_factory is None:
            from peagle.engine.llm_engine import LLMEngine as engine_factory
        engine = engine_factory(config)
        if tokenizer is not None:
            from peagle.models.loader import load_tokenizer

            engine.use_tokenizer(load_tokenizer(tokenizer))
        info = {"tokenizer": engine.tokenizer, "eos_token_ids": engine.eos_token_ids,
                "max_model_len": engine.max_model_len, "model_config": engine.model_config, "k": engine.k,
                "stats": engine.stats()}
    except BaseException as e:
        socks[0].sendall(wire.command_frame(("error", (f"{type(e).__name__}: {e}",
                                                       isinstance(e, (ValueError, FileNotFoundError))))))
        return
    socks[0].sendall(wire.command_frame(("ready", info)))
    freeze_startup_heap()
    from peagle.kernels.compile_watch import WATCH

    WATCH.serving()  # a kernel compiled from here on stalls the requests in its step: each is logged
    EngineLoop(engine, socks).run()


def freeze_startup_heap():
    """Moves every object alive now (the model, the tokenizer, the web stack) out of the cyclic garbage collector's
    reach, so that the collections that serving's allocations trigger do not walk them again and again. Undone at
    exit, so that the interpreter's last collection still frees them (extension modules check for leaks then)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


class _Client:
    """One API server: its socket, the frames it has half sent, its requests inside the engine, and what is still to
    go to it: outputs not yet encoded (joined per request) and encoded bytes its socket has not taken."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.frames = wire.FrameBuffer()
        self.live: set[str] = set()
        self.pending: dict[str, wire.Output] = {}
        self.stats: wire.EngineStats | None = None  # the engine's, after the step that gave the pending outputs
        self.unsent = bytearray()
        self.polling_out = False  # the poller wakes the loop when the socket takes more

    def hold(self, out: wire.Output):
        before = self.pending.get(out.request_id)
        self.pending[out.request_id] = out if before is None else wire.joined(before, out)

    def encode_pending(self):
        if self.pending:
            self.unsent += wire.engine_frame(wire.Step(list(self.pending.values()), self.stats))
            self.pending.clear()


class EngineLoop:
    """The engine process's loop: commands from every API server between steps, and after a step one message per
    server with its outputs. A server whose socket has not taken the last message yet (it is behind) gets the outputs
    of the steps meanwhile joined per request into its next one: it decodes one message for them all, and the engine
    never waits for a slow server."""

    def __init__(self, engine, socks: list[socket.socket]):
        self.engine = engine
        self.clients: dict[int, _Client] = {}
        self.owner: dict[str, _Client] = {}  # request id: the server that sent it
        self.poller = select.poll()
        for sock in socks:
            sock.setblocking(False)
            # a short queue in the kernel, so that a server that is behind gets joined outputs rather than a backlog
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            self.clients[sock.fileno()] = _Client(sock)
            self.poller.register(sock.fileno(), select.POLLIN)

    def run(self):
        stepped = False
        while self.clients:
            busy = self.engine.has_unfinished_requests()
            commands = False
            for fd, events in self.poller.poll(0 if busy else None):
                client = self.clients.get(fd)
                if client is not None and events & select.POLLOUT:
                    self._flush(client)
                if client is not None and events & ~select.POLLOUT:
                    self._read(client)
                    commands = True
            if self.engine.has_unfinished_requests():
                self._step()
                stepped = True
            elif self.clients and (commands or stepped):  # gone idle, or commands that left it idle
                self._broadcast(wire.Idle(self.engine.stats()))
                stepped = False

    def _read(self, client: _Client):
        try:
            data = client.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the server went away: its requests go with it
            self._drop(client)
            return
        for payload in client.frames.feed(data):
            command = wire.decode_command(payload)
            if command[0] == "add":
                self._add(client, *command[1:])
            elif command[0] == "abort":
                self._abort(command[1])
            else:
                logger.error("unknown command %r", command[0])

    def _drop(self, client: _Client):
        for request_id in client.live:
            self.engine.abort_request(request_id)
            self.owner.pop(request_id, None)
        fd = client.sock.fileno()
        if fd in self.clients:
            self.poller.unregister(fd)
            del self.clients[fd]
        client.sock.close()

    def _add(self, client: _Client, request_id: str, prompt_token_ids: list[int], params, starts_after):
        try:
            if params.structured_outputs is not None and starts_after is not None:
                from peagle.engine.structured_output import with_grammar

                params = with_grammar(params, self.engine.tokenizer, self.engine.model_config.vocab_size,
                                      starts_after)
            seq = self.engine.add_request(request_id, prompt_token_ids, params)
        except Exception as e:  # ValueError: the request's fault (400); anything else reaches the caller as 500
            bad = isinstance(e, ValueError)
            self._send(client, wire.Added(request_id, str(e) if bad else f"{type(e).__name__}: {e}", bad))
            return
        client.live.add(request_id)
        self.owner[request_id] = client
        self._send(client, wire.Added(request_id, None, False, seq.prompt_logprobs, len(prompt_token_ids)))

    def _abort(self, request_id: str):
        client = self.owner.pop(request_id, None)
        if client is not None:
            client.live.discard(request_id)
            client.pending.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _step(self):
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed")
            for request_id in self.owner:
                self.engine.abort_request(request_id)
            self.owner.clear()
            for client in self.clients.values():
                client.live.clear()
            self._broadcast(wire.Failed(f"{type(e).__name__}: {e}", self.engine.stats()))
            return
        touched = {}
        for out in outputs:
            client = self.owner.get(out.request_id)
            if client is None:  # aborted meanwhile
                continue
            if out.finished:
                del self.owner[out.request_id]
                client.live.discard(out.request_id)
            touched[id(client)] = client
            client.hold(wire.output_of(out))
        stats = self.engine.stats()
        for client in touched.values():
            client.stats = stats
            self._flush(client)

    def _broadcast(self, message):
        for client in list(self.clients.values()):
            self._send(client, message)

    def _send(self, client: _Client, message):
        """A message after the outputs still pending for the server (so that it reads them in order)."""
        client.encode_pending()
        client.unsent += wire.engine_frame(message)
        self._flush(client)

    def _flush(self, client: _Client):
        """Sends what the server's socket takes now: what it has not taken yet, else the pending outputs."""
        while True:
            if not client.unsent:
                client.encode_pending()
            if not client.unsent:
                break
            try:
                sent = client.sock.send(client.unsent)
            except BlockingIOError:
                break
            except OSError:  # the server went away; its socket reads as closed next
                client.unsent.clear()
                client.pending.clear()
                return
            del client.unsent[:sent]
            if client.unsent:
                break
        waiting = bool(client.unsent or client.pending)
        if waiting != client.polling_out and client.sock.fileno() in self.clients:
            self.poller.modify(client.sock, select.POLLIN | (select.POLLOUT if waiting else 0))
            client.polling_out = waiting
