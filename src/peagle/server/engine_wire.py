"""The wire between API servers and the engine process: length-prefixed frames over a Unix socket.

Engine to server, the hot direction: msgpack (msgspec) of one message per engine step carrying every output of the
step for that server's requests, token ids as packed integers and each struct as an array (no field names on the
wire). Server to engine: commands (add, abort) pickled, one per request, since a request's SamplingParams is a rich
object and adds are not per token.

The structs are not tracked by Python's cyclic garbage collector (`gc=False`: they hold no cycles): a server decodes
thousands a second, and each tracked one brings the next collection closer.

A frame is a 4-byte little-endian length and the payload. `FrameBuffer` cuts frames out of the bytes as they
arrive, so a reader never blocks on half a frame.
"""

from __future__ import annotations

import pickle
import struct

import msgspec

from peagle.engine.stats import EngineStats

_HEADER = struct.Struct("<I")

TokenLogprobsWire = tuple[int, float, int, list[tuple[int, float]]]  # engine.outputs.TokenLogprobs


class Metrics(msgspec.Struct, array_like=True, gc=False):
    """engine.outputs.RequestMetrics on the wire (the same fields, read by name on the server)."""

    num_drafting_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = []
    num_output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None
    num_cached_tokens: int = 0
    num_verified_tokens: int = 0


class Output(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """engine.outputs.StepOutput on the wire (the same fields; trailing defaults are left off)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    metrics: Metrics | None = None
    logprobs: list[TokenLogprobsWire] | None = None


class Step(msgspec.Struct, array_like=True, tag="s", gc=False):
    """One engine step's outputs for one API server's requests, and the engine's stats after it."""

    outputs: list[Output]
    stats: EngineStats


class Added(msgspec.Struct, array_like=True, tag="a", gc=False):
    """The engine took a request (`error` None) or refused it (`bad_input`: the request's fault, 400)."""

    request_id: str
    error: str | None = None
    bad_input: bool = False
    prompt_logprobs: list[TokenLogprobsWire] | None = None
    num_prompt_tokens: int = 0


class Failed(msgspec.Struct, array_like=True, tag="f", gc=False):
    """A step raised: the engine aborted every request it held and goes on serving."""

    error: str
    stats: EngineStats


class Idle(msgspec.Struct, array_like=True, tag="i", gc=False):
    """The engine has nothing to run (its stats, for the gauges and the stats log)."""

    stats: EngineStats


EngineMessage = Step | Added | Failed | Idle
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EngineMessage)


def output_of(out) -> Output:
    """A StepOutput as its wire struct."""
    m = out.metrics
    metrics = None if m is None else Metrics(m.num_drafting_rounds, m.num_draft_tokens, m.num_accepted_tokens,
                                             m.accepted_per_position, m.num_output_tokens, m.ttft_s, m.itl_s,
                                             m.e2e_s, m.num_cached_tokens, m.num_verified_tokens)
    return Output(out.request_id, out.new_token_ids, out.finished, out.finish_reason, out.error, metrics,
                  out.logprobs)


def joined(first, then):
    """Two consecutive outputs of one request as one, of the second's type (an Output, or a StepOutput: the same
    fields in the same order): the tokens (and logprobs) of both, the second's finish."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or []) + (then.logprobs or [])
    return type(then)(then.request_id, first.new_token_ids + then.new_token_ids, then.finished, then.finish_reason,
                      then.error, then.metrics, logprobs)


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


def engine_frame(message: EngineMessage) -> bytes:
    return frame(_encoder.encode(message))


def decode_engine_message(payload: bytes | memoryview) -> EngineMessage:
    return _decoder.decode(payload)


def command_frame(command: tuple) -> bytes:
    return frame(pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))


def decode_command(payload: bytes | memoryview) -> tuple:
    return pickle.loads(payload)


class FrameBuffer:
    """Bytes in, whole frames out: `feed(data)` returns the payloads that `data` completed, in order."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        frames, at = [], 0
        while len(buf) - at >= 4:
            (n,) = _HEADER.unpack_from(buf, at)
            if len(buf) - at - 4 < n:
                break
            frames.append(bytes(buf[at + 4:at + 4 + n]))
            at += 4 + n
        if at:
            del buf[:at]
        return frames
