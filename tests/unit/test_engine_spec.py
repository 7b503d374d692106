"""End to end on the CPU: speculative greedy output equals plain greedy output, and the drafters' paged KV stays
consistent with a from-scratch recomputation after every partial acceptance."""

from __future__ import annotations

import math
import random

import pytest
import torch
from engine_helpers import (cpu_llm, greedy, heads, make_llm, oracle_proposer,  # noqa: F401 (fixtures)
                            recompute_greedy, spec_config, target_dir)

from peagle import SamplingParams
from peagle.models.attention import DenseAttention
from peagle.models.loader import load_model

PROMPTS = [[7, 20, 31, 40], [9, 15], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30], [50, 60, 70], [80, 81, 82, 83]]


@pytest.fixture(scope="module")
def reference(target_dir):
    outs = make_llm(target_dir).generate(PROMPTS, greedy(40), use_tqdm=False)
    return [p + o.token_ids for p, o in zip(PROMPTS, outs)]


def test_plain_engine_equals_full_recompute_greedy(target_dir, reference):
    model = load_model(target_dir, dtype="float32")
    assert recompute_greedy(model, PROMPTS[2], 40) == reference[2]


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
@pytest.mark.parametrize("k", [1, 3, 7, 11])
def test_speculative_greedy_equals_plain_greedy(target_dir, heads, reference, method, k):
    llm = make_llm(target_dir, heads[method], k=k, parallel=method == "peagle")
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        assert out.token_ids == ref[len(prompt):len(prompt) + 24]
        assert out.metrics.num_drafting_rounds > 0


def reference_drafts(model, drafter, ctx: list[int], k: int, parallel: bool) -> list[int]:
    """The drafts for context `ctx` computed from scratch with dense causal attention (no cache)."""
    m = len(ctx) - 1
    ids = torch.tensor(ctx)
    out = model(ids[:m], torch.arange(m), DenseAttention([m]), drafter.config.aux_layer_ids)
    hidden = drafter.fc(out.aux)  # [m, d]
    tokens = ids[1:]
    if parallel:
        n = m + k - 1
        mask = drafter.fc(drafter.mask_hidden.expand(k - 1, -1))
        h = drafter(torch.cat([tokens, torch.full((k - 1,), drafter.config.mask_token_id)]), torch.arange(n),
                    DenseAttention([n]), torch.cat([hidden, mask]))
        return drafter.to_target_ids(drafter.compute_logits(h[m - 1:]).argmax(-1)).tolist()
    drafts = []
    for _ in range(k):
        n = len(tokens)
        h = drafter(tokens, torch.arange(n), DenseAttention([n]), hidden)
        tok = drafter.to_target_ids(drafter.compute_logits(h[-1:]).argmax(-1))
        drafts.append(int(tok))
        tokens = torch.cat([tokens, tok])
        hidden = torch.cat([hidden, h[-1:]])
    return drafts


# Chunked prefill: a step of 16 tokens holds the decodes (3 x 5 at most) and what they leave of a prompt.
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16}


