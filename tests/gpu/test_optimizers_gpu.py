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


def test_muon_batched_by_shape_on_cuda_matches_each_block_alone():
    """The testbed head's blocks, same-shape ones through one batched Newton-Schulz, step as each alone would, to
    bf16's precision (batched and single GEMMs may round differently)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = [((960, 1152), [576, 192, 192]), ((960, 576), [576, 192, 192]), ((576, 576), None),
              ((3072, 576), [1536, 1536]), ((576, 1536), None), ((576, 1728), None)]
    ws = [torch.randn(s, device="cuda", generator=gen) * 0.02 for s, _ in shapes]
    blocks = [rows for _, rows in shapes]
    batched = [torch.nn.Parameter(w.clone()) for w in ws]
    alone = [torch.nn.Parameter(w.clone()) for w in ws]
    a, b = Muon(batched, blocks, lr=1e-3), Muon(alone, blocks, lr=1e-3, batch_shapes=False)
    for _ in range(3):
        for x, y in zip(batched, alone):
            x.grad = torch.randn(x.shape, device="cuda", generator=gen) * 1e-3
            y.grad = x.grad.clone()
        a.step(), b.step()
    for x, y, w in zip(batched, alone, ws):
        torch.testing.assert_close(x.detach(), y.detach(), atol=1e-4, rtol=0)
        assert (x - w).abs().max() > 1e-3  # it moved, more than the tolerance
