"""COD sampling: the worked example, nesting, counts, loss-mask handling, documents."""

from __future__ import annotations

import pytest
import torch

from peagle.training.cod import cod_sample, document_starts, full_layout


def _pairs(layout):
    return list(zip(layout.anchor.tolist(), layout.depth.tolist()))


def _random_case(seed, k=6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (4,), generator=gen).tolist()
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    loss_mask = torch.rand(doc_ids.numel(), generator=gen) < 0.6
    return doc_ids, loss_mask, gen


def test_worked_example_from_the_docstring():
    doc_ids = torch.zeros(8, dtype=torch.long)
    loss_mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    layout = cod_sample(doc_ids, loss_mask, k_train=3, r=0.5, r_min=0.0, generator=torch.Generator().manual_seed(0))
    assert layout.depth_counts(3) == [7, 3, 1]
    assert _pairs(layout)[:7] == [(a, 0) for a in range(7)]
    assert layout.weight[:7].tolist() == [0, 0, 1, 1, 1, 1, 0]
    deep = [(a, d) for a, d in _pairs(layout) if d > 0]
    assert all(a <= 4 for a, d in deep if d == 1) and all(a <= 3 for a, d in deep if d == 2)
    i = len(layout) - 1  # the depth-2 element
    a = int(layout.anchor[i])
    assert int(layout.position[i]) == a + 2 and int(layout.target[i]) == a + 3
    assert float(layout.weight[i]) == float(loss_mask[a + 4])


def test_full_expansion_keeps_every_element_whose_prediction_exists():
    doc_ids = torch.tensor([0] * 6 + [1] * 4)
    layout = full_layout(doc_ids, torch.ones(10, dtype=torch.bool), k=3)
    # A doc of length L has L-1 real slots; depth d needs token a+d+2 inside the document.
    expected = [(a, 0) for a in [0, 1, 2, 3, 4, 6, 7, 8]]
    expected += [(a, 1) for a in [0, 1, 2, 6]] + [(a, 2) for a in [0, 1]]
    assert _pairs(layout) == expected
    assert layout.doc.tolist() == [0] * 5 + [1] * 3 + [0] * 3 + [1] + [0] * 2
    assert layout.position.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 1, 2, 3, 1, 2, 3]
    assert layout.weight.tolist() == [1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("seed", range(5))
def test_nesting_depth_major_order_and_document_bounds(seed):
    doc_ids, loss_mask, gen = _random_case(seed)
    layout = cod_sample(doc_ids, loss_mask, 6, r=0.7, r_min=0.2, generator=gen)
    pairs = set(_pairs(layout))
    assert len(pairs) == len(layout)
    for a, d in pairs:
        if d > 0:
            assert (a, d - 1) in pairs  # nested: every rollout is a prefix of the inference-time one
    depth = layout.depth.tolist()
    assert depth == sorted(depth)  # depth-major
    for d in range(6):
        anchors = layout.anchor[layout.depth == d]
        assert torch.equal(anchors, anchors.sort().values)
    _, end = document_starts(doc_ids)
    assert bool((layout.anchor + layout.depth + 2 <= end[layout.anchor]).all() | (layout.depth == 0).all())
    deep = layout.depth > 0
    assert bool((layout.anchor[deep] + layout.depth[deep] + 2 < end[layout.anchor[deep]]).all())
    assert torch.equal(layout.doc, doc_ids[layout.anchor])
    assert torch.equal(layout.target, layout.anchor + layout.depth + 1)


@pytest.mark.parametrize("seed", range(3))
def test_counts_follow_r_and_r_min(seed):
    n = 400
    doc_ids = torch.zeros(n, dtype=torch.long)
    loss_mask = torch.ones(n, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    layout = cod_sample(doc_ids, loss_mask, 8, r=0.8, r_min=0.2, generator=gen)
    n_roll = n - 3  # anchors whose depth-1 prediction a+3 exists
    assert layout.depth_counts(8) == [n - 1] + [int(n_roll * max(0.8**d, 0.2) + 0.5) for d in range(1, 8)]
    everything = cod_sample(doc_ids, loss_mask, 8, r=1.0, r_min=0.0, generator=gen)
    assert everything.depth_counts(8) == [n - 1] + [n - 2 - d for d in range(1, 8)]
    # At the floor the quota stays round(n_loss * r_min); only parents too close to the end cannot continue.
    floor = cod_sample(doc_ids, loss_mask, 8, r=0.1, r_min=0.5, generator=gen).depth_counts(8)
    quota = int(n_roll * 0.5 + 0.5)
    assert floor[1] == quota
    assert all(quota - d <= floor[d] <= floor[d - 1] for d in range(2, 8))


def test_sampling_is_random_but_reproducible():
    doc_ids, loss_mask, _ = _random_case(0)
    a = cod_sample(doc_ids, loss_mask, 6, 0.6, 0.1, torch.Generator().manual_seed(5))
    b = cod_sample(doc_ids, loss_mask, 6, 0.6, 0.1, torch.Generator().manual_seed(5))
    c = cod_sample(doc_ids, loss_mask, 6, 0.6, 0.1, torch.Generator().manual_seed(6))
    assert _pairs(a) == _pairs(b) and _pairs(a) != _pairs(c)


def test_loss_mask_handling():
    # Prompt 0..9, response 10..19, then a prompt-only document 20..29 that contributes only context.
    doc_ids = torch.tensor([0] * 20 + [1] * 10)
    loss_mask = torch.tensor([False] * 10 + [True] * 10 + [False] * 10)
    layout = cod_sample(doc_ids, loss_mask, 4, r=1.0, r_min=0.0, generator=torch.Generator())
    predicted = layout.anchor + layout.depth + 2
    assert torch.equal(layout.weight.bool(), loss_mask[predicted.clamp(max=29)] & (predicted < 20))
    deep = layout.depth > 0
    # Rollouts exist only where some element of them predicts a response token.
    assert bool((layout.anchor[deep] + 3 + 2 >= 10).all() & (layout.doc[deep] == 0).all())
    assert int((layout.depth == 0).sum()) == 19 + 9  # every real slot stays, as context
    assert layout.depth_counts(4)[1] == 12  # anchors 5..16 reach a response token by depth 3
    none = cod_sample(doc_ids, torch.zeros(30, dtype=torch.bool), 4, 0.8, 0.2, torch.Generator())
    assert none.depth_counts(4) == [28, 0, 0, 0] and float(none.weight.sum()) == 0


@pytest.mark.parametrize("kwargs", [dict(k_train=0, r=0.8, r_min=0.2), dict(k_train=4, r=0.0, r_min=0.2),
                                    dict(k_train=4, r=0.8, r_min=1.5)])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        cod_sample(torch.zeros(5, dtype=torch.long), torch.ones(5, dtype=torch.bool), **kwargs)
