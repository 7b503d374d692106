"""Draft confidence on the CPU: each request verifies only the drafts its drafter is confident in
(engine/spec/confidence.py), and the output stays plain decoding's.

The tiny random heads are confident in little, so most end-to-end tests make the drafter's probabilities
pseudo-random (`varied_confidence`: a function of the draft token, the same in every path) so that cutoffs cut
requests at every depth, and some feed the true continuation as drafts (`oracle_drafts`) so that many drafts are
accepted inside the compact layouts. Confidence reads the drafter only, so any probabilities keep the output exact.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from engine_helpers import cpu_llm, greedy, heads, oracle_proposer, spec_config, target_dir  # noqa: F401
from test_engine_verifier import CHI2_CRIT_P001, chi_square

from peagle import SamplingParams
from peagle.drafters.policy import POLICY_FILE
from peagle.engine.config import AdaptivePolicy, EngineConfig, SpeculativeConfig
from peagle.engine.draft_plan import PAD_DRAFT, DraftPlan, DraftPlanner
from peagle.engine.spec import proposer as proposer_module
from peagle.engine.spec.confidence import confident_count, draft_probability, truncate_drafts
from peagle.engine.spec.verifier import verify_greedy, verify_sampled
from peagle.kernels import advance_decode_inputs_ref, compact_decode_inputs

PROMPTS = [[7, 20, 31, 40], [9, 15], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30], [50, 60, 70], [80, 81, 82, 83]]
LENGTHS = [8, 30, 12, 24, 16, 20]  # requests finish apart, so prompts are admitted beside decodes


def make_llm(target_dir, head, method, k=4, **kw):
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("async_scheduling", False)
    return cpu_llm(target_dir, spec_config(head, k, method == "peagle"), **kw)


@pytest.fixture(scope="module")
def reference(target_dir):
    llm = cpu_llm(target_dir, async_scheduling=False)
    outs = llm.generate(PROMPTS, greedy(40), use_tqdm=False)
    return [p + o.token_ids for p, o in zip(PROMPTS, outs)]


def pseudo_probability(logits: torch.Tensor) -> torch.Tensor:
    """A probability in (0, 1) per row that depends on the row's argmax only: the same draft gets the same
    confidence in every path (eager, padded, compact), and drafts of one chain differ."""
    return ((logits.argmax(-1) * 2654435761) % 1009).float() / 1009 * 0.98 + 0.02


@pytest.fixture
def varied_confidence(monkeypatch):
    monkeypatch.setattr(proposer_module, "draft_probability", pseudo_probability)


def oracle_drafts(runner, reference, rng):
    """The runner's proposer (still run, its truncation too) answers the true continuation with a random corruption
    as its confident drafts, keeping its own PAD_DRAFT cut: rounds then accept up to every verified draft."""
    oracle_proposer(runner, reference, rng, keep_cuts=True)


def check_outputs(outs, reference, lengths=LENGTHS):
    for prompt, ref, out, n in zip(PROMPTS, reference, outs, lengths):
        assert out.token_ids == ref[len(prompt):len(prompt) + n]


def check_counts(outs, k):
    for o in outs:
        m = o.metrics
        assert m.num_accepted_tokens <= m.num_verified_tokens <= m.num_draft_tokens <= k * m.num_drafting_rounds
        assert sum(m.accepted_per_position) == m.num_accepted_tokens


# ---- the rule -------------------------------------------------------------------------------------------------


def test_confidence_is_the_running_product_and_cuts_a_prefix():
    probs = torch.tensor([[0.9, 0.8, 0.95, 0.3], [0.4, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    cutoff = torch.tensor(0.5)
    assert confident_count(probs, cutoff).tolist() == [3, 0, 4]  # 0.9, 0.72, 0.684, 0.205 for the first
    drafts = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    assert truncate_drafts(drafts, probs, cutoff).tolist() == [[5, 6, 7, -1], [-1, -1, -1, -1], [9, 9, 9, 9]]
    assert truncate_drafts(drafts, probs, torch.tensor(0.0)).tolist() == drafts.tolist()  # 0 cuts nothing
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.25, 0.5, 0.25]]))
    torch.testing.assert_close(draft_probability(logits), torch.tensor([0.7, 0.5]))


def test_verifying_a_confident_prefix_is_verifying_those_drafts_alone():
    # Greedy and sampled verification of drafts cut to a prefix (PAD_DRAFT after it, in the padded layout) answer
    # what verifying the prefix alone answers (the compact layout): accepted drafts, then the recovered or bonus
    # token from the target's row after them.
    torch.manual_seed(0)
    b, k, v = 256, 4, 6
    probs = torch.softmax(torch.randn(b, k + 1, v) * 2, dim=-1)
    drafts = probs[:, :k].argmax(-1)
    n = torch.randint(0, k + 1, (b,))
    cut = torch.where(torch.arange(k)[None, :] < n[:, None], drafts, torch.full_like(drafts, PAD_DRAFT))
    g = verify_greedy(probs.argmax(-1), cut, torch.full((b,), k))
    compact = verify_greedy(probs.argmax(-1), drafts, n)
    assert g.num_accepted.tolist() == compact.num_accepted.tolist() == n.tolist()
    assert g.next_tokens.tolist() == compact.next_tokens.tolist()
    u, noise = torch.rand(b, k), torch.empty(b, v).exponential_()
    s = verify_sampled(probs, cut, torch.full((b,), k), u, noise)
    c = verify_sampled(probs, drafts, n, u, noise)
    assert s.num_accepted.tolist() == c.num_accepted.tolist() and s.next_tokens.tolist() == c.next_tokens.tolist()
    assert (s.num_accepted <= n).all()


@pytest.mark.parametrize("cutoff", [0.3, 0.7])
def test_sampling_with_a_cutoff_keeps_the_target_distribution(cutoff):
    # Fixed target rows and drafts whose confidence decides how many are verified. The first emitted token follows
    # the target's first row (an accepted draft, a recovered token, or the bonus token where the cut left no draft);
    # given the first draft was accepted, the second token follows the second row, whether it is a verified draft,
    # the recovered token or the bonus token after a cut.
    torch.manual_seed(1)
    v, k, trials = 6, 3, 200_000
    p = torch.softmax(torch.randn(k + 1, v) * 1.5, dim=-1)
    drafts = p[:k].argmax(-1)
    g = torch.Generator().manual_seed(2)
    draft_probs = torch.rand(trials, k, generator=g)  # the drafter's own, independent of the target's dice
    cut = truncate_drafts(drafts[None].expand(trials, -1), draft_probs, torch.tensor(cutoff))
    u = torch.rand(trials, k, generator=g)
    noise = torch.empty(trials, v).exponential_(generator=g)
    out = verify_sampled(p[None].expand(trials, -1, -1), cut, torch.full((trials,), k), u, noise)
    first = out.output_tokens[:, 0]
    stat, dof = chi_square(torch.bincount(first, minlength=v).float(), p[0])
    assert stat < CHI2_CRIT_P001[dof], (stat, dof)
    second = out.output_tokens[out.num_accepted >= 1, 1]
    assert second.numel() > 5000
    stat, dof = chi_square(torch.bincount(second, minlength=v).float(), p[1])
    assert stat < CHI2_CRIT_P001[dof], (stat, dof)
    assert ((cut[:, 0] < 0) & (out.num_accepted > 0)).sum() == 0  # nothing past a cut is accepted


# ---- the compact layout of a step launched ahead ---------------------------------------------------------------


def compact_out(rows: int, b: int, k: int, first: int = 0) -> dict[str, torch.Tensor]:
    z = lambda *s: torch.zeros(s, dtype=torch.long)  # noqa: E731
    qsl = torch.full((b + 1,), first, dtype=torch.int32)
    return {"input_ids": z(rows), "positions": z(rows), "slot_mapping": z(rows), "query_start_loc": qsl,
            "logit_rows": z(b, k + 1), "drafts": z(b, k), "num_drafts": z(b)}


def test_compact_layout_is_the_decode_layout_when_every_draft_is_held():
    torch.manual_seed(3)
    b, k, bs, scratch = 5, 3, 4, 9
    packed = torch.randint(1, 90, (b, k + 1 + 1 + k + 1))
    packed[:, k + 1] = torch.tensor([0, 3, 1, 2, 0])  # drafts accepted in the step in flight
    src, base = torch.tensor([2, 0, 4, 1, -1]), torch.tensor([7, 3, 12, 5, 0])
    tables = torch.randint(0, scratch, (b, 6), dtype=torch.int32)
    ref = {"input_ids": torch.zeros(b * (k + 1), dtype=torch.long), "positions": torch.zeros(b * (k + 1), dtype=torch.long),
           "slot_mapping": torch.zeros(b * (k + 1), dtype=torch.long), "drafts": torch.zeros(b, k, dtype=torch.long),
           "num_drafts": torch.zeros(b, dtype=torch.long)}
    advance_decode_inputs_ref(packed, src, base, tables, k, k, bs, scratch, ref)
    out = compact_out(4 * (k + 1), b, k)  # four real requests, the fifth padding
    compact_decode_inputs(packed, src, base, tables, k, k, bs, scratch, 0, out)
    real = 4 * (k + 1)
    for name in ("input_ids", "positions", "slot_mapping"):
        assert out[name].tolist() == ref[name][:real].tolist(), name
    assert out["drafts"][:4].tolist() == ref["drafts"][:4].tolist()
    assert out["num_drafts"].tolist() == [k] * 4 + [0]
    assert out["query_start_loc"].tolist() == [0, 4, 8, 12, 16, 16]
    assert out["logit_rows"][:4].reshape(-1).tolist() == list(range(real))


def test_compact_layout_packs_held_drafts_and_cuts_the_deepest_to_fit():
    b, k, bs, scratch = 3, 3, 4, 9
    # request rows: next token at column num_accepted, drafts after column k + 1, PAD_DRAFT past the confident ones
    packed = torch.tensor([[10, -1, -1, -1, 0, 11, 12, 13, 0],
                           [20, 21, -1, -1, 1, 22, -1, -1, 0],
                           [30, -1, -1, -1, 0, -1, -1, -1, 0]])
    src, base = torch.tensor([0, 1, 2]), torch.tensor([4, 8, 2])
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    out = compact_out(7, b, k, first=5)  # two prompt rows and requests before them: rows 5.. are ours
    compact_decode_inputs(packed, src, base, tables, k, k, bs, scratch, 5, out)
    assert out["input_ids"].tolist() == [10, 11, 12, 13, 21, 22, 30]
    assert out["positions"].tolist() == [4, 5, 6, 7, 9, 10, 2]
    assert out["query_start_loc"].tolist() == [5, 9, 11, 12]
    assert out["num_drafts"].tolist() == [3, 1, 0]
    assert out["logit_rows"].tolist() == [[5, 6, 7, 8], [9, 10, 10, 10], [11, 11, 11, 11]]
    small = compact_out(5, b, k)  # 3 next tokens + 2 drafts: every request cut to one draft
    compact_decode_inputs(packed, src, base, tables, k, k, bs, scratch, 0, small)
    assert small["num_drafts"].tolist() == [1, 1, 0] and small["input_ids"].tolist() == [10, 11, 21, 22, 30]
    roomy = compact_out(10, b, k)  # spare rows are padding in the scratch block
    compact_decode_inputs(packed, src, base, tables, k, k, bs, scratch, 0, roomy)
    assert roomy["slot_mapping"][7:].tolist() == [scratch * bs + j for j in range(3)]
    assert roomy["query_start_loc"].tolist() == [0, 4, 6, 7]


def test_planner_lays_out_the_load_k_and_sizes_the_budget():
    policy = AdaptivePolicy(thresholds=((1, 4),), above=2, cutoffs=((1, 0.0),), cutoff_above=0.3)
    p = DraftPlanner(4, policy, max_model_len=64)
    assert p.confident and (p.cutoff(1), p.cutoff(5)) == (0.0, 0.3)
    assert not DraftPlanner(4, policy, max_model_len=64, confidence_cutoff=0.0).confident  # the option turns it off
    assert DraftPlanner(4, max_model_len=64, confidence_cutoff=0.2).cutoff(50) == 0.2
    assert not DraftPlanner(4, max_model_len=64).confident

    class Seq:
        token_ids, num_computed_tokens = list(range(10)), 9
        num_tokens = 10

    # requests holding 1 and 0 of their confident drafts: verified as they are, the load's K proposed, no padding
    assert p.plan([Seq(), Seq()], [[5], []], 2) == DraftPlan(2, 2)
    assert DraftPlanner.compact_budget([1], 7) == 8  # one request alone is never cut
    assert DraftPlanner.compact_budget([2] * 64, 7) == 64 + 160 + 7
    assert DraftPlanner.compact_budget([7] * 4, 7) == 4 * 8  # never more than every draft


# ---- end to end: greedy output is plain greedy's ---------------------------------------------------------------


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
@pytest.mark.parametrize("cutoff", [0.0, 0.05, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_with_a_cutoff_equals_plain_greedy(target_dir, heads, reference, varied_confidence, method, cutoff,
                                                  async_scheduling):
    llm = make_llm(target_dir, heads[method], method, draft_confidence_cutoff=cutoff,
                   async_scheduling=async_scheduling)
    oracle_drafts(llm.engine.runner, reference, random.Random(0))
    outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS], use_tqdm=False)
    check_outputs(outs, reference)
    check_counts(outs, 4)
    verified = sum(o.metrics.num_verified_tokens for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    if cutoff == 0.0:
        assert verified == drafted  # off: every draft verified
    elif cutoff == 1.0:
        assert verified == 0 and drafted > 0  # nothing is certain: plain decoding steps
    else:
        assert 0 < verified < drafted
    if 0 < cutoff < 1:
        assert sum(o.metrics.num_accepted_tokens for o in outs) > 10  # accepted drafts inside cut rounds
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_real_drafter_confidence_keeps_greedy_output(target_dir, heads, reference, method):
    # The heads' own softmax probabilities (no stand-in), async scheduling, a cutoff that cuts some drafts.
    llm = make_llm(target_dir, heads[method], method, draft_confidence_cutoff=1e-3, async_scheduling=True)
    outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS], use_tqdm=False)
    check_outputs(outs, reference)
    check_counts(outs, 4)


def test_async_steps_with_cut_drafts_are_packed_on_the_device(target_dir, heads, reference, varied_confidence):
    llm = make_llm(target_dir, heads["peagle"], "peagle", draft_confidence_cutoff=0.3, async_scheduling=True)
    runner = llm.engine.runner
    oracle_drafts(runner, reference, random.Random(1))
    calls, real = [], runner.launch_compact

    def launch_compact(prev, rows, seqs, new, *a, **kw):
        calls.append(len(new))
        return real(prev, rows, seqs, new, *a, **kw)

    runner.launch_compact = launch_compact
    outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS], use_tqdm=False)
    check_outputs(outs, reference)
    assert any(n == 0 for n in calls) and any(n > 0 for n in calls)  # decodes alone, and beside admitted prompts


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_graph_shaped_general_steps_keep_greedy_output(target_dir, heads, reference, varied_confidence, method):
    # The general graphs' padded static buffers, run eagerly on the CPU: host-built steps of requests holding
    # different numbers of drafts, and steps launched ahead packed into a graph's token bucket.
    for async_scheduling in (False, True):
        llm = make_llm(target_dir, heads[method], method, draft_confidence_cutoff=0.3,
                       async_scheduling=async_scheduling)
        llm.engine.runner.general_graphs = llm.engine.general_graphs(capture=False)
        oracle_drafts(llm.engine.runner, reference, random.Random(2))
        keys, real_load = [], llm.engine.runner.general_graphs.load_inputs

        def load_inputs(inp, key, *a, **kw):
            keys.append(key)
            return real_load(inp, key, *a, **kw)

        llm.engine.runner.general_graphs.load_inputs = load_inputs
        outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS], use_tqdm=False)
        check_outputs(outs, reference)
        check_counts(outs, 4)
        assert keys


def test_chunked_prefill_keeps_greedy_output(target_dir, heads, reference, varied_confidence):
    llm = make_llm(target_dir, heads["peagle"], "peagle", draft_confidence_cutoff=0.3, async_scheduling=True,
                   enable_chunked_prefill=True, max_num_batched_tokens=24)
    oracle_drafts(llm.engine.runner, reference, random.Random(3))
    long = [list(range(100, 140))]  # longer than a step: prefilled in chunks beside the decodes
    plain = cpu_llm(target_dir)
    want = plain.generate(long, greedy(12), use_tqdm=False)[0].token_ids
    outs = llm.generate(PROMPTS + long, [greedy(n) for n in LENGTHS] + [greedy(12)], use_tqdm=False)
    check_outputs(outs, reference)
    assert outs[-1].token_ids == want


def test_prefix_caching_keeps_greedy_output(target_dir, heads, varied_confidence):
    # Prompts sharing two full blocks: the second wave starts from the cached blocks of the first.
    prompts = [list(range(100, 135)), list(range(100, 132)) + [7, 8, 9], list(range(100, 133))]
    plain = cpu_llm(target_dir)
    want = [o.token_ids for o in plain.generate(prompts, greedy(16), use_tqdm=False)]
    llm = make_llm(target_dir, heads["peagle"], "peagle", draft_confidence_cutoff=0.3, async_scheduling=True,
                   enable_prefix_caching=True)
    for _ in range(2):
        outs = llm.generate(prompts, greedy(16), use_tqdm=False)
        assert [o.token_ids for o in outs] == want
    assert sum(o.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_structured_output_with_a_cutoff(target_dir, heads, varied_confidence, method):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": schema})
    plain = cpu_llm(target_dir)
    want = [o.token_ids for o in plain.generate(PROMPTS[:3], params, use_tqdm=False)]
    llm = make_llm(target_dir, heads[method], method, draft_confidence_cutoff=0.3, async_scheduling=True)
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    for o in outs:
        if o.finish_reason == "stop":
            json.loads(o.text)


def test_sampled_requests_with_a_cutoff(target_dir, heads, varied_confidence):
    llm = make_llm(target_dir, heads["peagle"], "peagle", draft_confidence_cutoff=0.3, async_scheduling=True)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=n, ignore_eos=True, logprobs=1 if i == 0 else None)
              for i, n in enumerate(LENGTHS)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == LENGTHS
    assert len(outs[0].outputs[0].logprobs) == LENGTHS[0]
    check_counts(outs, 4)
    again = make_llm(target_dir, heads["peagle"], "peagle", draft_confidence_cutoff=0.3, async_scheduling=False)
    assert [o.token_ids for o in again.generate(PROMPTS, params, use_tqdm=False)] == [o.token_ids for o in outs]


def test_eagle3_stops_chaining_when_no_request_is_confident(target_dir, heads, reference):
    # EAGLE-3's chained passes: K - 1 per drafting step without a cutoff; with a cutoff nothing reaches, none.
    passes = {}
    for cutoff in (0.0, 1.0):
        llm = make_llm(target_dir, heads["eagle3"], "eagle3", k=4, draft_confidence_cutoff=cutoff)
        drafter = llm.engine.runner.drafter
        count, real_forward = [0], drafter.forward

        def forward(input_ids, *a, count=count, real_forward=real_forward, **kw):
            count[0] += 1
            return real_forward(input_ids, *a, **kw)

        drafter.forward = forward
        outs = llm.generate(PROMPTS[:2], [greedy(10)] * 2, use_tqdm=False)
        check_outputs(outs, reference, [10, 10])
        passes[cutoff] = count[0]
    assert passes[1.0] * 3 < passes[0.0]  # only the first pass of each drafting step


# ---- metrics -----------------------------------------------------------------------------------------------------


def test_metrics_count_verified_and_accepted_drafts(target_dir, heads, reference, varied_confidence):
    llm = make_llm(target_dir, heads["peagle"], "peagle", k=5, draft_confidence_cutoff=0.3)
    oracle_drafts(llm.engine.runner, reference, random.Random(4))
    runner, verified_steps = llm.engine.runner, []
    real_run = runner._run

    def run(x, st, k, num_real, *a, **kw):
        handle = real_run(x, st, k, num_real, *a, **kw)
        fed = ((x["drafts"][:num_real] >= 0) & (torch.arange(k)[None, :] < x["num_drafts"][:num_real, None]))
        verified_steps.append(int(fed.sum()))
        return handle

    runner._run = run
    outs = llm.generate(PROMPTS, [greedy(n) for n in LENGTHS], use_tqdm=False)
    check_outputs(outs, reference)
    check_counts(outs, 5)
    assert sum(o.metrics.num_verified_tokens for o in outs) == sum(verified_steps)  # the drafts the steps fed


# ---- configuration -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.3", True])
def test_a_bad_cutoff_names_the_option(value):
    spec = SpeculativeConfig(method="eagle3", model="m", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="draft_confidence_cutoff"):
        EngineConfig(model="m", speculative=spec, draft_confidence_cutoff=value)


def test_a_cutoff_needs_speculation():
    with pytest.raises(ValueError, match="draft_confidence_cutoff needs a speculative_config"):
        EngineConfig(model="m", draft_confidence_cutoff=0.3)
    assert EngineConfig(model="m", draft_confidence_cutoff=0.0).draft_confidence_cutoff == 0.0


def test_adaptive_cutoffs_are_parsed_and_checked(tmp_path):
    spec = {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 5,
            "adaptive": {"thresholds": [[8, 5]], "above": 3, "cutoffs": [[8, 0.0], [32, 0.2]], "cutoff_above": 0.4}}
    policy = SpeculativeConfig.from_dict(spec).adaptive
    assert [policy.cutoff_for(n) for n in (1, 8, 9, 32, 33)] == [0.0, 0.0, 0.2, 0.2, 0.4]
    for bad, match in (({"cutoffs": [[8, 1.5]]}, "cutoffs must be confidence cutoffs"),
                       ({"cutoffs": [[8, "high"]]}, "adaptive.cutoffs"),
                       ({"cutoffs": [[8, 0.1], [4, 0.2]]}, "increasing"),
                       ({"cutoff_above": "x"}, "adaptive.cutoff_above")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_dict({**spec, "adaptive": bad})


def test_head_policy_cutoffs_are_the_default_and_the_option_overrides_them(target_dir, heads, tmp_path):
    import shutil

    head = tmp_path / "head"
    shutil.copytree(heads["peagle"], head)
    (head / POLICY_FILE).write_text(json.dumps({"thresholds": [], "above": None, "cutoffs": [[2, 0.0]],
                                                "cutoff_above": 0.5, "calibration": {}}))
    spec = spec_config(head, 3, True)
    llm = cpu_llm(target_dir, spec)
    planner = llm.engine.planner
    assert planner.confident and (planner.cutoff(1), planner.cutoff(3)) == (0.0, 0.5)
    off = cpu_llm(target_dir, spec, draft_confidence_cutoff=0.0)
    assert not off.engine.planner.confident and off.engine.runner.cutoff is None
