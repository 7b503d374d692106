"""CUDA graphs for pure decode steps: one target graph and one drafting graph per (batch bucket, K).

A host launch of the 30-layer target costs ~20 ms eagerly on a slow host and ~3 ms replayed, so every decode step
that has the common shape (one uncomputed token and K drafts per request) replays graphs. Batches are padded up to
the next bucket with dummy requests that write only the scratch KV block.
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CudaGraphs:
    def __init__(self, runner, max_num_seqs: int, ks: list[int]):
        self.runner = runner
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.ks = sorted(set(ks))
        bmax, kmax = self.buckets[-1], max(self.ks)
        dev = runner.device
        tmax = bmax * (kmax + 1)
        self.buf = {
            "input_ids": torch.zeros(tmax, dtype=torch.long, device=dev),
            "positions": torch.zeros(tmax, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((tmax,), -1, dtype=torch.long, device=dev),
            "query_start_loc": torch.zeros(bmax + 1, dtype=torch.int32, device=dev),
            "block_tables": torch.full((bmax, runner.max_blocks_per_seq), runner.scratch_block, dtype=torch.int32,
                                       device=dev),
            "drafts": torch.zeros(bmax, kmax, dtype=torch.long, device=dev),
            "num_drafts": torch.zeros(bmax, dtype=torch.long, device=dev),
            "num_rejected": torch.zeros(bmax, dtype=torch.long, device=dev),
            "next_tokens": torch.zeros(bmax, dtype=torch.long, device=dev),
        }
        self.pool = torch.cuda.graph_pool_handle()
        self.target_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.draft_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.current_k = kmax
        self._capture_all()

    def bucket_for(self, b: int) -> int:
        return next(x for x in self.buckets if x >= b)

    def can_run(self, seqs, drafts, k: int) -> bool:
        if k not in self.ks or len(seqs) > self.buckets[-1]:
            return False
        return all(s.num_tokens - s.num_computed_tokens == 1 and len(d) == k for s, d in zip(seqs, drafts))

    def _views(self, b: int, k: int) -> dict[str, torch.Tensor]:
        t = b * (k + 1)
        v = self.buf
        return {"input_ids": v["input_ids"][:t], "positions": v["positions"][:t],
                "slot_mapping": v["slot_mapping"][:t], "query_start_loc": v["query_start_loc"][: b + 1],
                "block_tables": v["block_tables"][:b], "drafts": v["drafts"][:b, :k],
                "num_drafts": v["num_drafts"][:b], "logit_rows": None}

    def load_inputs(self, inp) -> dict[str, torch.Tensor]:
        b, k = len(inp.query_start_loc) - 1, inp.drafts.shape[1]
        self.current_k = k
        x = self._views(b, k)
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "block_tables", "drafts",
                     "num_drafts"):
            x[name].copy_(torch.from_numpy(getattr(inp, name)), non_blocking=True)
        return x

    def run_target(self, b: int):
        graph, out = self.target_graphs[(b, self.current_k)]
        graph.replay()
        return out

    def run_proposer(self, b: int, num_rejected, next_tokens):
        self.buf["num_rejected"][:b].copy_(num_rejected)
        self.buf["next_tokens"][:b].copy_(next_tokens)
        graph, out = self.draft_graphs[(b, self.current_k)]
        graph.replay()
        return out

    def _capture_all(self):
        r = self.runner
        todo = [(b, k) for k in self.ks for b in reversed(self.buckets)]
        for b, k in tqdm(todo, desc="capturing CUDA graphs", leave=False):
            x = self._views(b, k)
            self._fill_dummy(b, k)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                r.target_forward(x, k + 1, all_rows=True)  # warm-up: compiles kernels, settles allocator
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    out = r.target_forward(x, k + 1, all_rows=True)
            torch.cuda.current_stream().wait_stream(stream)
            self.target_graphs[(b, k)] = (g, out)
            if r.proposer is None:
                continue
            aux = out[1]
            nrej, nxt = self.buf["num_rejected"][:b], self.buf["next_tokens"][:b]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                r.propose(x, aux, nrej, nxt, k + 1)
                g2 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g2, pool=self.pool, stream=stream):
                    drafts = r.propose(x, aux, nrej, nxt, k + 1)
            torch.cuda.current_stream().wait_stream(stream)
            self.draft_graphs[(b, k)] = (g2, drafts)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (buckets %s, K %s)", len(todo) * (1 + (r.proposer is not None)),
                    self.buckets, self.ks)

    def _fill_dummy(self, b: int, k: int):
        r = self.runner
        bs = r.block_size
        t = b * (k + 1)
        self.buf["input_ids"][:t].zero_()
        self.buf["positions"][:t].copy_(torch.arange(k + 1).repeat(b))
        self.buf["slot_mapping"][:t].copy_(r.scratch_block * bs + torch.arange(k + 1).repeat(b) % bs)
        self.buf["query_start_loc"][: b + 1].copy_(torch.arange(b + 1, dtype=torch.int32) * (k + 1))
        self.buf["block_tables"][:b].fill_(r.scratch_block)
        self.buf["num_drafts"][:b].fill_(k)
        self.buf["num_rejected"][:b].zero_()
        self.buf["next_tokens"][:b].zero_()