@pytest.mark.parametrize("method,k,chunked", [("peagle", 4, False), ("eagle3", 3, False), ("peagle", 4, True)])
def test_partial_acceptance_keeps_both_caches_consistent(target_dir, heads, reference, method, k, chunked):
    """Drafts are replaced by the true continuation with random corruptions, so rounds accept 0..K drafts; the real
    drafter still runs every round, and its proposals must equal a from-scratch recomputation (with chunked prefill
    too: the drafter's cache fills chunk by chunk)."""
    parallel = method == "peagle"
    llm = make_llm(target_dir, heads[method], k=k, parallel=parallel, **(CHUNKED if chunked else {}))
    engine = llm.engine
    rng = random.Random(0)
    by_seq: dict[str, list[int]] = {}
    seen: list[tuple[list[int], list[int]]] = []
    real_execute = engine.runner.execute
    num_chunks = 0

    def execute(seqs, drafts, st, plan, chunks=None, **kw):
        nonlocal num_chunks
        result = real_execute(seqs, drafts, st, plan, chunks, **kw)
        for i, seq in enumerate(seqs):
            if chunks is not None and chunks[i] < seq.num_new_tokens:
                num_chunks += 1  # a prefill chunk: nothing sampled, its drafts are dropped
                continue
            ctx = seq.token_ids + result.output_tokens[i]
            seen.append((ctx, list(result.drafts[i])))
            ref = by_seq[seq.seq_id]
            oracle = (ref[len(ctx):] + [0] * k)[:k]
            cut = rng.randrange(k + 1)
            if cut < k:
                oracle[cut] = (oracle[cut] + 1) % 300
            result.drafts[i] = oracle
        return result

    engine.runner.execute = execute
    for i, prompt in enumerate(PROMPTS):
        by_seq[str(i)] = reference[i]
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        assert out.token_ids == ref[len(prompt):len(prompt) + 24]
    accepted = {a for o in outs for a in range(len(o.metrics.accepted_per_position))
                if o.metrics.accepted_per_position[a]}
    assert max(accepted) == k - 1 and sum(o.metrics.num_accepted_tokens for o in outs) > 20
    assert (num_chunks > 0) == chunked
    model = load_model(target_dir, dtype="float32")
    drafter = engine.runner.drafter
    with torch.inference_mode():
        for ctx, drafts in seen[:: max(1, len(seen) // 40)]:
            assert drafts == reference_drafts(model, drafter, ctx, k, parallel), ctx


def test_requests_end_inside_a_round(target_dir, heads, reference):
    llm = make_llm(target_dir, heads["peagle"], k=7, parallel=True)
    eos = reference[0][len(PROMPTS[0]) + 5]
    outs = llm.generate(PROMPTS[:3], [greedy(max_tokens=9), SamplingParams(temperature=0, max_tokens=30,
                        stop_token_ids=[eos]), greedy(max_tokens=1)], use_tqdm=False)
    assert outs[0].token_ids == reference[0][len(PROMPTS[0]):len(PROMPTS[0]) + 9]
    assert outs[0].finish_reason == "length"
    cont = reference[1][len(PROMPTS[1]):]
    if eos in cont[:30]:
        assert outs[1].token_ids == cont[:cont.index(eos) + 1] and outs[1].finish_reason == "stop"
    assert len(outs[2].token_ids) == 1


def test_preemption_under_a_tiny_kv_budget(target_dir, heads, reference):
    llm = make_llm(target_dir, heads["peagle"], k=3, parallel=True, max_num_seqs=6, num_kv_blocks=12)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        assert out.token_ids == ref[len(prompt):len(prompt) + 24]
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_adaptive_k_keeps_output(target_dir, heads, reference):
    spec = spec_config(heads["peagle"], 5, True, adaptive={"thresholds": [[1, 5], [2, 3]], "above": 1})
    llm = cpu_llm(target_dir, spec, max_num_seqs=4)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        assert out.token_ids == ref[len(prompt):len(prompt) + 24]


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_adaptive_policy_turns_speculation_off_and_on(target_dir, heads, reference, method):
    # Speculation off (K = 0) while more than 2 requests run, K = 3 below: requests of different lengths make the
    # running count fall through the bound, so drafting stops, then resumes over a drafter cache with holes.
    spec = spec_config(heads[method], 3, method == "peagle", adaptive={"thresholds": [[2, 3]], "above": 0})
    # steps counted through the synchronous `execute`
    llm = cpu_llm(target_dir, spec, max_num_seqs=6, async_scheduling=False)
    runner = llm.engine.runner
    steps = []
    real_execute = runner.execute

    def execute(seqs, drafts, st, plan, *a, **kw):
        steps.append((len(seqs), max(map(len, drafts)), plan.draft))
        return real_execute(seqs, drafts, st, plan, *a, **kw)

    runner.execute = execute
    lengths = [8, 40, 12, 40, 16, 20]
    outs = llm.generate(PROMPTS, [greedy(n) for n in lengths], use_tqdm=False)
    for prompt, ref, out, n in zip(PROMPTS, reference, outs, lengths):
        assert out.token_ids == ref[len(prompt):len(prompt) + n]
    off = [s for s in steps if s[0] > 2 and not s[2]]
    assert off and all(k == 0 for _, k, _ in off)  # plain steps, the drafter skipped
    assert any(b <= 2 and k == 3 for b, k, _ in steps)  # speculation resumed when the load fell
    assert outs[1].metrics.num_drafting_rounds > 0 and outs[1].metrics.num_drafting_rounds < 40
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def _spy_on_padding(runner) -> list[bool]:
    """Records, per step whose K rose, whether its drafts were padded to the new K (`DraftPlanner.can_pad`)."""
    padded, real = [], runner.planner.can_pad

    def can_pad(*a):
        padded.append(real(*a))
        return padded[-1]

    runner.planner.can_pad = can_pad
    return padded


@pytest.mark.parametrize("verified_only", [False, True])
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_adaptive_policy_drafts_only_what_it_verifies(target_dir, heads, reference, method, async_scheduling,
                                                      verified_only):
    # Engine K = 4; the policy verifies 1 draft above 4 running requests, 2 up to 4, 4 up to 1. Each drafter pass
    # proposes the policy's K for the load of its step (the engine's K after a step without drafts), never K = 4
    # to verify 1 (drafting passes of EAGLE-3 and P-EAGLE's mask positions grow with the count); when the load
    # falls and the policy's K rises, a step proposes the new count. The output stays plain greedy's. Off by
    # default (propose_verified_only): then every pass proposes the engine's K and steps verify the load's.
    spec = spec_config(heads[method], 4, method == "peagle", adaptive={"thresholds": [[1, 4], [4, 2]], "above": 1})
    llm = cpu_llm(target_dir, spec, max_num_seqs=6, async_scheduling=async_scheduling,
                  propose_verified_only=verified_only)
    runner, policy = llm.engine.runner, llm.engine.spec.adaptive
    proposed, verified = [], []
    real_propose, real_run = runner.propose, runner._run

    def propose(*a, num_drafts=None, **kw):
        out = real_propose(*a, num_drafts=num_drafts, **kw)
        proposed.append(out.shape[1])
        return out

    rounds = []  # (K of the step's layout, drafts proposed) per step that verifies drafts

    def run(x, st, k, num_real, *a, **kw):
        verified.append((num_real, k))
        handle = real_run(x, st, k, num_real, *a, **kw)
        if k:
            rounds.append((k, handle.num_drafts))
        return handle

    padded = _spy_on_padding(runner)
    runner.propose, runner._run = propose, run
    lengths = [8, 40, 12, 30, 16, 20]
    outs = llm.generate(PROMPTS, [greedy(n) for n in lengths], use_tqdm=False)
    for prompt, ref, out, n in zip(PROMPTS, reference, outs, lengths):
        assert out.token_ids == ref[len(prompt):len(prompt) + n]
    # the counts the policy verifies, each proposed (4 also after prompts); or the engine's K alone
    assert set(proposed) == ({1, 2, 4} if verified_only else {4})
    assert all(k <= policy.k_for(b, 4) for b, k in verified)  # no step verifies more than its load's K
    assert {1, 2, 4} <= {k for _, k in verified}  # and each was verified
    if verified_only:  # a rise in K is laid out as the new K's step (its missing drafts padded), as graphs run it
        assert all(k == d for k, d in rounds), rounds
        assert padded and all(padded)  # the load fell, so K rose; each rise was padded
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_adaptive_policy_pads_a_rise_for_sampled_requests(target_dir, heads, method):
    # Sampled requests (and one with logprobs) through rises in K: each padded step verifies only its real drafts
    # (the pads are never accepted, so no request emits more than its drafts allow), the lengths are as asked.
    spec = spec_config(heads[method], 4, method == "peagle", adaptive={"thresholds": [[1, 4], [4, 2]], "above": 1})
    llm = cpu_llm(target_dir, spec, max_num_seqs=6)
    runner = llm.engine.runner
    padded, real_run = _spy_on_padding(runner), runner._run
    emitted = []  # (real drafts of each request, drafts each accepted) per step

    def run(x, st, k, num_real, *a, **kw):
        handle = real_run(x, st, k, num_real, *a, **kw)
        emitted.append(((x["drafts"][:num_real] >= 0).sum(1).tolist(), list(handle.result().num_accepted)))
        return handle

    runner._run = run
    lengths = [8, 40, 12, 30, 16, 20]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=n, ignore_eos=True, logprobs=1 if i == 0 else None)
              for i, n in enumerate(lengths)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == lengths
    assert padded and all(padded)
    assert all(a <= d for real, acc in emitted for d, a in zip(real, acc))
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_adaptive_rise_beside_an_admitted_prompt_stays_on_the_graphs_path(target_dir, heads, reference, method):
    # Two requests at a time, K = 4 alone and 2 for two (the calibrated policy's shape at concurrency 2): when one
    # finishes, the survivor's K rises while the next prompt is admitted in the same step, which cannot be padded
    # (a prompt does not decode). That step proposes what the graphs propose for its K (an eager step with the
    # risen count cost several rounds each on the GPU: BENCHMARKS.md run 23); the rise comes at the next
    # decode-only step. Synchronous scheduling; with async scheduling such a step is admitted ahead (the next test).
    spec = spec_config(heads[method], 4, method == "peagle", adaptive={"thresholds": [[1, 4]], "above": 2})
    llm = cpu_llm(target_dir, spec, max_num_seqs=2, async_scheduling=False)
    runner = llm.engine.runner
    padded, real_run = _spy_on_padding(runner), runner._run
    rounds = []  # (K of the step's layout, drafts proposed, drafts the step would propose on a graph)

    def run(x, st, k, num_real, *a, **kw):
        handle = real_run(x, st, k, num_real, *a, **kw)
        if handle.num_drafts:
            rounds.append((k, handle.num_drafts, runner.draft_count(k)))
        return handle

    runner._run = run
    lengths = [8, 20, 12, 30, 16, 20]
    outs = llm.generate(PROMPTS, [greedy(n) for n in lengths], use_tqdm=False)
    for prompt, ref, out, n in zip(PROMPTS, reference, outs, lengths):
        assert out.token_ids == ref[len(prompt):len(prompt) + n]
    assert False in padded, "no rise beside an admitted prompt: the scenario did not happen"
    assert all(d == g for _, d, g in rounds), rounds  # every step proposed what a graph of its K proposes
    assert {4, 2} <= {k for k, _, _ in rounds}  # both of the policy's K were verified
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_async_adaptive_rise_admits_ahead(target_dir, heads, reference):
    # The same load as above, async: a rise in K beside an admitted prompt is launched ahead of the answer in flight
    # (launch_admit_next, at the K the drafts in flight hold), as at a fixed K, not after draining the pipeline
    # for a synchronous step (`launch`) that mixes a decode and a prompt. Every step still proposes what a graph
    # of its K proposes.
    spec = spec_config(heads["peagle"], 4, True, adaptive={"thresholds": [[1, 4]], "above": 2})
    llm = cpu_llm(target_dir, spec, max_num_seqs=2, async_scheduling=True)
    runner = llm.engine.runner
    mixed_sync, admitted_ahead = [], []
    real_launch, real_admit = runner.launch, runner.launch_admit_next

    def launch(seqs, drafts, *a, **kw):
        if any(d for d in drafts) and any(s.num_computed_tokens == 0 for s in seqs):
            mixed_sync.append(len(seqs))
        return real_launch(seqs, drafts, *a, **kw)

    def admit(*a, **kw):
        admitted_ahead.append(1)
        return real_admit(*a, **kw)

    rounds, real_run = [], runner._run  # (K of the step's layout, drafts proposed, what its graphs propose)

    def run(x, st, k, num_real, *a, **kw):
        handle = real_run(x, st, k, num_real, *a, **kw)
        if handle.num_drafts:
            rounds.append((k, handle.num_drafts, runner.draft_count(k)))
        return handle

    runner.launch, runner.launch_admit_next, runner._run = launch, admit, run
    lengths = [8, 20, 12, 30, 16, 20]
    outs = llm.generate(PROMPTS, [greedy(n) for n in lengths], use_tqdm=False)
    for prompt, ref, out, n in zip(PROMPTS, reference, outs, lengths):
        assert out.token_ids == ref[len(prompt):len(prompt) + n]
    assert admitted_ahead and not mixed_sync, (len(admitted_ahead), mixed_sync)
    assert all(d == g for _, d, g in rounds), rounds
    assert {4, 2} <= {k for k, _, _ in rounds}
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_adaptive_policy_rejects_negative_k():
    from peagle.engine.config import AdaptivePolicy

    with pytest.raises(ValueError, match="speculation off"):
        AdaptivePolicy(thresholds=((4, -1),))
    with pytest.raises(ValueError, match="speculation off"):
        AdaptivePolicy(above=-2)
    assert AdaptivePolicy(thresholds=((4, 3),), above=0).k_for(5, 7) == 0


def test_stop_string_ends_a_speculative_request(target_dir, heads, reference):
    llm = make_llm(target_dir, heads["peagle"], k=3, parallel=True)
    cont = reference[2][len(PROMPTS[2]):len(PROMPTS[2]) + 24]
    text = llm.tokenizer.decode(cont)
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].strip())
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(stop)]
    assert out.token_ids == cont[:len(out.token_ids)]
    assert stop in llm.tokenizer.decode(out.token_ids)
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])


