"""CUDA graphs for decode steps, per (batch bucket, K), and for general steps, per (token bucket, request bucket, K).

A host launch of the 30-layer target costs ~20 ms eagerly on a slow host and ~3 ms replayed, so every decode step
of the common shape (one uncomputed token and K drafts per request) replays graphs. Batches are padded up to the
next bucket with dummy requests that write only the scratch KV block. Per bucket there are three graphs:
- greedy: the whole round (target verify forward, greedy verification, drafting) in one replay;
- target and drafting, replayed around the eager sampling verifier when any request samples.
K = 0 with a drafter is the adaptive policy's "speculation off": its graphs are plain steps, without drafting, and
two more per bucket ("greedy_resume", and "draft" at K = 0) hold the step that turns drafting back on.
Inputs arrive through two flat staging buffers (int64 and int32), one host-to-device copy each. With async
scheduling the next decode step's int64 inputs are built on the device (`load_next_inputs`): only the block tables
and two small per-request arrays cross, from pinned memory, so the copy does not wait for the step in flight.

General steps (prefills, prefill chunks, prefills beside decodes) replay `GeneralGraphs` when the engine is built
with `prefill_cuda_graphs` (the default): an eager step of the 30-layer target costs ~13 ms of host launches
whatever its size, so a short prompt's time to first token was mostly launch cost. See that class for its buckets and padding.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from peagle.engine.device_inputs import DeviceInputs

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# General steps: token buckets are powers of two from 16 to 128, then TOKEN_BUCKET_STEPS buckets per doubling (128,
# 160, 192, 224, 256, 320, ...) up to the step budget, capped (a larger step's compute dwarfs its launch cost, so it
# runs eagerly). A graphed step computes its whole bucket: at concurrency 64 and K=7 the decodes alone feed 512
# tokens, and a step that also admits a 75-token prompt would pad to 1,024 with powers of two, several times a
# decode round's cost; with four steps per doubling it pads to 640 (docs/DECISIONS.md). Request buckets reach 64, the
# default max_num_seqs: at high concurrency nearly every step admits a new prompt, and an eager step of 32-64
# requests costs several graphed ones.
TOKEN_BUCKET_MIN = 16
TOKEN_BUCKET_FINE_FROM = 128
TOKEN_BUCKET_STEPS = 4  # buckets per doubling from TOKEN_BUCKET_FINE_FROM (1: powers of two, the coarse ladder)
TOKEN_BUCKET_CAP = 2048
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_GENERAL_KEYS = 96  # (T, B, K) keys with graphs; steps of further keys run eagerly


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The one side stream of every capture on the current device. The caching allocator reuses a freed block only
    on the stream it was allocated on: with a stream of its own per capture (from a pool of 32), each warm-up's
    activations would stay cached apart."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[device]


def capture_graph(fn, pool, error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture `fn` after one warm-up call (it compiles kernels and settles the allocator) on a side stream."""
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream), torch.inference_mode():
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=error_mode):
                out = fn()
    finally:  # a failed capture falls back to an eager call, which must follow the warm-up too
        torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def target_into(runner, x: DeviceInputs, max_query_len: int, logits_out: torch.Tensor, aux: torch.Tensor | None,
                tokens: int, **kw):
    """A target graph's function: the forward over `x` writing its logits into `logits_out` and its aux rows into
    `aux[:tokens]` (the runner's shared outputs; None without aux layers); returns those two views."""
    aux_out = None if aux is None else aux[:tokens]

    def fn():
        _, new_aux = runner.target_forward(x, max_query_len, logits_out=logits_out, **kw)
        if aux_out is not None:
            aux_out.copy_(new_aux)
        return logits_out, aux_out
    return fn


