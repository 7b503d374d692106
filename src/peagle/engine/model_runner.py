"""The only place where scheduled sequences become tensors.

One step: the target verifies every request's fed tokens (uncomputed tokens plus drafts) in one forward, the verifier
accepts drafts losslessly, and the proposer drafts the next K tokens from the verified batch. Pure decode steps of
the common shape replay CUDA graphs (cuda_graph.py); with prefill graphs on, so do general steps (prefills, chunks,
prefills beside decodes) up to a token and request bucket, padded by `pad_inputs`; everything else runs eagerly
through the same functions.

A step is launched (`launch`, from the host's sequences) and answered later (`StepHandle.result()`, the step's one
device-to-host copy); `execute` does both. With async scheduling the engine launches the next decode step before
the answer arrives (`launch_next`: its inputs are built on the device from the step in flight), and the answer
comes back through pinned buffers marked by events, so the host waits only when it needs the tokens.

With a draft confidence cutoff (`DraftPlanner.confident`) the proposer answers each request's unconfident drafts as
PAD_DRAFT (spec/confidence.py), the host keeps the confident ones, and steps feed only those: a step built on the
host lays requests out as they are (general steps and their graphs), one launched ahead packs them on the device
into a budget of rows (`launch_compact`), so the target computes only the drafts it verifies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from peagle import kernels
from peagle.engine.attention import (AttentionMetadata, AttentionOptions, PagedAttention, allocate_kv_cache,
                                     kv_bytes_per_block, uniform_kv)
from peagle.engine.device_inputs import DeviceInputs
from peagle.engine.draft_plan import PAD_DRAFT, DraftPlan, DraftPlanner
from peagle.engine.sampler import (SamplingTensors, exponential_like, process_logits, target_probs, token_logprobs,
                                   uniform_like)
from peagle.engine.spec.proposer import DraftInputs, Proposer
from peagle.engine.spec.verifier import verify_greedy, verify_sampled, verify_synthetic
from peagle.models.attention import DenseAttention

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """Host-built arrays for one step of B requests and T fed tokens (padded to a graph bucket when graphed)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    logit_rows: np.ndarray  # [B, k + 1] rows whose target logits verify (the last num_drafts + 1 of each request)
    drafts: np.ndarray  # [B, k] int64
    num_drafts: np.ndarray  # [B] int64
    max_query_len: int
    num_real: int  # requests before padding
    chunk_next: np.ndarray | None = None  # [B] int64 the prompt token after a prefill chunk, -1 for the others


@dataclass
class StepResult:
    output_tokens: list[list[int]]  # per request: accepted drafts then the next token
    num_accepted: list[int]
    drafts: list[list[int]]  # per request: the next round's K drafts, PAD_DRAFT past its confident ones ([]: none)
    num_verified: list[int]  # per request: the drafts this step verified (pads aside)
    # per request asking for logprobs, one (token id, logprob, rank, [(id, logprob)] top) per output token; else None
    logprobs: list[list[tuple] | None] | None = None


@dataclass
class StepHandle:
    """A launched step whose answer is on its way to the host. The packed answer stays on the device, where the
    next step's inputs can be built from it before the host has seen it (async scheduling)."""

    packed: torch.Tensor  # [B, (k + 1) + 1 + D + 1] int64: output tokens (-1 after), number accepted, D next
    # drafts, number of drafts verified
    k: int  # drafts verified per request at most (the step's layout)
    host: torch.Tensor | None = None  # pinned copy of packed, complete once `ready` passed
    ready: torch.cuda.Event | None = None
    finish: Callable[[StepResult], None] | None = None  # host work on the answer (logprobs)

    @property
    def num_drafts(self) -> int:
        """D: drafts proposed per request (0 when the drafter did not run)."""
        return self.packed.shape[1] - self.k - 3

    def result(self) -> StepResult:
        if self.ready is None:
            rows = self.packed.cpu().tolist()  # the step's one host synchronisation
        else:
            self.ready.synchronize()
            rows = self.host.tolist()
        result = _unpack(rows, self.k)
        if self.finish is not None:
            self.finish(result)
        return result


