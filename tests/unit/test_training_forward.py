"""The training forward agrees with the engine's drafting pass; the sequence partition preserves gradients."""

from __future__ import annotations

import pytest
import torch

from peagle.drafters.drafter import Drafter
from peagle.models.attention import DenseAttention
from peagle.models.loader import load_model, load_tokenizer
from peagle.training.cod import cod_sample, full_layout
from peagle.training.data import Document, PackedSequence
from peagle.training.forward import peagle_forward, ttt_forward
from peagle.training.loss import draft_kl_loss_reference
from peagle.training.objectives import Eagle3Objective, PEagleObjective
from peagle.training.teacher import run_target

K = 5


@pytest.fixture(scope="module")
def models(tiny_hf_checkpoint):
    path = tiny_hf_checkpoint("llama", num_layers=6)
    target = load_model(path, dtype="float32")
    tokenizer = load_tokenizer(path)
    drafters = {}
    for method, layers in (("peagle", 2), ("eagle3", 1)):
        drafter = Drafter.for_target(target, method, layers, tokenizer=tokenizer, aux_layer_ids=(1, 3, 4))
        # Fresh heads have zero mask_hidden and unit norms; randomise everything so no input path can hide.
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in drafter.parameters():
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen))
        drafters[method] = drafter
    return target, drafters


