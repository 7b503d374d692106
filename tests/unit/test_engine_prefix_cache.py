"""Prefix caching: prompts that start like earlier ones take their cached KV blocks (the target's and the drafter's),
and every output stays what it is without the cache."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import cpu_llm, greedy, heads, make_llm, spec_config, target_dir  # noqa: F401 (fixtures)
from test_engine_spec import reference_drafts

from peagle.engine.block_manager import BlockManager, prefix_keys
from peagle.engine.sampling_params import SamplingParams
from peagle.engine.scheduler import Scheduler, SchedulerConfig
from peagle.engine.sequence import Sequence
from peagle.models.loader import load_model

BS = 8  # the smallest block size the engine takes: blocks fill fast in short test prompts


def seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=4), 0.0)


def test_prefix_keys_name_full_blocks_with_the_token_after_them():
    tokens = list(range(100, 125))  # 25 tokens: blocks 0-2 are full; block 2's next token (24) exists
    keys = prefix_keys(tokens, BS)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert prefix_keys(tokens[:24], BS) == keys[:2]  # block 2 has no token after it: not named yet
    other_next = tokens[:16] + [999] + tokens[17:]  # block 1 is the same but the token after it is not
    assert prefix_keys(other_next, BS)[:1] == keys[:1] and prefix_keys(other_next, BS)[1] != keys[1]
    changed_first = [1] + tokens[1:]  # a key names its whole prefix, not only its block
    assert all(a != b for a, b in zip(prefix_keys(changed_first, BS), keys))


def test_block_manager_shares_counts_and_evicts_the_tail_first():
    bm = BlockManager(num_blocks=6, block_size=BS, enable_prefix_caching=True)
    a = seq("a", list(range(30)))  # blocks 0..2 nameable (tokens 0-23, the token after: 24)
    assert bm.cached_prefix(a) == []
    bm.allocate(a, 30)
    bm.register(a, 30)
    assert bm.num_cached_blocks == 3 and bm.num_used_blocks == 4
    b = seq("b", list(range(20)) + [77] * 10)  # shares blocks 0 and 1 (block 1's next token, 16, is the same)
    hit = bm.cached_prefix(b)
    assert hit == a.block_table[:2]
    assert bm.can_allocate(b, 30, hit) and not bm.can_allocate(b, 8 * 7, hit)
    bm.take_cached_prefix(b, hit)
    assert b.num_computed_tokens == 16 and b.num_cached_tokens == 16 and b.num_new_tokens == 14
    bm.allocate(b, 30)
    assert b.block_table[:2] == a.block_table[:2] and bm.num_used_blocks == 6 and bm.num_free_blocks == 0
    table = list(a.block_table)
    bm.free(a)  # blocks 0-1 still used by b; a's block 2 (cached) is evictable, its block 3 free
    assert bm.num_used_blocks == 4 and bm.num_free_blocks == 2
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    c = seq("c", [300 + i for i in range(40)])
    bm.allocate(c, 8 * 5)  # 5 blocks: the 3 uncached ones, then the least recently freed cached ones
    assert bm.num_cached_blocks == 1  # a's later blocks went first: the chain's first block is still there
    assert bm.cached_prefix(seq("d", list(range(30)))) == table[:1]
    twice = seq("e", [1])
    twice.block_table = [c.block_table[0]] * 2
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(twice)


def test_a_prompt_never_takes_blocks_its_own_step_computes():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128, block_size=BS,
                                      num_blocks=64, enable_prefix_caching=True))
    shared = list(range(1, 33))
    for i in range(2):
        sched.add(seq(str(i), shared + [100 + i]))
    out = sched.schedule()
    assert [s.num_cached_tokens for s in out.seqs] == [0, 0]  # both admitted in one step: neither is cached yet
    sched.add(seq("2", shared + [200]))
    out = sched.schedule()
    third = next(s for s in out.seqs if s.seq_id == "2")
    # Blocks 0-2 and the token after them are shared; block 3's next token (100 or 101, not 200) is not.
    assert third.num_cached_tokens == 24 and out.num_scheduled_tokens[out.seqs.index(third)] == 9


PREFIX = [random.Random(5).randrange(3, 250) for _ in range(40)]
PROMPTS = [PREFIX + [11, 12, 13], PREFIX + [21, 22], PREFIX[:20] + [31, 32, 33, 34], PREFIX + [11, 12, 13]]


@pytest.mark.parametrize("method, async_scheduling, chunked", [
    (None, False, False), (None, True, False), ("eagle3", False, False), ("peagle", True, False),
    ("peagle", False, True)])
def test_cached_prefixes_keep_greedy_output_and_drafts(target_dir, heads, method, async_scheduling, chunked):
    """The same prompts twice, with and without the cache: equal outputs; with it the second pass takes the shared
    blocks; and drafts made with cached drafter entries equal a from-scratch recomputation (checked on the
    synchronous path, whose steps go through `execute`)."""
    k, parallel = 3, method == "peagle"
    extra = {"enable_chunked_prefill": True, "max_num_batched_tokens": 16} if chunked else {}
    kw = dict(k=k, parallel=parallel, block_size=BS, async_scheduling=async_scheduling, **extra)
    head = heads[method] if method else None
    plain = make_llm(target_dir, head, **kw)
    cached = make_llm(target_dir, head, enable_prefix_caching=True, **kw)
    seen: list[tuple[list[int], list[int]]] = []
    entries: dict[str, dict[tuple[int, ...], torch.Tensor]] = {"plain": {}, "cached": {}}
    check_drafts = method is not None and not async_scheduling  # the synchronous path's step is `execute`
    for name, llm in (("plain", plain), ("cached", cached)) if check_drafts else ():
        wrap_execute(llm, k, seen if name == "cached" else None, entries[name])
    for round_ in range(2):
        want = plain.generate(PROMPTS, greedy(16), use_tqdm=False)
        got = cached.generate(PROMPTS, greedy(16), use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], round_
        assert all(o.num_cached_tokens == 0 for o in want)
    # Second round: the 40-token prefix's four full blocks are named (block 4's next token is in each prompt);
    # the third prompt shares two blocks and the token after them.
    assert [o.num_cached_tokens for o in got] == [40, 40, 16, 40]
    assert cached.engine.scheduler.block_manager.num_hit_tokens >= 136
    if check_drafts:
        # The drafter's cache entries over each prompt's first 40 positions, cached or computed, are the same.
        assert set(entries["cached"]) == set(entries["plain"]) == {tuple(p) for p in PROMPTS if len(p) > 40}
        for prompt, got_entries in entries["cached"].items():
            torch.testing.assert_close(got_entries, entries["plain"][prompt], rtol=1e-5, atol=1e-5)
        assert len(seen) >= 4
        model = load_model(target_dir, dtype="float32")
        with torch.inference_mode():
            for ctx, drafts in seen:
                assert drafts == reference_drafts(model, cached.engine.runner.drafter, ctx, k, parallel), ctx


def wrap_execute(llm, k: int, seen: list | None, entries: dict):
    """Records, at each sequence's first step after its prompt, the drafter's cached keys (layer 0) at the prompt's
    first 40 positions (the last one's read the token after it; the last request's per prompt is kept) and, into
    `seen`, the drafts of steps whose sequence took cached blocks."""
    runner = llm.engine.runner
    real_execute = runner.execute
    recorded: set[str] = set()

    def execute(seqs, drafts, st, draft=True, chunks=None, **kwargs):
        for s in seqs:
            prompt = tuple(s.token_ids[:s.num_prompt_tokens])
            if s.num_computed_tokens >= s.num_prompt_tokens and s.seq_id not in recorded and len(prompt) > 40:
                recorded.add(s.seq_id)
                keys = runner.proposer.kv_caches[0][0]
                entries[prompt] = torch.stack([keys[s.block_table[p // BS], p % BS] for p in range(40)]).clone()
        result = real_execute(seqs, drafts, st, draft, chunks, **kwargs)
        for i, s in enumerate(seqs):
            if seen is not None and (chunks is None or chunks[i] >= s.num_new_tokens) and s.num_cached_tokens:
                seen.append((s.token_ids + result.output_tokens[i], list(result.drafts[i])))
        return result

    runner.execute = execute


def test_a_finished_answer_names_its_computed_blocks():
    """A sequence that gives its blocks up names every full block before num_computed_tokens, its answer's too, so
    the next turn's prompt (this prompt, this answer, more) takes them; not after a step without the drafter."""
    bm = BlockManager(16, BS, enable_prefix_caching=True)

    def seq(seq_id, tokens):
        return Sequence(seq_id, tokens, SamplingParams(max_tokens=64, ignore_eos=True), 0.0)

    first = seq("a", list(range(3, 23)))  # 20 prompt tokens
    bm.allocate(first, 40)
    first.append_tokens(list(range(100, 120)))  # a 20-token answer: 40 tokens, the last not yet fed
    assert first.num_tokens == 40
    first.num_computed_tokens = 39
    table = list(first.block_table)
    bm.free(first)
    turn = seq("b", first.token_ids + [7, 8, 9])
    assert bm.cached_prefix(turn) == table[:4]  # blocks 0-3: positions 0..31, each with the token after it
    gap = seq("c", list(range(30, 50)))
    bm.allocate(gap, 40)
    gap.append_tokens(list(range(200, 220)))
    gap.num_computed_tokens, gap.drafter_gap = 39, True
    bm.free(gap)
    assert bm.cached_prefix(seq("d", gap.token_ids + [7])) == []  # (its prompt's are named at scheduling)