# Async scheduling: the next step is launched before the answer of the one in flight reaches the host, its inputs
# built on the device from that answer. The output must not change (without async: the tests above).

def count_launches(runner) -> list[str]:
    launched = []
    for name in ("launch", "launch_next"):
        real = getattr(runner, name)
        setattr(runner, name, lambda *a, real=real, name=name, **kw: launched.append(name) or real(*a, **kw))
    return launched


def test_async_scheduling_keeps_plain_greedy_output(target_dir, reference):
    llm = make_llm(target_dir, async_scheduling=True)
    launched = count_launches(llm.engine.runner)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        assert out.token_ids == ref[len(prompt):len(prompt) + 24]
    assert launched.count("launch_next") > 2 * launched.count("launch")  # most steps were launched ahead
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("method,k,chunked", [("peagle", 4, False), ("eagle3", 3, False), ("eagle3", 3, True)])
def test_async_speculative_greedy_equals_plain_greedy(target_dir, heads, reference, method, k, chunked):
    llm = make_llm(target_dir, heads[method], k=k, parallel=method == "peagle", async_scheduling=True,
                   **(CHUNKED if chunked else {}))
    oracle_proposer(llm.engine.runner, reference, random.Random(1))
    launched = count_launches(llm.engine.runner)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        assert out.token_ids == ref[len(prompt):len(prompt) + 24]
    accepted = {a for o in outs for a, n in enumerate(o.metrics.accepted_per_position) if n}
    assert max(accepted) == k - 1 and sum(o.metrics.num_accepted_tokens for o in outs) > 20
    assert launched.count("launch_next") > launched.count("launch")


