"""The drafter's optimizer: AdamW over every trained parameter, or Muon over the hidden weight matrices and AdamW over
the rest (speculators' default recipe: Muon orthogonalises each matrix update; embeddings, the lm_head, norms and the
P-EAGLE mask_hidden are not matrices it is made for and keep AdamW, as in Muon's own reference usage).

Muon here is torch.optim.Muon's arithmetic (Nesterov momentum, five Newton-Schulz steps in bf16, the update scaled to
AdamW's RMS: `adjust_lr_fn="match_rms_adamw"`, decoupled weight decay) with one difference that torch's cannot make:
a fused projection (the layers' qkv_proj, gate_up_proj) is orthogonalised block by block, as the separate q, k, v,
gate and up matrices that the public recipes train, not as one stacked matrix.

Both optimizers follow one learning-rate schedule (a factor of each one's peak: --lr for AdamW, --muon-lr for Muon).
With the update scaled to AdamW's RMS one peak learning rate suits both; --muon-lr defaults to --lr.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import nn


ADAMW_BETAS = (0.9, 0.95)
MUON_MOMENTUM = 0.95
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
NS_STEPS = 5
NS_EPS = 1e-7
# 2-D parameters that Muon leaves to AdamW: the token embedding and the output head (by name).
ADAMW_MATRICES = ("embed_tokens", "lm_head")


def fused_blocks(model: nn.Module) -> dict[str, list[int]]:
    """Row blocks of each fused projection weight by parameter name: qkv_proj [q, k, v], gate_up_proj [gate, up]."""
    blocks = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if hasattr(module, "qkv_proj") and hasattr(module, "q_size") and hasattr(module, "kv_size"):
            blocks[f"{prefix}qkv_proj.weight"] = [module.q_size, module.kv_size, module.kv_size]
        if hasattr(module, "gate_up_proj") and hasattr(module, "intermediate"):
            blocks[f"{prefix}gate_up_proj.weight"] = [module.intermediate, module.intermediate]
    return blocks


def muon_split(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(Muon's, AdamW's) trained parameters: Muon takes each 2-D matrix with both sides > 1 that is not an
    embedding or output head; AdamW the rest (norm weights, biases, mask_hidden, embeddings, a trained lm_head)."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and min(p.shape) > 1 and not any(part in name for part in ADAMW_MATRICES)
        (muon if matrix else adamw).append((name, p))
    return muon, adamw


def orthogonalise(g: torch.Tensor) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to g, approximately (Newton-Schulz in bf16, as torch.optim.Muon)."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def orthogonalise_batch(g: torch.Tensor) -> torch.Tensor:
    """`orthogonalise` of each matrix of g [n, r, c] (r <= c) at once: the Newton-Schulz steps as batched matmuls,
    a few kernels for the n matrices instead of a few for each (a P-EAGLE head's 29 blocks are three shapes)."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    x = x / x.flatten(1).norm(dim=1).clamp(min=NS_EPS)[:, None, None]
    for _ in range(NS_STEPS):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


class Muon(torch.optim.Optimizer):
    """Muon whose parameters may be row-stacked blocks (`blocks[i]`: row counts of parameter i, None: one block),
    each block orthogonalised and its step scaled by its own shape. Blocks of one shape (up to a transpose) are
    orthogonalised together (`orthogonalise_batch`); a shape alone takes `orthogonalise`, torch.optim.Muon's
    arithmetic to the bit."""

    def __init__(self, params: Sequence[nn.Parameter], blocks: Sequence[Sequence[int] | None], lr: float,
                 weight_decay: float = 0.0, momentum: float = MUON_MOMENTUM, batch_shapes: bool = True):
        """`batch_shapes=False`: every block through `orthogonalise` alone (the unbatched form, kept for timing)."""
        self.batch_shapes = batch_shapes
        params = list(params)
        if len(blocks) != len(params):
            raise ValueError("Muon: one block list per parameter")
        for p, rows in zip(params, blocks):
            if p.ndim != 2 or (rows is not None and sum(rows) != p.shape[0]):
                raise ValueError(f"Muon takes matrices whose blocks cover their rows, got {list(p.shape)}, {rows}")
        super().__init__([{"params": params, "blocks": [list(r) if r else None for r in blocks]}],
                         {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            by_shape: dict[tuple[int, int], list] = {}  # (rows, cols) of a wide block: (block, update, wide)
            for p, rows in zip(group["params"], group["blocks"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu)  # Nesterov
                p.mul_(1 - lr * wd)
                for block, u in zip(p.split(rows or [p.shape[0]]), update.split(rows or [p.shape[0]])):
                    wide = u.shape[0] <= u.shape[1]
                    by_shape.setdefault(tuple(u.shape) if wide else tuple(u.shape[::-1]), []).append(
                        (block, u if wide else u.T, wide))
            for (r, c), items in by_shape.items():
                alpha = -lr * 0.2 * math.sqrt(max(r, c))  # AdamW's RMS
                if len(items) == 1 or not self.batch_shapes:
                    for block, u, wide in items:
                        x = orthogonalise(u)
                        block.add_(x if wide else x.T, alpha=alpha)
                    continue
                xs = orthogonalise_batch(torch.stack([u for _, u, _ in items]))
                for (block, _, wide), x in zip(items, xs.unbind(0)):
                    block.add_(x if wide else x.T, alpha=alpha)


class DrafterOptimizer:
    """One or two torch optimizers stepped together, each with a LambdaLR of the same schedule `factor(step)`."""

    def __init__(self, model: nn.Module, kind: str, lr: float, weight_decay: float, factor: Callable[[int], float],
                 muon_lr: float | None = None, fused: bool = False):
        self.kind = kind  # one of config.OPTIMIZERS (TrainConfig checks it)
        self.params = [p for p in model.parameters() if p.requires_grad]
        extra = {"fused": True} if fused else {}
        if kind == "adamw":
            self.optimizers = [torch.optim.AdamW(self.params, lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay,
                                                 **extra)]
        else:
            muon, adamw = muon_split(model)
            if not muon:
                raise ValueError("--optimizer muon: the drafter has no trained weight matrix for Muon")
            blocks = fused_blocks(model)
            self.optimizers = [Muon([p for _, p in muon], [blocks.get(n) for n, _ in muon],
                                    lr=lr if muon_lr is None else muon_lr, weight_decay=weight_decay)]
            if adamw:
                self.optimizers.append(torch.optim.AdamW([p for _, p in adamw], lr=lr, betas=ADAMW_BETAS,
                                                         weight_decay=weight_decay, **extra))
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.optimizers]

    @property
    def lr(self) -> float:
        """The AdamW group's learning rate now (what the log's `lr` reports)."""
        return self.schedulers[-1].get_last_lr()[0]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()
        for s in self.schedulers:
            s.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "optimizers": [o.state_dict() for o in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        kind = state.get("kind", "adamw")
        if kind != self.kind or len(state["optimizers"]) != len(self.optimizers):
            raise ValueError(f"the checkpoint was trained with --optimizer {kind}, this run has --optimizer "
                             f"{self.kind}; resume with the same optimizer")
        for o, s in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(s)
        for sch, s in zip(self.schedulers, state["schedulers"]):
            sch.load_state_dict(s)

    def load_legacy(self, optimizer: dict, scheduler: dict) -> None:
        """A checkpoint from before this class: one AdamW state and its scheduler's."""
        self.load_state_dict({"kind": "adamw", "optimizers": [optimizer], "schedulers": [scheduler]})