@pytest.mark.parametrize("method, async_scheduling", [
    (None, False), (None, True), ("eagle3", False), ("peagle", False), ("peagle", True)])
def test_the_next_turn_takes_the_answers_blocks(target_dir, heads, method, async_scheduling):
    """A second turn whose prompt is the first turn's prompt and answer and more: with the cache it takes the
    answer's blocks, its output equals the engine's without the cache, its drafter entries there equal a prefill's
    (to float32 rounding: the answer's were computed a few tokens a step), and its drafts a from-scratch one's."""
    k, parallel = 3, method == "peagle"
    kw = dict(k=k, parallel=parallel, block_size=BS, async_scheduling=async_scheduling)
    head = heads[method] if method else None
    plain = make_llm(target_dir, head, **kw)
    cached = make_llm(target_dir, head, enable_prefix_caching=True, **kw)
    seen: list[tuple[list[int], list[int]]] = []
    entries: dict[str, dict[tuple[int, ...], torch.Tensor]] = {"plain": {}, "cached": {}}
    check_drafts = method is not None and not async_scheduling
    for name, llm in (("plain", plain), ("cached", cached)) if check_drafts else ():
        wrap_execute(llm, k, seen if name == "cached" else None, entries[name])
    first = [PREFIX[:20]]
    answers = [o.token_ids for o in cached.generate(first, greedy(24), use_tqdm=False)]
    assert answers == [o.token_ids for o in plain.generate(first, greedy(24), use_tqdm=False)]
    turn = [first[0] + answers[0] + [11, 12, 13]]
    want = plain.generate(turn, greedy(16), use_tqdm=False)
    got = cached.generate(turn, greedy(16), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # 44 tokens of the first turn, the last never fed: 43 computed, so five full blocks (40 tokens) are named
    assert got[0].num_cached_tokens == 40 and want[0].num_cached_tokens == 0
    if check_drafts:
        key = tuple(turn[0])
        torch.testing.assert_close(entries["cached"][key], entries["plain"][key], rtol=1e-4, atol=1e-4)
        assert seen
        model = load_model(target_dir, dtype="float32")
        with torch.inference_mode():
            for ctx, drafts in seen:
                assert drafts == reference_drafts(model, cached.engine.runner.drafter, ctx, k, parallel), ctx


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_answer_decoded_without_the_drafter_names_no_blocks(target_dir, heads, async_scheduling):
    """The adaptive policy's K = 0 (here at every load) feeds the answer without the drafter, whose entries there
    stay unwritten: the next turn takes only the prompt's blocks, and its output is still the uncached engine's."""
    spec = spec_config(heads["peagle"], 3, True, adaptive={"thresholds": [], "above": 0})
    outs = {}
    for caching in (False, True):
        llm = cpu_llm(target_dir, spec, max_num_seqs=3, block_size=BS, async_scheduling=async_scheduling,
                      enable_prefix_caching=caching)
        first = [PREFIX[:20]]
        answer = llm.generate(first, greedy(24), use_tqdm=False)[0].token_ids
        turn = llm.generate([first[0] + answer + [11, 12, 13]], greedy(8), use_tqdm=False)[0]
        outs[caching] = (answer, turn.token_ids, turn.num_cached_tokens)
    assert outs[True][:2] == outs[False][:2]
    assert outs[True][2] == 16  # the 20-token prompt's two full blocks, none of the answer's


def test_a_preempted_sequence_takes_its_own_blocks_back(target_dir, heads):
    """Preemption by recompute under a tiny KV budget: with the cache a preempted sequence takes back the blocks it
    named as it gave them up (its answer's included) instead of prefilling them again; the output is unchanged."""
    prompts = [PREFIX[:20], PREFIX[20:36], PREFIX[5:30], PREFIX[10:22]]
    outs, admitted = {}, []
    for caching in (False, True):
        llm = make_llm(target_dir, heads["peagle"], k=3, parallel=True, max_num_seqs=4, num_kv_blocks=14,
                       block_size=BS, enable_prefix_caching=caching)
        bm = llm.engine.scheduler.block_manager
        take = bm.take_cached_prefix

        def recording(seq, blocks, take=take):
            if seq.num_tokens > seq.num_prompt_tokens:  # a re-admission after preemption
                admitted.append(len(blocks) * BS - seq.num_prompt_tokens)
            return take(seq, blocks)

        bm.take_cached_prefix = recording
        outs[caching] = [o.token_ids for o in llm.generate(prompts, greedy(40), use_tqdm=False)]
        assert bm.num_used_blocks == 0
    assert outs[True] == outs[False]
    assert admitted and max(admitted) > 0  # blocks past the prompt: answer tokens not computed again
