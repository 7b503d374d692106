"""Data parallelism over torchrun processes: each process trains a disjoint slice of the global batch.

Every process keeps a full drafter. Gradients are summed across processes once per optimizer step, after all
micro-batches and sequence segments have run backward (DDP's per-backward hooks would fire once per segment), and
the loss is normalised by the global denominator, so the update equals one process over the union batch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DistContext:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums a tensor over processes (in place; returned for chaining)."""
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        if self.world_size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()


def init_distributed() -> DistContext:
    """From torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); a single process without it.

    NCCL with one GPU per process on CUDA machines, gloo on the CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        logger.info("process %d of %d on %s", rank, world_size, device)
    return DistContext(rank, world_size, device)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        # All processes reach teardown together: a rank that destroys its group while a peer is still saving can
        # make gloo abort the peer at exit ("terminate called without an active exception").
        try:
            dist.barrier()
        except RuntimeError as e:  # a peer already died: nothing left to wait for
            logger.warning("barrier before shutdown failed: %s", e)
        dist.destroy_process_group()