class CudaGraphs:
    fused_greedy = True  # a greedy round replays as one graph ("greedy")

    def __init__(self, runner, max_num_seqs: int, ks: list[int]):
        self.runner = runner
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.ks = sorted(set(ks))
        bmax, kmax = self.buckets[-1], max(self.ks)
        self.width = runner.max_blocks_per_seq
        dev = runner.device
        tmax = bmax * (kmax + 1)
        self.i64 = torch.zeros(3 * tmax + bmax * kmax + bmax, dtype=torch.long, device=dev)
        self.i32 = torch.zeros(bmax + 1 + bmax * self.width, dtype=torch.int32, device=dev)
        self.next_rows = torch.zeros(2 * bmax, dtype=torch.long, device=dev)  # load_next_inputs: src, base
        pinned = dev.type == "cuda"
        self._stage32 = [torch.empty(len(self.i32), dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self._stage64 = [torch.empty(2 * bmax, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._flip = 0
        self.num_rejected = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.next_tokens = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.logits, self.aux = runner.graph_outputs(tmax, tmax)  # shared by every key's target graph
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[str, int, int], tuple[torch.cuda.CUDAGraph, object]] = {}
        self.current: tuple[int, int] = (bmax, kmax)
        self.resume = False  # graphs for resuming drafting at K = 0 (set by _capture_all)
        self._capture_all()

    def bucket_for(self, b: int) -> int:
        return next(x for x in self.buckets if x >= b)

    def can_run(self, seqs, drafts, k: int, draft: bool) -> bool:
        return self.fits(len(seqs), k, draft) and all(
            s.num_tokens - s.num_computed_tokens == 1 and len(d) == k for s, d in zip(seqs, drafts))

    def fits(self, b: int, k: int, draft: bool) -> bool:
        """Whether a decode step of b requests verifying k drafts each has graphs."""
        if k not in self.ks or b > self.buckets[-1]:
            return False
        if draft and k == 0 and not self.resume:  # `draft` implies a drafter
            return False  # drafting resumes and its graphs failed to capture: one eager step
        return True

    def _views(self, b: int, k: int) -> DeviceInputs:
        t = b * (k + 1)
        i64, i32 = self.i64, self.i32
        return DeviceInputs(input_ids=i64[:t], positions=i64[t:2 * t], slot_mapping=i64[2 * t:3 * t],
                            drafts=i64[3 * t:3 * t + b * k].view(b, k), num_drafts=i64[3 * t + b * k:3 * t + b * k + b],
                            query_start_loc=i32[:b + 1],
                            block_tables=i32[b + 1:b + 1 + b * self.width].view(b, self.width), logit_rows=None)

    def load_inputs(self, inp) -> DeviceInputs:
        b, k = len(inp.query_start_loc) - 1, inp.drafts.shape[1]
        self.current = (b, k)
        host64 = np.concatenate([inp.input_ids, inp.positions, inp.slot_mapping, inp.drafts.ravel(), inp.num_drafts])
        host32 = np.concatenate([inp.query_start_loc, inp.block_tables.ravel()])
        self.i64[:len(host64)].copy_(torch.from_numpy(host64), non_blocking=True)
        self.i32[:len(host32)].copy_(torch.from_numpy(host32), non_blocking=True)
        return self._views(b, k)

    def load_next_inputs(self, src: np.ndarray, base: np.ndarray, tables: np.ndarray, k: int):
        """The views of a decode step whose int64 inputs the caller builds on the device; query_start_loc, the
        block tables and (src [b], base [b]) for that build go up through pinned staging. A staging buffer is
        reused two loads later, after the engine has read the answer of the step that used it."""
        b = len(src)
        self.current = (b, k)
        self._flip ^= 1
        s32, s64 = self._stage32[self._flip], self._stage64[self._flip]
        n32 = b + 1 + tables.size
        h32 = s32.numpy()
        h32[:b + 1] = np.arange(b + 1, dtype=np.int32) * (k + 1)
        h32[b + 1:n32] = tables.ravel()
        h64 = s64.numpy()
        h64[:b], h64[b:2 * b] = src, base
        self.i32[:n32].copy_(s32[:n32], non_blocking=True)
        self.next_rows[:2 * b].copy_(s64[:2 * b], non_blocking=True)
        return self._views(b, k), self.next_rows[:b], self.next_rows[b:2 * b]

    def _replay(self, kind: str):
        graph, out = self.graphs[(kind, *self.current)]
        graph.replay()
        return out

    def run_greedy(self, num_real: int, draft: bool) -> torch.Tensor:
        """`draft`: the drafter runs this step (the caller's flag, false without a drafter)."""
        return self._replay("greedy_resume" if draft and self.current[1] == 0 else "greedy")[:num_real]

    def run_target(self):
        return self._replay("target")

    def run_proposer(self, num_rejected, next_tokens):
        b = self.current[0]
        self.num_rejected[:b].copy_(num_rejected)
        self.next_tokens[:b].copy_(next_tokens)
        return self._replay("draft")

    def _capture(self, key, fn):
        self.graphs[key] = capture_graph(fn, self.pool)
        return self.graphs[key][1]

    def _target_fn(self, b: int, k: int):
        t = b * (k + 1)
        return target_into(self.runner, self._views(b, k), k + 1, self.logits[:t], self.aux, t, all_rows=True)

    def _capture_all(self):
        r = self.runner
        # Largest first: a capture reuses the pool's blocks that the graphs before it freed.
        todo = [(b, k) for k in sorted(self.ks, reverse=True) for b in reversed(self.buckets)]
        before = torch.cuda.memory_reserved(r.device)
        for b, k in tqdm(todo, desc="capturing CUDA graphs", leave=False, disable=None):
            self._fill_dummy(b, k)
            x = self._views(b, k)
            self._capture(("greedy", b, k), lambda: r.greedy_step(x, k))
            logits, aux = self._capture(("target", b, k), self._target_fn(b, k))
            if r.proposer is not None and k > 0:
                nrej, nxt = self.num_rejected[:b], self.next_tokens[:b]
                self._capture(("draft", b, k), lambda: r.propose(x, aux, nrej, nxt, k + 1,
                                                                 num_drafts=r.draft_count(k)))
        if r.proposer is not None and 0 in self.ks:
            self.resume = self._capture_resume()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-ups' blocks, cached for the capture stream that no step runs on
        self.memory = torch.cuda.memory_reserved(r.device) - before  # bytes the captures took from the device
        logger.info("captured %d CUDA graphs (buckets %s, K %s; %.2f GiB)", len(self.graphs), self.buckets, self.ks,
                    self.memory / 2**30)

    def _capture_resume(self) -> bool:
        """Graphs for the step that turns drafting back on at K = 0 (no drafts yet, the drafter runs). Without them
        that step runs eagerly; a capture failure only costs that, so it is logged, not raised."""
        r = self.runner
        try:
            for b in reversed(self.buckets):
                self._fill_dummy(b, 0)
                x = self._views(b, 0)
                self._capture(("greedy_resume", b, 0), lambda: r.greedy_step(x, 0, draft=True))
                _, aux = self.graphs[("target", b, 0)][1]
                nrej, nxt = self.num_rejected[:b], self.next_tokens[:b]
                self._capture(("draft", b, 0), lambda: r.propose(x, aux, nrej, nxt, 1))
            return True
        except Exception as e:  # noqa: BLE001 - an eager resume step is slower, not wrong
            logger.warning("could not capture the graphs that resume drafting (%s: %s); that step runs eagerly",
                           type(e).__name__, e)
            for key in [key for key in self.graphs if key[0] == "greedy_resume" or key[:3:2] == ("draft", 0)]:
                del self.graphs[key]
            return False

    def _fill_dummy(self, b: int, k: int):
        r = self.runner
        bs = r.block_size
        x = self._views(b, k)
        rows = torch.arange(k + 1).repeat(b)
        x.input_ids.zero_()
        x.positions.copy_(rows)
        x.slot_mapping.copy_(r.scratch_block * bs + rows % bs)
        x.drafts.zero_()
        x.num_drafts.fill_(k)
        x.query_start_loc.copy_(torch.arange(b + 1, dtype=torch.int32) * (k + 1))
        x.block_tables.fill_(r.scratch_block)
        self.num_rejected[:b].zero_()
        self.next_tokens[:b].zero_()


def token_buckets(max_num_batched_tokens: int, steps_per_doubling: int | None = None) -> list[int]:
    """General steps' token buckets up to the step budget (see TOKEN_BUCKET_STEPS; default: its value now)."""
    steps = TOKEN_BUCKET_STEPS if steps_per_doubling is None else steps_per_doubling
    if steps < 1 or steps & (steps - 1):
        raise ValueError(f"steps_per_doubling must be a power of two >= 1, got {steps}")
    cap = min(max_num_batched_tokens, TOKEN_BUCKET_CAP)
    out = []
    t = TOKEN_BUCKET_MIN
    while t < cap:
        out.append(t)
        t += (1 << (t.bit_length() - 1)) // steps if t >= TOKEN_BUCKET_FINE_FROM else t  # a power of two's share
    return out + [cap]


def general_output_rows(max_num_batched_tokens: int, max_num_seqs: int, k: int) -> tuple[int, int]:
    """The logits rows and aux rows (tokens) that GeneralGraphs' largest key writes."""
    return request_buckets(max_num_seqs)[-1] * (k + 1), token_buckets(max_num_batched_tokens)[-1]


def request_buckets(max_num_seqs: int) -> list[int]:
    cap = min(max_num_seqs, REQUEST_BUCKETS[-1])
    return [b for b in REQUEST_BUCKETS if b < cap] + [cap]


class GeneralGraphs:
    """CUDA graphs for general steps, per (T tokens, B requests, K drafts verified at most per request).

    The paged attention kernel sizes its grid from max_query_len and B, and each program reads its request's rows
    from query_start_loc (tiles past a request's rows do nothing), so one graph captured at max_query_len = T serves
    every step of at most T fed tokens and B requests, whatever their split between prefills and decodes.
    `ModelRunner.pad_inputs` pads a step to its bucket: padding tokens belong to no request and write only the
    scratch KV block; padding requests are empty. A greedy step (no logits processing, logprobs or synthetic
    acceptance) replays one "greedy" graph per key: target, verification and drafter, as a greedy decode round does.
    Other steps replay a "target" graph (the target forward, logits at the verified rows) and, with a drafter, a
    "draft" graph, verification running eagerly between them. Those two write their outputs into static buffers
    shared by all keys; a greedy graph keeps its own packed answer (a few int64 a request). A key costs its graphs
    and, beyond that answer, no memory of its own outside the shared pool.

    Graphs are captured on a key's first use (a one-time cost of a few captures, logged), at most MAX_GENERAL_KEYS
    keys. `capture=False` (the CPU, tests) runs the same functions eagerly over the same padded static buffers.
    """

    fused_greedy = True  # a greedy step replays as one graph per key ("greedy"; "greedy_plain" without drafting)

    def __init__(self, runner, max_num_batched_tokens: int, max_num_seqs: int, *, pool=None, capture: bool = True):
        self.runner = runner
        self.token_buckets = token_buckets(max_num_batched_tokens)
        self.request_buckets = request_buckets(max_num_seqs)
        tmax, bmax, kmax = self.token_buckets[-1], self.request_buckets[-1], runner.k
        self.width = runner.max_blocks_per_seq
        dev = runner.device
        self.i64 = torch.zeros(3 * tmax + bmax * (2 * kmax + 3), dtype=torch.long, device=dev)
        self.i32 = torch.zeros(bmax + 1 + bmax * self.width, dtype=torch.int32, device=dev)
        self.num_rejected = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.next_tokens = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.logits, self.aux = runner.graph_outputs(*general_output_rows(max_num_batched_tokens, max_num_seqs, kmax))
        self.next_rows = torch.zeros(2 * bmax, dtype=torch.long, device=dev)  # load_inputs(..., next_rows): src, base
        pinned = dev.type == "cuda"  # staged loads: launched while a step is in flight (a pageable copy would wait)
        self._stage64 = [torch.empty(len(self.i64) + 2 * bmax, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._stage32 = [torch.empty(len(self.i32), dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self._flip = 0
        self.pool = pool
        self.capture = capture and dev.type == "cuda"
        self.graphs: dict[tuple[str, int, int, int], tuple[torch.cuda.CUDAGraph, object]] = {}
        self.captured: set[tuple[int, int, int]] = set()
        self.failed: set[tuple[int, int, int]] = set()
        self.current: tuple[int, int, int] | None = None

    def key_for(self, num_tokens: int, num_requests: int, k: int) -> tuple[int, int, int] | None:
        """The (T, B, K) bucket of a step, or None when it runs eagerly."""
        if num_tokens > self.token_buckets[-1] or num_requests > self.request_buckets[-1]:
            return None
        key = (next(t for t in self.token_buckets if t >= num_tokens),
               next(b for b in self.request_buckets if b >= num_requests), k)
        if key in self.failed or (key not in self.captured and len(self.captured) >= MAX_GENERAL_KEYS):
            return None
        return key

    def _views(self, key: tuple[int, int, int]) -> DeviceInputs:
        t, b, k = key
        sizes = (t, t, t, b * (k + 1), b * k, b, b)
        ids, pos, slots, rows, drafts, nd, chunk_next = self.i64[:sum(sizes)].split(sizes)
        qsl, tables = self.i32[:b + 1 + b * self.width].split((b + 1, b * self.width))
        return DeviceInputs(input_ids=ids, positions=pos, slot_mapping=slots, logit_rows=rows,
                            drafts=drafts.view(b, k), num_drafts=nd, chunk_next=chunk_next, query_start_loc=qsl,
                            block_tables=tables.view(b, self.width))

    def load_inputs(self, inp, key: tuple[int, int, int], next_rows: tuple[np.ndarray, np.ndarray] | None = None):
        """`inp`, padded to `key` (`ModelRunner.pad_inputs`), into the static buffers: two host-to-device copies.

        With `next_rows` (src, base of `kernels.advance_decode_inputs`, for a step launched while another is in
        flight) the copies go through pinned staging, so the host does not wait for the step in flight, and the
        two arrays come up too: returns (views, src, base) on the device. A staging buffer is reused two staged
        loads later, after the engine has read the answer of the step that used it."""
        t, b, _ = key
        assert len(inp.input_ids) == t and len(inp.query_start_loc) == b + 1, (key, inp.max_query_len)
        self.current = key
        parts64 = [inp.input_ids, inp.positions, inp.slot_mapping, inp.logit_rows.ravel(), inp.drafts.ravel(),
                   inp.num_drafts, inp.chunk_next]
        if next_rows is None:
            host64 = np.concatenate(parts64)
            host32 = np.concatenate([inp.query_start_loc, inp.block_tables.ravel()])
            self.i64[:len(host64)].copy_(torch.from_numpy(host64), non_blocking=True)
            self.i32[:len(host32)].copy_(torch.from_numpy(host32), non_blocking=True)
            return self._views(key)
        self._flip ^= 1
        s64, s32 = self._stage64[self._flip], self._stage32[self._flip]
        h64, h32 = s64.numpy(), s32.numpy()
        n64 = sum(len(a) for a in parts64)
        np.concatenate(parts64, out=h64[:n64])
        src, base = next_rows
        h64[n64:n64 + len(src)], h64[n64 + len(src):n64 + 2 * len(src)] = src, base
        n32 = b + 1 + inp.block_tables.size
        h32[:b + 1], h32[b + 1:n32] = inp.query_start_loc, inp.block_tables.ravel()
        self.i64[:n64].copy_(s64[:n64], non_blocking=True)
        self.next_rows[:2 * len(src)].copy_(s64[n64:n64 + 2 * len(src)], non_blocking=True)
        self.i32[:n32].copy_(s32[:n32], non_blocking=True)
        return self._views(key), self.next_rows[:len(src)], self.next_rows[len(src):2 * len(src)]

    def run_greedy(self, num_real: int, draft: bool) -> torch.Tensor:
        """The packed answer of a greedy step (`ModelRunner.general_greedy_step`) for its num_real requests."""
        return self._replay("greedy" if draft else "greedy_plain", self._greedy_fn(draft))[:num_real]

    def run_target(self):
        return self._replay("target", self._target_fn)

    def run_proposer(self, num_rejected, next_tokens):
        b = self.current[1]
        self.num_rejected[:b].copy_(num_rejected)
        self.next_tokens[:b].copy_(next_tokens)
        return self._replay("draft", self._draft_fn)

    def _target_fn(self, t: int, b: int, k: int):
        return target_into(self.runner, self._views((t, b, k)), t, self.logits[:b * (k + 1)], self.aux, t,
                           small_query_len=k + 1)

    def _greedy_fn(self, draft: bool):
        def make(t: int, b: int, k: int):
            x = self._views((t, b, k))
            return lambda: self.runner.general_greedy_step(x, t, k, draft)
        return make

    def _draft_fn(self, t: int, b: int, k: int):
        x = self._views((t, b, k))
        aux, nrej, nxt = self.aux[:t], self.num_rejected[:b], self.next_tokens[:b]
        return lambda: self.runner.propose(x, aux, nrej, nxt, t, small_query_len=k + 1,
                                           num_drafts=self.runner.draft_count(k))

    def _replay(self, kind: str, make_fn):
        key = self.current
        if (kind, *key) in self.graphs:
            graph, out = self.graphs[(kind, *key)]
            graph.replay()
            return out
        fn = make_fn(*key)
        if not self.capture or key in self.failed:
            return fn()
        start = time.perf_counter()
        try:
            # Captured while serving: other threads (an HTTP server's) may call CUDA meanwhile, which only this
            # thread's capture must not see.
            graph, out = capture_graph(fn, self.pool, error_mode="thread_local")
        except Exception as e:  # noqa: BLE001 - an eager step is slower, not wrong
            logger.warning("could not capture the %s graph of general steps %s (%s: %s); they run eagerly",
                           kind, key, type(e).__name__, e)
            self.failed.add(key)
            return fn()
        self.graphs[(kind, *key)] = (graph, out)
        self.captured.add(key)
        logger.info("captured the %s CUDA graph of general steps of %d tokens, %d requests, K=%d in %.0f ms",
                    kind, *key, 1e3 * (time.perf_counter() - start))
        graph.replay()
        return out