def _sequence(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    docs = [Document(torch.randint(6, vocab, (n,), generator=gen), torch.rand(n, generator=gen) < 0.8)
            for n in lengths]
    return PackedSequence.of(docs)


def _serve_logits(drafter, target, tokens, k):
    """The engine's P-EAGLE drafting pass for context `tokens` (t_0..t_c): real slots 0..c-1, MASK slots c..c+k-2."""
    c = tokens.numel() - 1
    features = target(tokens, torch.arange(c + 1), DenseAttention(), drafter.config.aux_layer_ids).aux[:c]
    ids = torch.cat([tokens[1:], torch.full((k - 1,), drafter.config.mask_token_id)])
    feats = torch.cat([features, drafter.mask_hidden.expand(k - 1, -1)])
    out = drafter(ids, torch.arange(c + k - 1), DenseAttention(), drafter.fc(feats))
    return drafter.compute_logits(out[c - 1:])  # drafts 1..k


def _serve_logits_eagle3(drafter, target, tokens, continuation, k):
    """The engine's chained EAGLE-3 passes, fed the true continuation as the accepted drafts."""
    c = tokens.numel() - 1
    features = target(tokens, torch.arange(c + 1), DenseAttention(), drafter.config.aux_layer_ids).aux[:c]
    ids, hidden = tokens[1:], drafter.fc(features)
    logits = []
    for step in range(k):
        out = drafter(ids, torch.arange(ids.numel()), DenseAttention(), hidden)
        logits.append(drafter.compute_logits(out[-1:]))
        ids = torch.cat([ids, continuation[step:step + 1]])
        hidden = torch.cat([hidden, out[-1:]])
    return torch.cat(logits)


@torch.no_grad()
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_training_forward_equals_drafting_pass(models, method):
    target, drafters = models
    drafter = drafters[method]
    seq = _sequence([23, 30], target.config.vocab_size)  # the context lives in the second document
    teacher = run_target(target, seq, drafter.config.aux_layer_ids, "cpu")
    layout = full_layout(seq.doc_ids, torch.ones(len(seq), dtype=torch.bool), K)
    forward = peagle_forward if method == "peagle" else ttt_forward
    logits = drafter.compute_logits(forward(drafter, teacher, layout, _counts(layout)))
    doc2 = seq.token_ids[23:]
    for c in (1, 4, 17):
        anchor = 23 + c - 1
        rows = [int(torch.nonzero((layout.anchor == anchor) & (layout.depth == d))) for d in range(K)]
        if method == "peagle":
            served = _serve_logits(drafter, target, doc2[:c + 1], K)
        else:
            served = _serve_logits_eagle3(drafter, target, doc2[:c + 1], doc2[c + 1:], K)
        torch.testing.assert_close(logits[rows], served, rtol=1e-4, atol=1e-4)


def _counts(layout):
    return tuple(torch.bincount(layout.depth).tolist())


def _grads(drafter):
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _reference_step(drafter, target, teacher, layout, method, denominator):
    """Today's formulation by plain autograd: one forward over every element, the teacher's logits per element."""
    forward = peagle_forward if method == "peagle" else ttt_forward
    hidden = forward(drafter, teacher, layout, _counts(layout))
    sel = torch.nonzero(layout.weight > 0).flatten()
    loss, correct = draft_kl_loss_reference(
        hidden[sel], teacher.hidden[layout.target[sel]], layout.weight[sel], denominator, drafter.compute_logits,
        target.compute_logits, torch.arange(drafter.d2t.numel()) + drafter.d2t)
    loss.backward()
    return loss.detach(), torch.bincount(layout.depth[sel], weights=correct.double(), minlength=K).long()


@pytest.mark.parametrize("method,segments,frozen_head", [
    ("peagle", 1, False), ("peagle", 2, False), ("peagle", 2, True), ("eagle3", 1, False), ("eagle3", 1, True)])
def test_step_equals_the_plain_autograd_step(models, method, segments, frozen_head):
    """The fused, planned step (teacher once per position, loss gradient formed in the forward, partition) computes
    the gradients of the plain formulation within fp32 rounding."""
    target, drafters = models
    drafter = drafters[method]
    drafter.lm_head.weight.requires_grad_(not frozen_head)
    seq = _sequence([40, 25, 31], target.config.vocab_size, seed=5)
    teacher = run_target(target, seq, drafter.config.aux_layer_ids, "cpu")
    objective = (PEagleObjective(K, 0.8, 0.2, num_segments=segments, loss_chunk=16) if method == "peagle"
                 else Eagle3Objective(K, loss_chunk=16))
    layout = objective.sample_layout(seq, torch.Generator().manual_seed(0))
    plan = objective.plan(seq, layout)
    denominator = plan.weight_sum
    assert denominator == float(layout.weight.sum()) and len(plan.forwards) == segments
    # The planned step reads block-mask tiles made on the host, one set per attention pass.
    assert all(f.tiles and len(f.tiles) == len(objective.passes(f.depth_counts)) for f in plan.forwards)
    drafter.zero_grad(set_to_none=True)
    ref_loss, ref_correct = _reference_step(drafter, target, teacher, layout, method, denominator)
    reference = _grads(drafter)
    drafter.zero_grad(set_to_none=True)
    stats = objective.backward(drafter, target, teacher, plan, denominator)
    fast = _grads(drafter)
    drafter.lm_head.weight.requires_grad_(True)
    assert fast.keys() == reference.keys() and ("lm_head.weight" in fast) != frozen_head
    for name in reference:
        torch.testing.assert_close(fast[name], reference[name], rtol=1e-4, atol=1e-6, msg=name)
    assert float(stats.loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert torch.equal(stats.correct, ref_correct)
    assert torch.equal(stats.total, torch.bincount(layout.depth[layout.weight > 0], minlength=K))


@pytest.mark.parametrize("segments", [2, 4])
def test_partitioned_gradients_equal_unpartitioned(models, segments):
    target, drafters = models
    drafter = drafters["peagle"]
    seq = _sequence([40, 25, 31], target.config.vocab_size, seed=3)
    teacher = run_target(target, seq, drafter.config.aux_layer_ids, "cpu")
    layout = cod_sample(seq.doc_ids, seq.loss_mask, K, 0.8, 0.2, torch.Generator().manual_seed(0))
    denominator = float(layout.weight.sum())
    results = []
    for s in (1, segments):
        drafter.zero_grad(set_to_none=True)
        objective = PEagleObjective(K, 0.8, 0.2, num_segments=s, loss_chunk=16)
        stats = objective.backward(drafter, target, teacher, objective.plan(seq, layout), denominator)
        results.append((stats, _grads(drafter)))
    (full, full_grads), (parts, part_grads) = results
    assert full_grads.keys() == part_grads.keys() and "mask_hidden" in full_grads
    for name in full_grads:
        torch.testing.assert_close(part_grads[name], full_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert float(parts.loss) == pytest.approx(float(full.loss), rel=1e-5)
    assert torch.equal(parts.total, full.total) and torch.equal(parts.correct, full.correct)


@torch.no_grad()
def test_padded_target_pass_keeps_the_outputs(models):
    """`run_target(pad_to=...)`: a padding document after the sequence's own changes none of their outputs (it
    attends to itself only) and is dropped; a sequence already that long is run as it is."""
    target, drafters = models
    aux = drafters["peagle"].config.aux_layer_ids
    seq = _sequence([23, 30, 9], target.config.vocab_size, seed=4)
    plain = run_target(target, seq, aux, "cpu")
    ran = []
    forward = target.forward
    target.forward = lambda ids, *args: ran.append(len(ids)) or forward(ids, *args)
    try:
        padded = run_target(target, seq, aux, "cpu", pad_to=128)
    finally:
        del target.forward
    assert ran == [128]  # one pass, at the padded length
    assert padded.features.shape == plain.features.shape and padded.hidden.shape == plain.hidden.shape
    torch.testing.assert_close(padded.features, plain.features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded.hidden, plain.hidden, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.token_ids, seq.token_ids) and padded.sequence.doc_lengths == seq.doc_lengths
    short = run_target(target, seq, aux, "cpu", pad_to=len(seq) - 5)
    assert torch.equal(short.features, plain.features)


@pytest.mark.parametrize("method,segments", [("peagle", 1), ("peagle", 2), ("eagle3", 1)])
def test_shape_padding_keeps_loss_gradients_and_counts(models, method, segments):
    """`pad_shapes` (--shape-multiple): the step's matrices get row counts that are multiples of the multiple
    (teacher rows, charged elements, and for P-EAGLE the drafter's rows and its feature projection), and the loss,
    every gradient and the per-depth counts are those of the unpadded step."""
    from peagle.training.plan import pad_shapes

    target, drafters = models
    drafter = drafters[method]
    seq = _sequence([150, 90, 61], target.config.vocab_size, seed=7)
    teacher = run_target(target, seq, drafter.config.aux_layer_ids, "cpu")
    make = (lambda m: PEagleObjective(K, 0.8, 0.2, num_segments=segments, loss_chunk=64, shape_multiple=m)
            if method == "peagle" else Eagle3Objective(K, loss_chunk=64, shape_multiple=m))
    layout = make(0).sample_layout(seq, torch.Generator().manual_seed(2))
    results, seen_rows = [], []
    for multiple in (0, 256):
        objective = make(multiple)
        plan = objective.plan(seq, layout)
        if multiple:
            assert plan.teacher_positions.numel() % multiple == 0 and plan.num_teacher_rows < multiple * 4
            for f in plan.forwards:
                assert f.charged.numel() % multiple == 0 and f.num_charged <= f.charged.numel()
                assert bool((f.weight[f.num_charged:] == 0).all())
                if method == "peagle":
                    assert f.rows % multiple == 0 and f.rows >= len(f.layout) and f.real_rows % multiple == 0
                    seen_rows.append(f.rows)
                else:
                    assert f.rows is None
        drafter.zero_grad(set_to_none=True)
        stats = objective.backward(drafter, target, teacher, plan, plan.weight_sum)
        results.append((stats, _grads(drafter)))
    (plain, plain_grads), (padded, padded_grads) = results
    assert plain_grads.keys() == padded_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(padded_grads[name], plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert float(padded.loss) == pytest.approx(float(plain.loss), rel=1e-6)
    assert torch.equal(padded.total, plain.total) and torch.equal(padded.correct, plain.correct)
    if method == "peagle":
        assert any(rows > len(f.layout) for rows, f in zip(seen_rows, objective.plan(seq, layout).forwards))
    with pytest.raises(ValueError, match="multiple of 128"):
        pad_shapes(make(0).plan(seq, layout), 100, drafter_rows=True)


def test_padded_tiles_let_padding_rows_see_only_one_another():
    """`Tiles.padded`: the real elements' tiles are kept; each new row of query tiles touches its diagonal tile
    only; with the padded mask_mod, padding elements see one another and nothing real, and no real element sees
    them (checked pair by pair against the dense rule)."""
    from peagle.training.mask import BLOCK_SIZE, block_tiles, layout_mask_mod

    seq = _sequence([150, 90, 61], 50, seed=9)
    layout = cod_sample(seq.doc_ids, seq.loss_mask, K, 0.8, 0.2, torch.Generator().manual_seed(3))
    n = len(layout)
    rows = -(-n // BLOCK_SIZE) * BLOCK_SIZE + 2 * BLOCK_SIZE
    blocks = rows // BLOCK_SIZE
    tiles = block_tiles(layout)
    padded = tiles.padded(blocks, blocks)
    old = tiles.kv_num.shape[-1]
    assert torch.equal(padded.kv_num[0, 0, :old], tiles.kv_num[0, 0])
    assert padded.kv_num[0, 0, old:].tolist() == [1] * (blocks - old)
    assert padded.kv_idx[0, 0, old:, 0].tolist() == list(range(old, blocks))
    assert padded.full_num[0, 0, old:].tolist() == [0] * (blocks - old)
    # Which pairs the tiles and mask_mod let through, densely, against the rule: reals as before, pads with pads.
    mask_mod = layout_mask_mod(layout, 0, rows)
    q, kv = torch.arange(rows)[:, None], torch.arange(rows)[None, :]
    allowed = torch.zeros(rows, rows, dtype=torch.bool)
    for r in range(blocks):
        listed = padded.kv_idx[0, 0, r, :padded.kv_num[0, 0, r]].tolist()
        full = padded.full_idx[0, 0, r, :padded.full_num[0, 0, r]].tolist()
        for c in listed + full:
            qs, ks = slice(r * BLOCK_SIZE, (r + 1) * BLOCK_SIZE), slice(c * BLOCK_SIZE, (c + 1) * BLOCK_SIZE)
            allowed[qs, ks] = True if c in full else mask_mod(0, 0, q[qs], kv[:, ks])
    from peagle.training.mask import dense_mask_reference

    assert torch.equal(allowed[:n, :n], dense_mask_reference(layout))
    assert not allowed[:n, n:].any() and not allowed[n:, :n].any()
    assert bool(allowed[n:, n:].any(dim=1).all())  # every padding row sees something (itself at least)