def test_async_scheduling_under_preemption_aborts_and_the_adaptive_policy(target_dir, heads, reference):
    spec = spec_config(heads["peagle"], 3, True, adaptive={"thresholds": [[2, 3]], "above": 0})
    llm = cpu_llm(target_dir, spec, max_num_seqs=6, num_kv_blocks=6, async_scheduling=True)
    engine = llm.engine
    oracle_proposer(engine.runner, reference, random.Random(2))
    lengths = [8, 40, 12, 40, 16, 20]
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
        engine.add_request(str(i), prompt, greedy(n))
    tokens = {str(i): [] for i in range(len(PROMPTS))}
    finished = {}
    steps = 0
    preempted = []
    real_preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: preempted.append(seq.seq_id) or real_preempt(seq)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
        steps += 1
        if steps == 6:
            assert "3" in [seq.seq_id for seq in engine._inflight.seqs]
            assert engine.abort_request("3")  # in flight: its answer is dropped
    assert "3" not in finished and preempted
    for i, (prompt, ref, n) in enumerate(zip(PROMPTS, reference, lengths)):
        if i != 3:
            assert tokens[str(i)] == ref[len(prompt):len(prompt) + n] and finished[str(i)] == "length"
    assert engine.scheduler.block_manager.num_used_blocks == 0
    engine.step()  # the dropped step in flight, if any, is collected; nothing runs
    assert not engine.has_unfinished_requests()


def test_async_scheduling_keeps_logprobs(target_dir, heads):
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = {}
    for on in (False, True):
        llm = make_llm(target_dir, heads["peagle"], k=3, parallel=True, async_scheduling=on)
        outs[on] = [o.outputs[0] for o in llm.generate(PROMPTS[:3], p, use_tqdm=False)]
    for sync, ahead in zip(outs[False], outs[True]):
        assert ahead.token_ids == sync.token_ids and len(ahead.logprobs) == len(sync.token_ids)
        for a, b in zip(ahead.logprobs, sync.logprobs):
            assert a.keys() == b.keys()
            assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-5) and a[t].rank == b[t].rank for t in a)
