"""DraftPlanner on the host: the load's K, the drafts proposed, when a rise in K is padded, and when a step launched
ahead of the answer in flight must wait for it. The engine end to end: test_engine_spec.py."""

from __future__ import annotations

import pytest

from peagle.engine.config import AdaptivePolicy, EngineConfig
from peagle.engine.draft_plan import DraftPlan, DraftPlanner

POLICY = AdaptivePolicy(thresholds=((1, 4), (4, 2)), above=1)


class Seq:
    def __init__(self, num_tokens: int, num_computed: int, drafts=()):
        self.token_ids = list(range(num_tokens))
        self.num_computed_tokens = num_computed
        self.draft_token_ids = list(drafts)
        self.num_proposed_drafts = len(drafts)

    @property
    def num_tokens(self):
        return len(self.token_ids)


def planner(verified_only: bool = True, k: int = 4) -> DraftPlanner:
    return DraftPlanner(k, POLICY, propose_verified_only=verified_only, max_model_len=40)


def test_load_k_draft_count_and_graph_ks():
    p = planner()
    assert [p.load_k(n) for n in (1, 3, 4, 9)] == [4, 2, 2, 1]
    assert (p.draft_count(2), p.draft_count(0)) == (2, 4)  # after a step without drafts: the engine's K
    assert planner(verified_only=False).draft_count(2) == 4
    assert p.graph_ks() == [1, 2, 4]
    none = DraftPlanner(0, max_model_len=40)  # no drafter
    assert (none.load_k(1), none.graph_ks(), none.plan([Seq(9, 8)], [[]], 0)) == (0, [0], DraftPlan(0))


def test_trim_keeps_the_load_k_and_room_before_max_model_len():
    seqs = [Seq(10, 10, [1, 2, 3, 4]), Seq(38, 38, [1, 2, 3, 4])]
    planner().trim(seqs, 3)
    assert [s.draft_token_ids for s in seqs] == [[1, 2, 3], [1, 2]]


def test_a_rise_is_padded_where_every_request_decodes():
    p = planner()
    decodes = [Seq(10, 9, [5]), Seq(12, 11, [6])]
    drafts = [s.draft_token_ids for s in decodes]
    assert p.plan(decodes, drafts, 4) == DraftPlan(4, 4, pad=True)
    assert p.plan(decodes, drafts, 1) == DraftPlan(1, 1)  # no rise
    assert p.plan(decodes, drafts, 4, logits_processing=True) == DraftPlan(1, 1)  # the drafts are history there
    assert p.plan(decodes, drafts, 4, chunks=[2, 2]) == DraftPlan(1, 1)
    assert planner(verified_only=False).plan(decodes, drafts, 4) == DraftPlan(1, 4)  # the engine's K, no padding
    near_end = [Seq(10, 9, [5]), Seq(38, 37, [6])]
    assert p.plan(near_end, [s.draft_token_ids for s in near_end], 4) == DraftPlan(1, 1)
    beside_a_prompt = decodes + [Seq(6, 0)]
    assert p.plan(beside_a_prompt, drafts + [[]], 4) == DraftPlan(1, 1)


def test_speculation_off_drafts_only_over_new_prompts():
    p = DraftPlanner(4, AdaptivePolicy(thresholds=((2, 4),), above=0), max_model_len=40)
    decodes = [Seq(10, 9), Seq(12, 11), Seq(8, 7)]
    assert p.plan(decodes, [[], [], []], p.load_k(3)) == DraftPlan(0)
    assert p.plan(decodes + [Seq(5, 0)], [[]] * 4, p.load_k(4)) == DraftPlan(0, 4)  # the drafter reads the prompt
    assert p.plan(decodes[:2], [[], []], p.load_k(2)) == DraftPlan(0, 4)  # resumes: the engine's K


def test_a_step_launched_ahead_waits_for_a_rise_unless_it_admits():
    p = planner()
    assert p.plan_ahead(1, 2, admitting=False) is None  # K rose to 4 over 2 drafts: padded once the answer is in
    assert p.plan_ahead(1, 2, admitting=True) == DraftPlan(2, 2)
    assert p.plan_ahead(9, 4, admitting=False) == DraftPlan(1, 1)
    assert p.plan_ahead(3, 0, admitting=False) == DraftPlan(0, 4)


def test_engine_switches_must_be_bools():
    config = EngineConfig(model="m")
    assert (config.admit_ahead, config.fused_merge, config.mixed_tiles, config.propose_verified_only) == (
        True, True, True, True)
    for name in ("admit_ahead", "fused_merge", "mixed_tiles", "propose_verified_only"):
        with pytest.raises(ValueError, match=name):
            EngineConfig(model="m", **{name: "no"})
