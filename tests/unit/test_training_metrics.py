"""The held-out acceptance metrics: the serving walk and the simulated average, on hand-made documents."""

from __future__ import annotations

import pytest
import torch

from peagle.training.cod import full_layout
from peagle.training.metrics import EvalStats, leading_right, response_spans, walk
from peagle.training.forward import StepStats


def test_walk_of_the_docstring_example():
    # Prompt 0..3, response 4..11, K = 3; lead[3] = 1, lead[5] = 3, lead[9] = 2 (the rest never visited).
    lead = [0, 0, 0, 1, 0, 3, 0, 0, 0, 2, 0, 0]
    assert walk(lead, [(4, 12)], 3) == (1 + 3 + 1, 3)
    # With 1 draft per round: rounds from anchors 3 (accepts 1), 5 (1), 7 (0), 8 (0), 9 (1): tokens 5..11.
    assert walk(lead, [(4, 12)], 1) == (3, 5)


def test_walk_rounds_start_where_the_last_one_failed():
    # Prompt token 0, response 1..12, K = 3; the head is right three deep from odd anchors, wrong from even ones.
    # The average over anchors says 1 + 1.5; the walk starts at anchor 0 (wrong), then 1, 5, 9 (all right): its
    # rounds land on the odd anchors, 4 rounds accepting 0 + 3 + 3 + 2 (the last one only has 2 tokens left).
    lead = [3 if a % 2 else 0 for a in range(13)]
    assert walk(lead, [(1, 13)], 3) == (8, 4)


def test_response_spans_split_at_prompts_and_documents():
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    docs = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    assert response_spans(mask, docs) == [(2, 4), (5, 7), (7, 10)]


def one_document(n: int, prompt: int, k: int):
    """(doc_ids, loss mask, full layout to depth k, its charged elements) of one document: prompt, then response."""
    doc_ids = torch.zeros(n, dtype=torch.long)
    mask = torch.arange(n) >= prompt
    layout = full_layout(doc_ids, mask, k)
    return doc_ids, mask, layout, layout.weight > 0


def test_eval_stats_from_a_full_layout():
    # One document: prompt 0..2, response 3..9; K = 2. The head is right at depth 0 everywhere, wrong at depth 1
    # except for anchor 4.
    n, k = 10, 2
    doc_ids, mask, layout, charged = one_document(n, 3, k)
    anchor, depth = layout.anchor[charged], layout.depth[charged]
    correct = (depth == 0) | (anchor == 4)
    lead, complete = leading_right(layout, correct, n, k)
    assert lead[4] == 2 and lead[3] == 1 and lead[2] == 1
    total = torch.bincount(depth, minlength=k)
    stats = EvalStats.of(StepStats(torch.zeros(()), total, torch.zeros(k, dtype=torch.long)), layout, correct,
                         mask, doc_ids, k)
    # Walk with K = 2: the prefill gives token 3; anchor 2 accepts 1 (token 4), target gives 5; anchor 4 accepts 2
    # (6, 7), target gives 8; anchor 7 has token 9 left and accepts it: 3 rounds, 4 accepted.
    assert stats.walked[1].tolist() == [4, 3]
    assert stats.walk_acceptance_length(2) == pytest.approx(1 + 4 / 3)
    # Simulated: complete rollouts are anchors 1..6 (both drafts predict response tokens 3..9);
    # anchor 1 predicts token 3 at depth 0 (right) and 4 at depth 1 (wrong): leads 1,1,1,2,1,1.
    assert complete.tolist() == [False, True, True, True, True, True, True, False, False, False]
    assert stats.acceptance_length(2) == pytest.approx(1 + 7 / 6)


def test_walk_per_source_splits_the_walk_by_document_group():
    # Two documents, each prompt 0..2 then response: document 0 (source 1) right three deep everywhere, document 1
    # (source 0) wrong everywhere. K = 2.
    n0, n1, k = 10, 8, 2
    doc_ids = torch.cat([torch.zeros(n0, dtype=torch.long), torch.ones(n1, dtype=torch.long)])
    mask = torch.cat([torch.arange(n0) >= 3, torch.arange(n1) >= 3])
    layout = full_layout(doc_ids, mask, k)
    charged = layout.weight > 0
    correct = doc_ids[layout.anchor[charged]] == 0
    total = torch.bincount(layout.depth[charged], minlength=k)
    stats = EvalStats.of(StepStats(torch.zeros(()), total, torch.zeros(k, dtype=torch.long)), layout, correct,
                         mask, doc_ids, k, doc_groups=[1, 0], num_groups=3)
    assert stats.walked_groups.shape == (3, k, 2)
    ungrouped = EvalStats.of(StepStats(torch.zeros(()), total, torch.zeros(k, dtype=torch.long)), layout, correct,
                             mask, doc_ids, k)
    assert torch.equal(stats.walked, ungrouped.walked)  # the groups split the whole walk
    assert torch.equal(stats.walked_groups.sum(0), ungrouped.walked)
    assert stats.walk_acceptance_length(2, group=0) == pytest.approx(1.0)  # nothing accepted
    # Document 0 walked alone: every draft right, so rounds accept 2 each (the last what is left).
    first = full_layout(doc_ids[:n0], mask[:n0], k)
    right = torch.ones(int((first.weight > 0).sum()), dtype=torch.bool)
    alone = EvalStats.of(StepStats(torch.zeros(()), total, torch.zeros(k, dtype=torch.long)), first, right,
                         mask[:n0], doc_ids[:n0], k)
    assert stats.walked_groups[1].tolist() == alone.walked.tolist() and alone.walked[1].tolist() == [4, 2]
    assert stats.walked_groups[2].sum() == 0 and torch.isnan(torch.tensor(stats.walk_acceptance_length(2, group=2)))
    combined = stats + stats
    assert torch.equal(combined.walked_groups, 2 * stats.walked_groups)


def test_walk_tokens_cover_the_first_tokens_of_each_response_only():
    # Prompt 0..2, response 3..9 (7 tokens), K = 2. The head is wrong from anchors 2..4 and right two deep from
    # anchors 5 on, as in an answer that falls into a loop: the loop's easy rounds lie past a 3-token horizon.
    n, k = 10, 2
    doc_ids, mask, layout, charged = one_document(n, 3, k)
    correct = layout.anchor[charged] >= 5
    total = torch.bincount(layout.depth[charged], minlength=k)
    stats = lambda **kw: EvalStats.of(StepStats(torch.zeros(()), total, torch.zeros(k, dtype=torch.long)),  # noqa
                                      layout, correct, mask, doc_ids, k, **kw)
    # Whole response: the prefill gives 3; rounds from anchors 2, 3, 4 accept nothing (the target gives 4, 5, 6);
    # anchor 5 accepts 7, 8 and the target gives 9: 4 rounds, 2 accepted.
    assert stats().walked[1].tolist() == [2, 4]
    # The first 3 response tokens (3..5): rounds from anchors 2 and 3 produce 4 and 5, nothing accepted.
    assert stats(walk_tokens=3).walked[1].tolist() == [0, 2]
    assert stats(walk_tokens=100).walked[1].tolist() == [2, 4]
