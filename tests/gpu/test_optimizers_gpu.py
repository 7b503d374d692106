"""On CUDA: peagle's Muon steps as torch.optim.Muon does for a whole matrix, and as its separate blocks for a fused
projection (the Newton-Schulz iteration runs in bf16 on the GPU's tensor cores)."""

from __future__ import annotations

import pytest
import torch

from peagle.training.optimizers import Muon

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("shape", [(576, 1728), (1728, 576), (960, 1152)])
def test_muon_on_cuda_matches_torch_and_steps_blocks_apart(shape):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(shape, device="cuda", generator=gen)
    ours, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    a = Muon([ours], [None], lr=1e-3, weight_decay=0.1)
    b = torch.optim.Muon([theirs], lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        ours.grad = torch.randn(shape, device="cuda", generator=gen)
        theirs.grad = ours.grad.clone()
        a.step(), b.step()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    rows = [shape[0] // 2, shape[0] // 4, shape[0] - shape[0] // 2 - shape[0] // 4]
    fused = torch.nn.Parameter(w.clone())
    parts = [torch.nn.Parameter(x.clone()) for x in w.split(rows)]
    fused.grad = torch.randn(shape, device="cuda", generator=gen)
    for p, g in zip(parts, fused.grad.split(rows)):
        p.grad = g.clone()
    Muon([fused], [rows], lr=1e-3).step()
    Muon(parts, [None] * 3, lr=1e-3).step()
    torch.testing.assert_close(fused.detach(), torch.cat([p.detach() for p in parts]), rtol=0, atol=0)
    assert (fused - w).abs().max() > 0  # it moved
