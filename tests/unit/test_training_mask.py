"""The attention rule as mask_mod / block mask equals the dense reference; the backend computes the same attention."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from peagle.training.attention import FlexAttention, KVChain, block_sparse_attention
from peagle.training.cod import cod_sample
from peagle.training.mask import (BLOCK_SIZE, _ordered_by_anchor, block_tiles, build_block_mask, dense_mask_reference,
                                  dense_tiles, layout_mask_mod)


def _layout(seed, num_docs=3, k=6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 120, (num_docs,), generator=gen).tolist()
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    loss_mask = torch.rand(doc_ids.numel(), generator=gen) < 0.7
    return cod_sample(doc_ids, loss_mask, k, 0.8, 0.2, gen)


def _blocks_dense(block_mask):
    """[q_blocks, kv_blocks] int: 0 empty, 1 partial, 2 full."""
    nq, nkv = block_mask.kv_num_blocks.shape[-1], -(-block_mask.seq_lengths[1] // BLOCK_SIZE)
    out = torch.zeros(nq, nkv, dtype=torch.long)
    for i in range(nq):
        out[i, block_mask.kv_indices[0, 0, i, :block_mask.kv_num_blocks[0, 0, i]].long()] = 1
        out[i, block_mask.full_kv_indices[0, 0, i, :block_mask.full_kv_num_blocks[0, 0, i]].long()] = 2
    return out


def test_reference_matches_the_docstring_example():
    from peagle.training.cod import Layout

    anchor, depth = torch.tensor([0, 1, 2, 1, 1]), torch.tensor([0, 0, 0, 1, 2])
    layout = Layout(anchor, depth, torch.zeros(5, dtype=torch.long), anchor + depth, anchor + depth + 1,
                    torch.ones(5))
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]])
    assert torch.equal(dense_mask_reference(layout), expected.bool())


@pytest.mark.parametrize("seed", range(4))
def test_mask_mod_and_block_mask_equal_the_dense_reference(seed):
    layout = _layout(seed)
    reference = dense_mask_reference(layout)
    n = len(layout)
    idx = torch.arange(n)
    assert torch.equal(layout_mask_mod(layout)(0, 0, idx[:, None], idx[None, :]), reference)
    # Tile classification: empty tiles hold no visible pair, full tiles only visible pairs.
    padded = torch.zeros(-(-n // BLOCK_SIZE) * BLOCK_SIZE, -(-n // BLOCK_SIZE) * BLOCK_SIZE, dtype=torch.bool)
    padded[:n, :n] = reference
    valid = torch.zeros_like(padded)
    valid[:n, :n] = True
    tiles = lambda m: m.view(m.shape[0] // BLOCK_SIZE, BLOCK_SIZE, -1, BLOCK_SIZE).sum(dim=(1, 3))  # noqa: E731
    count, size = tiles(padded), tiles(valid)
    expected = torch.where(count == 0, 0, torch.where(count == BLOCK_SIZE * BLOCK_SIZE, 2, 1))
    block_mask = build_block_mask(layout)
    assert torch.equal(_blocks_dense(block_mask), expected)
    assert bool((size[expected == 2] == BLOCK_SIZE * BLOCK_SIZE).all())


@pytest.mark.parametrize("seed", range(3))
def test_flex_attention_and_cpu_path_equal_sdpa_with_the_dense_mask(seed):
    layout = _layout(seed, num_docs=4)
    n = len(layout)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(4, n, 16, generator=gen)
    k, v = torch.randn(2, n, 16, generator=gen), torch.randn(2, n, 16, generator=gen)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 0), v.repeat_interleave(2, 0),
                                              attn_mask=dense_mask_reference(layout))
    block_mask = build_block_mask(layout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unfused flex_attention on the CPU warns that it is unfused
        fused_api = flex_attention(q[None], k[None], v[None], block_mask=block_mask, enable_gqa=True)[0]
    torch.testing.assert_close(fused_api, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block_sparse_attention(q, k, v, block_mask), expected, rtol=1e-5, atol=1e-5)
    backend = FlexAttention(block_mask)(0, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    torch.testing.assert_close(backend.transpose(0, 1), expected, rtol=1e-5, atol=1e-5)


def test_chained_passes_see_earlier_passes_through_the_kv_chain():
    layout = _layout(7, num_docs=2, k=4)
    n = len(layout)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=dense_mask_reference(layout)).transpose(0, 1)
    chain, outs, start = KVChain(), [], 0
    for count in torch.bincount(layout.depth).tolist():
        part = slice(start, start + count)
        attn = FlexAttention(build_block_mask(layout, start, start + count, start + count), chain)
        outs.append(attn(0, q[part], k[part], v[part]))
        start += count
    torch.testing.assert_close(torch.cat(outs), expected, rtol=1e-5, atol=1e-5)
    torch.cat(outs).sum().backward()  # gradients reach the earlier passes' keys
    assert k.grad is not None and bool((k.grad[: int((layout.depth == 0).sum())] != 0).any())


def _long_layout(seed, num_docs, k, r=0.8, r_min=0.2, max_len=700):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len, (num_docs,), generator=gen).tolist()
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    loss_mask = torch.rand(doc_ids.numel(), generator=gen) < 0.6
    return cod_sample(doc_ids, loss_mask, k, r, r_min, gen), doc_ids


def _same_tiles(a, b):
    for name in ("kv_num", "kv_idx", "full_num", "full_idx"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, name
        if name.endswith("idx"):  # only the first num columns of a row are meaningful
            num = (a.kv_num if name == "kv_idx" else a.full_num)[0, 0]
            for row, n in enumerate(num.tolist()):
                assert torch.equal(x[0, 0, row, :n], y[0, 0, row, :n]), (name, row)
        else:
            assert torch.equal(x, y), name


@pytest.mark.parametrize("seed", range(6))
def test_host_tiles_equal_the_tiles_of_the_rule(seed):
    from peagle.training.cod import Layout
    from peagle.training.partition import plan_partition

    k = [3, 8, 12][seed % 3]
    layout, doc_ids = _long_layout(seed, num_docs=2 + seed, k=k)
    _same_tiles(block_tiles(layout), dense_tiles(layout))
    # Micro-batches laid side by side, and the segments of the sequence partition.
    other, other_docs = _long_layout(seed + 100, num_docs=3, k=k)
    both = Layout.concat([layout, other], [doc_ids.numel(), other_docs.numel()],
                         [int(doc_ids.max()) + 1, int(other_docs.max()) + 1])
    _same_tiles(block_tiles(both), dense_tiles(both))
    for segment in plan_partition(both, 3):
        sub = both.select(segment.elements)
        _same_tiles(block_tiles(sub), dense_tiles(sub))
    # EAGLE-3's chained passes: the queries of one depth against every key up to it.
    start = 0
    for count in torch.bincount(layout.depth).tolist():
        _same_tiles(block_tiles(layout, start, start + count, start + count),
                    dense_tiles(layout, start, start + count, start + count))
        start += count


def test_host_tiles_of_a_layout_out_of_anchor_order_fall_back_to_the_rule():
    layout, _ = _long_layout(3, num_docs=3, k=4)
    n0 = int((layout.depth == 0).sum())
    order = torch.cat([torch.arange(n0).flip(0), torch.arange(n0, len(layout))])
    shuffled = layout.select(order)
    assert _ordered_by_anchor(layout) and not _ordered_by_anchor(shuffled)
    _same_tiles(block_tiles(shuffled), dense_tiles(shuffled))
    reference = dense_mask_reference(shuffled)
    mask = build_block_mask(shuffled, tiles=block_tiles(shuffled))
    assert torch.equal(_blocks_dense(mask) > 0, _blocks_dense(build_block_mask(shuffled)) > 0)
    assert bool(reference.any())