class ModelRunner:
    """Runs steps on the device, drafting as each step's DraftPlan says (`planner`: the engine's K and its
    adaptive policy); complete when constructed: CUDA graphs (`cuda_graphs`, CUDA only; with `prefill_cuda_graphs`
    general steps' too) captured over `planner.graph_ks()`, answers copied back through pinned buffers with
    `async_copies`."""

    def __init__(self, target, drafter, proposer_cls, *, planner: DraftPlanner, block_size: int, num_blocks: int,
                 max_model_len: int, device: torch.device, dtype: torch.dtype, attention: AttentionOptions,
                 max_num_seqs: int, max_num_batched_tokens: int,
                 synthetic_acceptance: tuple[float, ...] | None = None, cuda_graphs: bool = False,
                 prefill_cuda_graphs: bool = False, async_copies: bool = False):
        self.target = target
        self.drafter = drafter
        self.planner = planner
        self.k = planner.k if drafter is not None else 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks  # one extra block that padding requests of a graph bucket write into
        # the draft confidence cutoff the proposer reads (graphs too), set per step (`set_cutoff`); None: not cut
        self.cutoff = (torch.zeros((), dtype=torch.float32, device=device)
                       if planner.confident and drafter is not None else None)
        self._cutoff_value = 0.0
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.attention = attention
        self.max_blocks_per_seq = -(-(max_model_len + 2 * self.k + 1) // block_size)
        self.target_kv = allocate_kv_cache(target.kv_layers(), num_blocks + 1, block_size, dtype, device)
        self.aux_layer_ids = None
        self.proposer: Proposer | None = None
        if drafter is not None:
            dcfg = drafter.config.transformer_layer_config
            self.aux_layer_ids = tuple(drafter.config.aux_layer_ids)
            draft_kv = allocate_kv_cache(uniform_kv(drafter.config.num_layers, dcfg.num_key_value_heads,
                                                    dcfg.head_dim), num_blocks + 1, block_size, dtype, device)
            self.proposer = proposer_cls(drafter, draft_kv, block_size, self.k, attention=attention)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.graphs = None  # CudaGraphs: decode steps (cuda_graphs on CUDA)
        self.general_graphs = None  # GeneralGraphs: general steps (with prefill_cuda_graphs too)
        self.synthetic_acceptance = synthetic_acceptance  # benchmarking only (see EngineConfig)
        self._pinned: list[torch.Tensor] | None = None  # async answers: two pinned buffers and their events
        self._events: list[torch.cuda.Event] = []
        self._flip = 0
        self._graph_outputs: tuple[torch.Tensor, torch.Tensor | None] | None = None
        if cuda_graphs and device.type == "cuda":  # captured last: their functions read everything set above
            from peagle.engine.cuda_graph import CudaGraphs, general_output_rows

            kmax = max(planner.graph_ks())
            rows, tokens = max_num_seqs * (kmax + 1), max_num_seqs * (kmax + 1)
            if prefill_cuda_graphs:  # sized once for both kinds of graphs, so the buffers never grow
                g_rows, g_tokens = general_output_rows(max_num_batched_tokens, max_num_seqs, self.k)
                rows, tokens = max(rows, g_rows), max(tokens, g_tokens)
            self.graph_outputs(rows, tokens)
            self.graphs = CudaGraphs(self, max_num_seqs, planner.graph_ks())
            if prefill_cuda_graphs:
                self.general_graphs = self.build_general_graphs()
        if async_copies:
            self._enable_async_copies()

    def graph_outputs(self, logit_rows: int, aux_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The static logits [>= logit_rows, V] (fp32) and aux [>= aux_rows, F] (None without aux layers) that every
        graph of this runner copies its target outputs into. Outputs that each graph kept would stay allocated as
        long as the graph: over the decode buckets of a 152K-token vocabulary, several GiB beyond the KV budget.
        A request for more rows than the buffers hold replaces them (graphs captured before keep the old ones)."""
        have = self._graph_outputs
        aux_width = len(self.aux_layer_ids or ()) * self.target.config.hidden_size
        if have is None or have[0].shape[0] < logit_rows or (have[1] is not None and have[1].shape[0] < aux_rows):
            if have is not None:
                logit_rows = max(logit_rows, have[0].shape[0])
                aux_rows = max(aux_rows, 0 if have[1] is None else have[1].shape[0])
            logits = torch.zeros(logit_rows, self.target.config.vocab_size, dtype=torch.float32, device=self.device)
            aux = (torch.zeros(aux_rows, aux_width, dtype=self.dtype, device=self.device) if aux_width else None)
            self._graph_outputs = have = (logits, aux)
        return have

    def build_general_graphs(self, capture: bool = True):
        """Graphs for general steps, sharing the decode graphs' memory pool. capture=False runs their functions
        eagerly over the same padded static buffers (the padding's path on the CPU)."""
        from peagle.engine.cuda_graph import GeneralGraphs

        pool = self.graphs.pool if self.graphs is not None else None
        return GeneralGraphs(self, self.max_num_batched_tokens, self.max_num_seqs, pool=pool, capture=capture)

    def _enable_async_copies(self):
        """Answers come back through two pinned host buffers, each copy marked by an event (CUDA only): the host
        launches the next step before it waits for the one in flight. Two suffice: the engine reads an answer
        before it launches the step after next."""
        if self.device.type != "cuda":
            return
        n = self.max_num_seqs * (2 * self.k + 3)
        self._pinned = [torch.empty(n, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)]

    def set_cutoff(self, value: float) -> None:
        """The draft confidence cutoff of the steps launched from now on (a device write only when it changes; it
        follows the step in flight on the stream)."""
        if self.cutoff is not None and value != self._cutoff_value:
            self.cutoff.fill_(value)
            self._cutoff_value = value

    # ---- sizing -------------------------------------------------------------------------------------------------

    @staticmethod
    def kv_block_bytes(target, drafter, block_size: int, dtype: torch.dtype) -> int:
        n = kv_bytes_per_block(target.kv_layers(), block_size, dtype)
        if drafter is not None:
            d = drafter.config.transformer_layer_config
            n += kv_bytes_per_block(uniform_kv(drafter.config.num_layers, d.num_key_value_heads, d.head_dim),
                                    block_size, dtype)
        return n

    # ---- host side: sequences -> arrays -------------------------------------------------------------------------

    def build_inputs(self, seqs, drafts: list[list[int]], k: int, pad_to: int | None = None,
                     chunks: list[int] | None = None) -> StepInputs:
        """`chunks`: tokens each request feeds when some prefill is chunked (else every whole uncomputed span)."""
        if chunks is None and all(s.num_tokens - s.num_computed_tokens == 1 and len(d) == k
                                  for s, d in zip(seqs, drafts)):
            return self._build_decode_inputs(seqs, drafts, k, pad_to or len(seqs))
        return self._build_general_inputs(seqs, drafts, k, pad_to, chunks)

    def _build_general_inputs(self, seqs, drafts: list[list[int]], k: int, pad_to: int | None,
                              chunks: list[int] | None = None) -> StepInputs:
        """Any mix of prefills (whole uncomputed spans, or chunks of them) and decodes with up to k drafts.

        Request b feeds `token_ids[num_computed_tokens:]` and its drafts (or the first chunks[b] of them) at the
        positions after its computed tokens; graph-bucket padding requests feed k + 1 rows into the scratch block.
        Vectorised over the requests: only prefills (more than one uncomputed token) copy their spans one by one,
        so a step that admits one prompt among 64 decodes costs the host about what a decode step does."""
        bs, n = self.block_size, len(seqs)
        b_all = pad_to or n
        tables = np.full((b_all, self.max_blocks_per_seq), self.scratch_block, dtype=np.int32)
        start = np.zeros(b_all, dtype=np.int64)  # padding requests sit at positions 0..k of the scratch block
        span = np.ones(b_all, dtype=np.int64)  # uncomputed tokens fed (padding: one row, then k "drafts")
        last = np.zeros(b_all, dtype=np.int64)
        for b, seq in enumerate(seqs):
            table = seq.block_table
            tables[b, :len(table)] = table
            start[b] = seq.num_computed_tokens
            span[b] = seq.num_tokens - start[b]
            last[b] = seq.token_ids[-1]
        nd = np.full(b_all, k, dtype=np.int64)
        drafts_arr = np.zeros((b_all, k), dtype=np.int64)
        for b, d in enumerate(drafts):
            nd[b] = len(d)
            drafts_arr[b, :len(d)] = d
        lens = span + nd
        chunk_next = None
        if chunks is not None:  # a prefill chunk feeds its first chunks[b] tokens; the drafter reads the next one
            chunk_next = np.full(b_all, -1, dtype=np.int64)
            for b, c in enumerate(chunks):
                if c < lens[b]:
                    assert not drafts[b], seqs[b]
                    lens[b] = c
                    chunk_next[b] = seqs[b].token_ids[start[b] + c]
        qsl = np.zeros(b_all + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        total = int(qsl[-1])
        req = np.repeat(np.arange(b_all), lens)  # each row's request
        offset = np.arange(total, dtype=np.int64) - qsl[:-1].astype(np.int64)[req]  # row index within its request
        pos = start[req] + offset
        # ids: a request's uncomputed span, then its drafts; one uncomputed token is its last token
        ids = np.where(offset == 0, last[req], 0)
        is_draft = offset >= span[req]
        ids[is_draft] = drafts_arr[req[is_draft], (offset - span[req])[is_draft]]
        for b in np.flatnonzero(span[:n] > 1):  # prefills: their spans, copied
            m = min(int(span[b]), int(lens[b]))
            ids[qsl[b]:qsl[b] + m] = seqs[b].token_ids[start[b]:start[b] + m]
        slots = tables[req, pos // bs].astype(np.int64) * bs + pos % bs
        # The last num_drafts + 1 rows of each request verify; shorter requests repeat their last row.
        j = np.arange(k + 1)[None, :]
        first = qsl[1:, None] - (nd[:, None] + 1)
        rows = np.minimum(first + j, qsl[1:, None] - 1)
        return StepInputs(
            input_ids=ids, positions=pos, slot_mapping=slots, query_start_loc=qsl, block_tables=tables,
            logit_rows=rows.astype(np.int64), drafts=drafts_arr, num_drafts=nd, max_query_len=int(lens.max()),
            num_real=n, chunk_next=chunk_next,
        )

    def _build_decode_inputs(self, seqs, drafts: list[list[int]], k: int, b: int) -> StepInputs:
        """The common decode step, vectorised: every request feeds its last token and k drafts (k + 1 rows)."""
        n, bs = len(seqs), self.block_size
        tables = np.full((b, self.max_blocks_per_seq), self.scratch_block, dtype=np.int32)
        ids = np.zeros((b, k + 1), dtype=np.int64)
        start = np.zeros(b, dtype=np.int64)  # padding requests sit at positions 0..k of the scratch block
        for i, seq in enumerate(seqs):
            table = seq.block_table
            tables[i, :len(table)] = table
            ids[i, 0] = seq.token_ids[-1]
            start[i] = seq.num_computed_tokens
        drafts_arr = np.zeros((b, k), dtype=np.int64)
        if k and n:
            drafts_arr[:n] = drafts
            ids[:n, 1:] = np.maximum(drafts_arr[:n], 0)  # a PAD_DRAFT feeds token 0
        pos = start[:, None] + np.arange(k + 1)  # [b, k + 1]
        slots = tables[np.arange(b)[:, None], pos // bs].astype(np.int64) * bs + pos % bs
        qsl = np.arange(b + 1, dtype=np.int32) * (k + 1)
        rows = np.arange(b * (k + 1), dtype=np.int64).reshape(b, k + 1)
        return StepInputs(
            input_ids=ids.reshape(-1), positions=pos.reshape(-1), slot_mapping=slots.reshape(-1),
            query_start_loc=qsl, block_tables=tables, logit_rows=rows, drafts=drafts_arr,
            num_drafts=np.full(b, k, dtype=np.int64), max_query_len=k + 1, num_real=n,
        )

    def pad_inputs(self, inp: StepInputs, t: int, b: int) -> StepInputs:
        """`inp` (unpadded) padded to a general graph's bucket of t tokens and b requests, at max_query_len t.

        Padding tokens follow the real ones and belong to no request (rows past query_start_loc[-1]: attention
        neither reads nor writes them, the draft batch gives them no KV); their KV goes to the scratch block.
        Padding requests are empty spans at the end, verify no drafts and take their logits from the last real row.
        """
        n, num_req, k = len(inp.input_ids), len(inp.query_start_loc) - 1, inp.drafts.shape[1]
        assert n <= t and num_req <= b and inp.num_real == num_req, (n, t, num_req, b)
        fill = np.arange(t - n, dtype=np.int64) % self.block_size  # positions and slots inside the scratch block
        extra = b - num_req
        tables = np.full((b, self.max_blocks_per_seq), self.scratch_block, dtype=np.int32)
        tables[:num_req] = inp.block_tables
        chunk_next = np.full(b, -1, dtype=np.int64)
        if inp.chunk_next is not None:
            chunk_next[:num_req] = inp.chunk_next
        return StepInputs(
            input_ids=np.concatenate([inp.input_ids, np.zeros(t - n, dtype=np.int64)]),
            positions=np.concatenate([inp.positions, fill]),
            slot_mapping=np.concatenate([inp.slot_mapping, self.scratch_block * self.block_size + fill]),
            query_start_loc=np.concatenate([inp.query_start_loc, np.full(extra, n, dtype=np.int32)]),
            block_tables=tables,
            logit_rows=np.concatenate([inp.logit_rows, np.full((extra, k + 1), n - 1, dtype=np.int64)]),
            drafts=np.concatenate([inp.drafts, np.zeros((extra, k), dtype=np.int64)]),
            num_drafts=np.concatenate([inp.num_drafts, np.zeros(extra, dtype=np.int64)]),
            max_query_len=t, num_real=inp.num_real, chunk_next=chunk_next,
        )

    def to_device(self, inp: StepInputs) -> DeviceInputs:
        dev = self.device
        t = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        return DeviceInputs(
            input_ids=t(inp.input_ids), positions=t(inp.positions), slot_mapping=t(inp.slot_mapping),
            query_start_loc=t(inp.query_start_loc), block_tables=t(inp.block_tables),
            logit_rows=t(inp.logit_rows.reshape(-1)), drafts=t(inp.drafts), num_drafts=t(inp.num_drafts),
            chunk_next=None if inp.chunk_next is None else t(inp.chunk_next),
        )

    # ---- device side --------------------------------------------------------------------------------------------

    def target_forward(self, x: DeviceInputs, max_query_len: int, all_rows: bool = False,
                       small_query_len: int | None = None, logits_out: torch.Tensor | None = None):
        """`small_query_len`: the most rows a decoding request feeds (K + 1), for a step that may mix decodes with
        longer prompts or chunks (AttentionMetadata). `logits_out`: the fp32 tensor the logits are written into (a
        graph's shared output)."""
        meta = AttentionMetadata(x.positions, x.slot_mapping, x.block_tables, x.query_start_loc,
                                 max_query_len, small_query_len)
        attention = PagedAttention(self.target_kv, meta, None, self.attention)
        out = self.target(x.input_ids, x.positions, attention, self.aux_layer_ids)
        hidden = out.hidden if all_rows else out.hidden.index_select(0, x.logit_rows)
        return self.target.compute_logits(hidden, logits_out), out.aux  # [B*(k+1), V], [T, F]

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: list[int], num_top: int, rows: int = 512) -> list:
        """The target's log-probability of each prompt token after the first given the tokens before it, its rank
        and the `num_top` most likely tokens there (TokenLogprobs, raw logits as for output logprobs): one forward
        of its own without the KV cache (causal attention over the prompt), logits taken `rows` positions at a
        time so a long prompt never holds [n, vocab] at once."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        hidden = self.target(ids, torch.arange(len(ids), device=self.device), DenseAttention([len(ids)])).hidden
        one = torch.zeros(1, dtype=torch.long, device=self.device)  # the chunk as one request of end - start rows
        out = []
        for start in range(0, len(ids) - 1, rows):
            end = min(start + rows, len(ids) - 1)
            nxt = ids[start + 1:end + 1]
            chosen, rank, top_ids, top_lp = token_logprobs(self.target.compute_logits(hidden[start:end]).float(), one,
                                                           nxt[None], num_top, end - start)
            for t, c, r, ti, tl in zip(nxt.tolist(), chosen[0].tolist(), rank[0].tolist(), top_ids[0].tolist(),
                                       top_lp[0].tolist()):
                out.append((t, c, r, list(zip(ti, tl))))
        return out

    def draft_count(self, k: int) -> int:
        """The drafts a step verifying k per request proposes for the next, as its graphs do (`DraftPlanner`)."""
        return self.planner.draft_count(k)

    def propose(self, x: DeviceInputs, aux, num_rejected, next_tokens, max_query_len: int,
                small_query_len: int | None = None, num_drafts: int | None = None):
        """[B, num_drafts] drafts (default: the engine's K)."""
        if num_drafts is not None and not 1 <= num_drafts <= self.k:
            raise ValueError(f"num_drafts must be in [1, {self.k}], got {num_drafts}")
        return self.proposer.propose(DraftInputs(
            input_ids=x.input_ids, positions=x.positions, slot_mapping=x.slot_mapping,
            query_start_loc=x.query_start_loc, block_tables=x.block_tables, aux=aux,
            num_rejected=num_rejected, next_tokens=next_tokens, max_query_len=max_query_len,
            small_query_len=small_query_len,
        ), num_drafts, self.cutoff)

    def verify(self, logits, x: DeviceInputs, st: SamplingTensors, k: int, num_real: int):
        logits = logits[: num_real * (k + 1)]
        drafts, nd = x.drafts[:num_real], x.num_drafts[:num_real]
        if st.processing is not None:
            logits = process_logits(logits, st.processing, drafts, nd, k + 1)
        if self.synthetic_acceptance is not None:
            return verify_synthetic(logits.argmax(-1).view(num_real, k + 1), drafts, nd, self.synthetic_acceptance)
        if st.all_greedy:
            return verify_greedy(logits.argmax(-1).view(num_real, k + 1), drafts, nd)
        probs = target_probs(logits, st, k + 1).view(num_real, k + 1, -1)
        u = uniform_like((num_real, max(k, 1)), logits.device, st.generators)[:, :k]
        noise = exponential_like(probs[:, 0], st.generators, 1)
        return verify_sampled(probs, drafts, nd, u, noise)

    def greedy_step(self, x: DeviceInputs, k: int, draft: bool | None = None) -> torch.Tensor:
        """A whole decode round for greedy requests on the device (captured as one CUDA graph): verify, then draft.

        Every request feeds exactly one uncomputed token and k drafts. Returns the packed host answer
        [B, (k + 1) + 1 + K + 1]: output tokens, number accepted, next drafts, drafts verified.
        """
        b = x.query_start_loc.shape[0] - 1
        logits, aux = self.target_forward(x, k + 1, all_rows=True)
        v = verify_greedy(logits.argmax(-1).view(b, k + 1), x.drafts, x.num_drafts)
        drafts = None
        if draft is None:  # by default a round without drafts is a plain step (the adaptive policy's "off")
            draft = k > 0
        if self.proposer is not None and draft:
            drafts = self.propose(x, aux, x.num_drafts - v.num_accepted, v.next_tokens, k + 1,
                                  num_drafts=self.draft_count(k))
        return _pack(v, drafts, b, _num_verified(x.drafts, x.num_drafts))

    def general_greedy_step(self, x: DeviceInputs, t: int, k: int, draft: bool) -> torch.Tensor:
        """A whole general step for greedy requests on the device (captured per key as one CUDA graph): the target
        over the step's t fed tokens, verification of every request's k + 1 rows, then drafting. Padding requests
        (empty spans) are verified too and their answers dropped by the caller; they feed the drafter zeros, as in
        `_run`. Returns the packed answer of all B requests, as `greedy_step` does."""
        b = x.query_start_loc.shape[0] - 1
        logits, aux = self.target_forward(x, t, small_query_len=k + 1)
        v = verify_greedy(logits.argmax(-1).view(b, k + 1), x.drafts, x.num_drafts)
        drafts = None
        if draft:
            live = x.query_start_loc[1:] > x.query_start_loc[:-1]  # a real request feeds at least one token
            next_tokens = v.next_tokens if x.chunk_next is None else torch.where(x.chunk_next >= 0, x.chunk_next,
                                                                                 v.next_tokens)
            zero = torch.zeros_like(next_tokens)
            drafts = self.propose(x, aux, torch.where(live, x.num_drafts - v.num_accepted, zero),
                                  torch.where(live, next_tokens, zero), t, small_query_len=k + 1,
                                  num_drafts=self.draft_count(k))
        return _pack(v, drafts, b, _num_verified(x.drafts, x.num_drafts))

    def execute(self, seqs, drafts: list[list[int]], st: SamplingTensors, plan: DraftPlan,
                chunks: list[int] | None = None) -> StepResult:
        """One step, answered on the host (`launch` and wait)."""
        return self.launch(seqs, drafts, st, plan, chunks).result()

    @torch.inference_mode()
    def launch(self, seqs, drafts: list[list[int]], st: SamplingTensors, plan: DraftPlan,
               chunks: list[int] | None = None) -> StepHandle:
        """One step from the host's sequences, drafting as `plan` says (`DraftPlanner.plan`): without drafting no
        drafts come back; a padded plan feeds each request's missing drafts as PAD_DRAFT up to plan.verify_k, so the
        step runs as that K's steps do (graphs). `chunks`: tokens fed per request when a prefill is chunked; a
        chunk's answer is meaningless (nothing is sampled), but the drafter reads the prompt token after it, so its
        cache fills. A plan proposing a count no graph of its K proposes (`draft_count`) runs eagerly."""
        k, draft = plan.verify_k, plan.draft
        if plan.pad:
            drafts = [d + [PAD_DRAFT] * (k - len(d)) for d in drafts]
        eager = draft and plan.propose_k != self.draft_count(k)
        if not eager and chunks is None and self.graphs is not None and self.graphs.can_run(seqs, drafts, k, draft):
            inp = self.build_inputs(seqs, drafts, k, pad_to=self.graphs.bucket_for(len(seqs)))
            return self._run(self.graphs.load_inputs(inp), st, k, inp.num_real, inp.max_query_len, self.graphs,
                             draft)
        inp = self.build_inputs(seqs, drafts, k, chunks=chunks)
        general = None if eager else self.general_graphs
        key = None if general is None else general.key_for(len(inp.input_ids), len(seqs), k)
        if key is None:
            return self._run(self.to_device(inp), st, k, inp.num_real, inp.max_query_len, None, draft,
                             plan.propose_k)
        inp = self.pad_inputs(inp, key[0], key[1])
        return self._run(general.load_inputs(inp, key), st, k, inp.num_real, inp.max_query_len, general, draft)

    @torch.inference_mode()
    def launch_next(self, prev: StepHandle, rows: list[int], seqs, st: SamplingTensors,
                    plan: DraftPlan) -> StepHandle:
        """The decode step after `prev`, launched before prev's answer reached the host (async scheduling).

        Request i is row `rows[i]` of prev's batch; it feeds prev's next token and the first k = plan.verify_k of
        its drafts (k <= prev.num_drafts), at positions that follow the tokens prev accepts. The host gives only
        each request's token count at prev's launch and its block table (grown for the most tokens prev can add);
        `kernels.advance_decode_inputs` builds the rest on the device. `plan`: `DraftPlanner.plan_ahead`'s.
        """
        k, draft = plan.verify_k, plan.draft
        assert k <= prev.num_drafts, (k, prev.num_drafts)
        graphed = self.graphs is not None and self.graphs.fits(len(seqs), k, draft)
        src, base, tables = self.build_next_inputs(seqs, rows, self.graphs.bucket_for(len(seqs)) if graphed
                                                   else len(seqs))
        if graphed:
            x, src_d, base_d = self.graphs.load_next_inputs(src, base, tables, k)
        else:
            x, src_d, base_d = self._next_inputs_eager(src, base, tables, k)
        kernels.advance_decode_inputs(prev.packed, src_d, base_d, x.block_tables, prev.k, k, self.block_size,
                                      self.scratch_block, x)
        return self._run(x, st, k, len(seqs), k + 1, self.graphs if graphed else None, draft, plan.propose_k)

    @torch.inference_mode()
    def launch_admit_next(self, prev: StepHandle, rows: list[int], seqs, new, st: SamplingTensors,
                          plan: DraftPlan) -> StepHandle:
        """`launch_next` with new prompts admitted in the same step: the prompts' whole spans first (built on the
        host), then the decodes of `seqs` (request i is row rows[i] of prev's batch, feeding prev's next token and
        the first k = plan.verify_k of its drafts), whose rows `kernels.advance_decode_inputs` writes on the device
        from prev's answer. The drafter runs where there is one (it reads the new prompts). A general graph runs
        the step when its bucket has one, its inputs staged through pinned memory so the host does not wait for
        prev; else it runs eagerly."""
        k = plan.verify_k
        assert k <= prev.num_drafts, (k, prev.num_drafts)
        pre = self._build_general_inputs(new, [[] for _ in new], k, None)
        n_new, d, bs = len(new), len(seqs), self.block_size
        t_pre = int(pre.query_start_loc[-1])
        src, base, tables = self.build_next_inputs(seqs, rows, d)
        j = np.tile(np.arange(k + 1, dtype=np.int64), d)  # placeholders until the device writes the decode rows
        inp = StepInputs(
            input_ids=np.concatenate([pre.input_ids, np.zeros(d * (k + 1), dtype=np.int64)]),
            positions=np.concatenate([pre.positions, j]),
            slot_mapping=np.concatenate([pre.slot_mapping, self.scratch_block * bs + j % bs]),
            query_start_loc=np.concatenate([pre.query_start_loc,
                                            t_pre + (k + 1) * np.arange(1, d + 1, dtype=np.int32)]),
            block_tables=np.concatenate([pre.block_tables, tables]),
            logit_rows=np.concatenate([pre.logit_rows, t_pre + np.arange(d * (k + 1)).reshape(d, k + 1)]),
            drafts=np.zeros((n_new + d, k), dtype=np.int64),
            num_drafts=np.concatenate([pre.num_drafts, np.full(d, k, dtype=np.int64)]),
            max_query_len=max(pre.max_query_len, k + 1), num_real=n_new + d,
        )
        general = self.general_graphs
        key = None if general is None else general.key_for(len(inp.input_ids), n_new + d, k)
        if key is None:
            x = self.to_device(inp)
            src_d, base_d = (torch.from_numpy(a).to(self.device) for a in (src, base))
            max_query_len = inp.max_query_len
        else:
            inp = self.pad_inputs(inp, key[0], key[1])
            x, src_d, base_d = general.load_inputs(inp, key, next_rows=(src, base))
            max_query_len = key[0]
        rows_d = slice(t_pre, t_pre + d * (k + 1))
        out = {"input_ids": x.input_ids[rows_d], "positions": x.positions[rows_d],
               "slot_mapping": x.slot_mapping[rows_d], "drafts": x.drafts[n_new:n_new + d],
               "num_drafts": x.num_drafts[n_new:n_new + d]}
        kernels.advance_decode_inputs(prev.packed, src_d, base_d, x.block_tables[n_new:n_new + d], prev.k, k,
                                      bs, self.scratch_block, out)
        return self._run(x, st, k, n_new + d, max_query_len, None if key is None else general, plan.draft,
                         plan.propose_k)

    @torch.inference_mode()
    def launch_compact(self, prev: StepHandle, rows: list[int], seqs, new, st: SamplingTensors, plan: DraftPlan,
                       budget: int) -> StepHandle:
        """`launch_next` (and with `new` prompts, `launch_admit_next`) for drafts cut by confidence: request i of
        `seqs` (row rows[i] of prev's batch) feeds prev's next token and only the drafts prev left it (at most
        k = plan.verify_k), packed after the prompts' rows into `budget` rows at least (`kernels.
        compact_decode_inputs`, which cuts the deepest drafts when they do not fit: the engine sizes the budget from
        the drafts its requests held last). A general graph runs the step when its (tokens, requests, K) key has
        one, its bucket's spare rows added to the budget; else it runs eagerly at exactly the budget."""
        k = plan.verify_k
        assert k <= prev.num_drafts and budget >= len(seqs), (k, prev.num_drafts, budget, len(seqs))
        n_new, d, bs = len(new), len(seqs), self.block_size
        pre = self._build_general_inputs(new, [[] for _ in new], k, None) if new else None
        t_pre = int(pre.query_start_loc[-1]) if new else 0
        general = self.general_graphs
        key = None if general is None else general.key_for(t_pre + budget, n_new + d, k)
        t, b = (key[0], key[1]) if key is not None else (t_pre + budget, n_new + d)
        src, base, tables = self.build_next_inputs(seqs, rows, b - n_new)
        z = lambda *shape: np.zeros(shape, dtype=np.int64)  # noqa: E731 - placeholders the device overwrites
        inp = StepInputs(
            input_ids=z(t), positions=z(t), slot_mapping=z(t),
            query_start_loc=np.full(b + 1, t_pre, dtype=np.int32), block_tables=tables,
            logit_rows=z(b, k + 1), drafts=z(b, k), num_drafts=z(b),
            max_query_len=max(pre.max_query_len if new else 0, k + 1), num_real=n_new + d,
            chunk_next=np.full(b, -1, dtype=np.int64))
        if new:  # the prompts' rows and requests first, as built on the host
            for name in ("input_ids", "positions", "slot_mapping"):
                getattr(inp, name)[:t_pre] = getattr(pre, name)
            inp.query_start_loc[:n_new + 1] = pre.query_start_loc
            inp.block_tables = np.concatenate([pre.block_tables, tables])
            inp.logit_rows[:n_new] = pre.logit_rows
        if key is None:
            x = self.to_device(inp)
            src_d, base_d = (torch.from_numpy(a).to(self.device) for a in (src, base))
            max_query_len = inp.max_query_len
        else:
            x, src_d, base_d = general.load_inputs(inp, key, next_rows=(src, base))
            max_query_len = t
        out = {"input_ids": x.input_ids[t_pre:], "positions": x.positions[t_pre:],
               "slot_mapping": x.slot_mapping[t_pre:], "query_start_loc": x.query_start_loc[n_new:],
               "logit_rows": x.logit_rows.view(b, k + 1)[n_new:], "drafts": x.drafts[n_new:],
               "num_drafts": x.num_drafts[n_new:]}
        kernels.compact_decode_inputs(prev.packed, src_d, base_d, x.block_tables[n_new:], prev.k, k, bs,
                                      self.scratch_block, t_pre, out)
        return self._run(x, st, k, n_new + d, max_query_len, None if key is None else general, plan.draft,
                         plan.propose_k)

    def build_next_inputs(self, seqs, rows: list[int], pad_to: int):
        """Host arrays for `launch_next`: per request the packed row it reads (-1 = padding), its token count
        and its block table."""
        src = np.full(pad_to, -1, dtype=np.int64)
        base = np.zeros(pad_to, dtype=np.int64)
        tables = np.full((pad_to, self.max_blocks_per_seq), self.scratch_block, dtype=np.int32)
        src[:len(rows)] = rows
        for i, seq in enumerate(seqs):
            table = seq.block_table
            tables[i, :len(table)] = table
            base[i] = seq.num_tokens
        return src, base, tables

    def _next_inputs_eager(self, src, base, tables, k: int):
        dev, b = self.device, len(src)
        t = b * (k + 1)
        empty = lambda *shape: torch.empty(shape, dtype=torch.long, device=dev)  # noqa: E731
        x = DeviceInputs(input_ids=empty(t), positions=empty(t), slot_mapping=empty(t), drafts=empty(b, k),
                         num_drafts=empty(b), block_tables=torch.from_numpy(tables).to(dev),
                         query_start_loc=torch.arange(0, t + 1, k + 1, dtype=torch.int32, device=dev),
                         logit_rows=torch.arange(t, device=dev))
        return x, torch.from_numpy(src).to(dev), torch.from_numpy(base).to(dev)

    def _run(self, x: DeviceInputs, st: SamplingTensors, k: int, num_real: int, max_query_len: int,
             graphs, draft: bool, num_new_drafts: int | None = None) -> StepHandle:
        """Verify and draft over inputs already on the device; the answer starts its way to the host. `graphs`:
        the CudaGraphs or GeneralGraphs whose buffers hold the inputs (None: eager; graphs propose
        `draft_count(k)` drafts, eager steps `num_new_drafts`, by default the same)."""
        if graphs is not None:
            if graphs.fused_greedy and st.all_greedy and st.processing is None and st.logprob_requests is None \
                    and self.synthetic_acceptance is None:
                return self._handle(graphs.run_greedy(num_real, draft), k)
            logits, aux = graphs.run_target()
        else:
            logits, aux = self.target_forward(x, max_query_len, small_query_len=k + 1)
        v = self.verify(logits, x, st, k, num_real)
        new_drafts = None
        if draft:
            pad = x.query_start_loc.shape[0] - 1 - num_real
            num_rejected = x.num_drafts[:num_real] - v.num_accepted
            next_tokens = v.next_tokens
            if x.chunk_next is not None:
                chunk_next = x.chunk_next[:num_real]
                next_tokens = torch.where(chunk_next >= 0, chunk_next, next_tokens)
            if pad:
                num_rejected = torch.cat([num_rejected, num_rejected.new_zeros(pad)])
                next_tokens = torch.cat([next_tokens, next_tokens.new_zeros(pad)])
            if graphs is not None:
                new_drafts = graphs.run_proposer(num_rejected, next_tokens)
            else:
                new_drafts = self.propose(x, aux, num_rejected, next_tokens, max_query_len, small_query_len=k + 1,
                                          num_drafts=num_new_drafts or self.draft_count(k))
            new_drafts = new_drafts[:num_real]
        verified = _num_verified(x.drafts[:num_real], x.num_drafts[:num_real])
        handle = self._handle(_pack(v, new_drafts, num_real, verified), k)
        if st.logprob_requests is not None:
            # Computed now: the logits may be a graph's output, which the next step's replay overwrites before the
            # host reads this answer (async scheduling).
            lp = _logprob_tensors(logits[: num_real * (k + 1)], st, v.output_tokens, k + 1)

            def finish(result: StepResult):
                result.logprobs = _logprobs(lp, result.num_accepted)

            handle.finish = finish
        return handle

    def _handle(self, packed: torch.Tensor, k: int) -> StepHandle:
        if self._pinned is None:
            return StepHandle(packed, k)
        self._flip ^= 1
        host = self._pinned[self._flip][: packed.numel()].view(packed.shape)
        host.copy_(packed, non_blocking=True)
        ready = self._events[self._flip]
        ready.record()
        return StepHandle(packed, k, host, ready)


def _pack(v, new_drafts, b, num_verified) -> torch.Tensor:  # [B, (k + 1) + 1 + D + 1]
    parts = [v.output_tokens.long().reshape(b, -1), v.num_accepted.long().reshape(b, 1)]
    if new_drafts is not None:
        parts.append(new_drafts.long().reshape(b, -1))
    parts.append(num_verified.long().reshape(b, 1))
    return torch.cat(parts, dim=1)


def _num_verified(drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:  # [B, k], [B] -> [B]
    """Drafts each request verified: its first num_drafts, pads (ids < 0) aside."""
    j = torch.arange(drafts.shape[1], device=drafts.device)
    return ((j[None, :] < num_drafts[:, None]) & (drafts >= 0)).sum(dim=1)


def _logprob_tensors(logits, st: SamplingTensors, output_tokens, rows: int) -> tuple[torch.Tensor, ...]:
    """On the device: the logprob requests' indices and emitted tokens, and (chosen, rank, top ids, top logprobs)
    from the raw target logits."""
    req = st.logprob_requests
    return (req, output_tokens[req], *token_logprobs(logits, req, output_tokens, st.num_logprobs, rows))


def _logprobs(lp: tuple[torch.Tensor, ...], num_accepted: list[int]) -> list:
    """Per request: None, or one (id, logprob, rank, top) per emitted token."""
    out: list = [None] * len(num_accepted)
    for b, ids, lps, ranks, tids, tlps in zip(*(t.tolist() for t in lp)):
        n = num_accepted[b] + 1
        out[b] = [(ids[j], lps[j], ranks[j], list(zip(tids[j], tlps[j]))) for j in range(n)]
    return out


def _unpack(rows: list[list[int]], k: int) -> StepResult:
    width = k + 1
    out, acc, drafts, verified = [], [], [], []
    for row in rows:
        a = row[width]
        out.append(row[: a + 1])
        acc.append(a)
        drafts.append(row[width + 1:-1])
        verified.append(row[-1])
    return StepResult(out, acc, drafts, verified)
