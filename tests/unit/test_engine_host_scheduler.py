import random
import subprocess
import sys

import pytest

from peagle.engine.sampling_params import SamplingParams
from peagle.engine.scheduler import Scheduler, SchedulerConfig
from peagle.engine.sequence import Sequence, SequenceStatus

EOS = 2


def make_config(**overrides):
    kwargs = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=64,
                  num_lookahead_slots=0)
    kwargs.update(overrides)
    return SchedulerConfig(**kwargs)


def make_seq(seq_id, num_prompt=5, **params):
    params.setdefault("max_tokens", 1000)
    return Sequence(str(seq_id), list(range(10, 10 + num_prompt)), SamplingParams(**params), arrival_time=0.0,
                    eos_token_ids=frozenset({EOS}))


def run_step(sched, out, token=7):
    """A fake model step: every scheduled sequence samples `token` and accepts all its drafts."""
    for seq in out.seqs:
        seq.commit(seq.draft_token_ids + [token])
    return sched.release_finished()


@pytest.mark.parametrize("overrides, field", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(block_size=0), "block_size"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(max_model_len=1), "max_model_len"),
    (dict(num_lookahead_slots=-1), "num_lookahead_slots"),
    (dict(max_num_batched_tokens=32, max_model_len=64), "max_num_batched_tokens"),
    (dict(max_num_batched_tokens=8, max_model_len=8, num_lookahead_slots=8), "max_num_batched_tokens"),
])
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        make_config(**overrides)


def test_prefill_then_decode_and_release():
    sched = Scheduler(make_config(num_lookahead_slots=2))
    seq = make_seq("a", num_prompt=5, max_tokens=3)
    sched.add(seq)
    out = sched.schedule()
    assert out.seqs == [seq] and out.num_prefill == 1 and out.preempted == []
    assert seq.status is SequenceStatus.RUNNING and len(seq.block_table) == 2  # 5 tokens + 2 lookahead slots
    run_step(sched, out)
    out = sched.schedule()
    assert out.seqs == [seq] and out.num_prefill == 0 and seq.num_new_tokens == 1
    run_step(sched, out)
    out = sched.schedule()
    assert run_step(sched, out) == [seq]
    assert seq.finish_reason == "length" and seq.output_token_ids == [7, 7, 7]
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished()


def test_max_num_seqs_and_token_budget():
    sched = Scheduler(make_config(max_num_seqs=3, max_num_batched_tokens=20, max_model_len=20))
    seqs = [make_seq(i, num_prompt=8) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert out.seqs == seqs[:2] and out.num_prefill == 2  # a third 8-token prefill would exceed 20 tokens
    run_step(sched, out)
    out = sched.schedule()
    assert out.seqs == [seqs[2]] + seqs[:2] and out.num_prefill == 1  # max_num_seqs = 3 running
    assert sched.num_running == 3 and sched.num_waiting == 2
    for _ in range(20):
        out = sched.schedule()
        assert len(out.seqs) <= 3 and sum(s.num_new_tokens for s in out.seqs) <= 20
        run_step(sched, out)


def test_mixed_prefill_and_decode_step_lists_prefills_first():
    sched = Scheduler(make_config(num_lookahead_slots=4))
    a, b = make_seq("a"), make_seq("b")
    sched.add(a)
    run_step(sched, sched.schedule())
    a.draft_token_ids = [3, 4]
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [b, a] and out.num_prefill == 1
    assert a.num_new_tokens == 3 and b.num_new_tokens == 5
    # Blocks cover every slot a step may write: num_tokens + lookahead.
    assert len(a.block_table) * 4 >= a.num_tokens + 4


def test_preemption_under_a_tiny_kv_budget_returns_blocks_and_readmits():
    sched = Scheduler(make_config(num_blocks=5, block_size=4))
    a, b = make_seq("a", num_prompt=7), make_seq("b", num_prompt=7)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a, b] and sched.block_manager.num_free_blocks == 1
    run_step(sched, out)  # both now 8 tokens, 2 blocks each
    out = sched.schedule()  # 9 slots: a takes the last free block
    assert out.seqs == [a, b]
    run_step(sched, out)
    out = sched.schedule()  # b needs a third block: none free, b is the youngest and preempts itself
    assert out.seqs == [a] and out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.block_manager.num_used_blocks == 3
    run_step(sched, out)
    out = sched.schedule()  # a (11 tokens) needs a fourth block: no preemption needed, one is free
    assert out.seqs == [a] and out.preempted == []
    assert list(sched.waiting) == [b]
    sched.abort("a")
    out = sched.schedule()
    assert out.seqs == [b] and out.num_prefill == 1 and b.num_new_tokens == b.num_tokens == 9
    run_step(sched, out)
    assert b.num_computed_tokens == 9 and b.output_token_ids == [7, 7, 7]


def test_a_decode_preempts_the_most_recently_admitted():
    sched = Scheduler(make_config(num_blocks=6, block_size=4))
    seqs = [make_seq(i, num_prompt=8) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched, sched.schedule())  # 9 tokens each, 2 blocks each: the cache is full
    out = sched.schedule()  # seq 0 needs a third block: the youngest goes
    assert out.seqs == seqs[:2] and out.preempted == [seqs[2]] and out.num_prefill == 0
    for _ in range(3):  # 10..12 tokens fit in 3 blocks each
        run_step(sched, out)
        out = sched.schedule()
        assert out.seqs == seqs[:2] and out.preempted == []
    run_step(sched, out)
    out = sched.schedule()  # 13 tokens: seq 0 preempts seq 1, now the youngest running
    assert out.seqs == [seqs[0]] and out.preempted == [seqs[1]]
    assert list(sched.waiting) == [seqs[1], seqs[2]]  # preempted sequences wait at the front, oldest first
    assert out.num_prefill == 0  # nothing is admitted in a step that preempted


def test_a_sequence_alone_that_outgrows_the_cache_finishes_with_length():
    sched = Scheduler(make_config(num_blocks=3, block_size=4))
    seq = make_seq("a", num_prompt=9)
    sched.add(seq)
    for _ in range(10):
        out = sched.schedule()
        if not out.seqs:
            break
        run_step(sched, out)
    assert seq.is_finished and seq.finish_reason == "length" and "KV cache" in seq.error
    assert seq.num_computed_tokens == 12 and seq.num_tokens == 13  # 3 full blocks, plus the last sampled token
    assert sched.release_finished() == [seq] and sched.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("num_prompt, message", [(0, "empty"), (64, "at most 63"), (41, "KV blocks")])
def test_an_impossible_prompt_fails_alone(num_prompt, message):
    sched = Scheduler(make_config(num_blocks=10, block_size=4))
    good = make_seq("good")
    bad = make_seq("bad", num_prompt=num_prompt)
    sched.add(good)
    sched.add(bad)
    assert bad.finish_reason == "error" and message in bad.error
    out = sched.schedule()
    assert out.seqs == [good]
    assert sched.release_finished() == [bad]
    run_step(sched, out)
    assert good.output_token_ids == [7] and not good.is_finished


def test_duplicate_request_id_is_refused():
    sched = Scheduler(make_config())
    sched.add(make_seq("x"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(make_seq("x"))


def test_abort_waiting_and_running_frees_blocks():
    sched = Scheduler(make_config(max_num_seqs=1))
    a, b = make_seq("a"), make_seq("b")
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule())
    assert sched.block_manager.num_used_blocks > 0 and sched.num_waiting == 1
    assert sched.abort("b") is b and b.finish_reason == "abort" and sched.num_waiting == 0
    assert sched.abort("a") is a and a.finish_reason == "abort" and a.block_table == []
    assert sched.block_manager.num_used_blocks == 0
    assert sched.abort("a") is None and sched.abort("unknown") is None
    assert sched.release_finished() == [] and not sched.has_unfinished()


def test_finish_on_a_stop_string_frees_blocks_at_once():
    sched = Scheduler(make_config())
    a = make_seq("a")
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.finish(a, "stop")
    assert sched.block_manager.num_used_blocks == 0 and sched.num_running == 0
    assert sched.release_finished() == [a] and a.finish_reason == "stop"


def test_finish_overrides_a_length_finish_from_the_same_step():
    sched = Scheduler(make_config())
    a = make_seq("a", max_tokens=1)
    sched.add(a)
    out = sched.schedule()
    a.commit([7])
    assert a.finish_reason == "length"
    sched.finish(a, "stop")  # the stop string ended in the last token
    assert sched.release_finished() == [a] and a.finish_reason == "stop"
    assert sched.block_manager.num_used_blocks == 0 and out.seqs == [a]


def check_step(sched, out, cfg):
    # A step with work pending always schedules something: the engine loop cannot livelock.
    assert out.seqs or (sched.num_running == 0 and sched.num_waiting == 0)
    assert len(out.seqs) <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
    assert sum(seq.num_new_tokens for seq in out.seqs) <= cfg.max_num_batched_tokens
    for i, seq in enumerate(out.seqs):
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * cfg.block_size >= seq.num_tokens + cfg.num_lookahead_slots
        if i < out.num_prefill:
            assert seq.num_computed_tokens == 0 and not seq.draft_token_ids
        else:
            assert seq.num_tokens - seq.num_computed_tokens == 1
    for seq in out.preempted:
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
    assert all(not seq.block_table for seq in sched.waiting)
    owned = [b for seq in sched.running for b in seq.block_table]
    assert len(owned) == len(set(owned)) == sched.block_manager.num_used_blocks


@pytest.mark.parametrize("k_max", [0, 3])
def test_randomized_simulation_finishes_everything_without_leaks(k_max):
    rng = random.Random(k_max)
    cfg = make_config(max_num_seqs=6, max_num_batched_tokens=48, max_model_len=40, block_size=4, num_blocks=24,
                      num_lookahead_slots=2 * k_max)
    sched = Scheduler(cfg)
    added, released, num_preempted, num_mixed = [], [], 0, 0
    for step in range(6000):
        if len(added) < 600 and rng.random() < 0.25:
            seq = Sequence(f"r{len(added)}", [rng.randrange(3, 50) for _ in range(rng.randint(0, 45))],
                           SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.2),
                           arrival_time=float(step), eos_token_ids=frozenset({EOS}))
            sched.add(seq)
            added.append(seq)
        out = sched.schedule()
        check_step(sched, out, cfg)
        num_preempted += len(out.preempted)
        num_mixed += 0 < out.num_prefill < len(out.seqs)
        for seq in out.seqs:
            num_accepted = rng.randint(0, len(seq.draft_token_ids))
            seq.commit(seq.draft_token_ids[:num_accepted] + [rng.randrange(2, 50)], now=float(step))
            if not seq.is_finished and rng.random() < 0.01:
                sched.finish(seq, "stop")
            if not seq.is_finished and k_max:
                seq.draft_token_ids = [rng.randrange(2, 50) for _ in range(rng.randint(1, k_max))]
        if rng.random() < 0.02 and sched.has_unfinished():
            victim = rng.choice(added)
            if sched.abort(victim.seq_id) is not None:
                released.append(victim)
                assert victim.block_table == []
        released += sched.release_finished()
        if len(added) == 600 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "the simulation must drain"
    assert sched.block_manager.num_used_blocks == 0 and sched.block_manager.num_free_blocks == cfg.num_blocks
    assert sorted(s.seq_id for s in released) == sorted(s.seq_id for s in added)
    assert all(s.is_finished and s.finish_reason in ("stop", "length", "abort", "error") for s in added)
    for s in added:
        if s.finish_reason in ("stop", "length") and s.error is None:
            assert s.num_tokens <= cfg.max_model_len and s.num_output_tokens <= s.sampling_params.max_tokens
    assert num_preempted > 0 and num_mixed > 0
    assert any(s.finish_reason == "error" for s in added)


def test_host_modules_do_not_import_torch():
    code = ("import sys; import peagle.engine.scheduler, peagle.engine.sequence, peagle.engine.block_manager, "
            "peagle.engine.sampling_params; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_schedule_ahead_reserves_for_the_unseen_answer():
    sched = Scheduler(make_config(num_lookahead_slots=2, block_size=4, max_model_len=20))
    a, b = make_seq("a", num_prompt=5), make_seq("b", num_prompt=6)
    for seq in (a, b):
        sched.add(seq)
    run_step(sched, sched.schedule())  # 6 and 7 tokens
    # The step in flight may add up to 3 tokens each (2 drafts accepted + 1); the next feeds 3 (1 + 2 drafts).
    assert sched.schedule_ahead([a, b], 3, 3)
    for seq in (a, b):
        assert len(seq.block_table) * 4 >= seq.num_tokens + 3 + 2
    assert not sched.schedule_ahead([a], 3, 3)  # b runs but would be left out
    assert not sched.schedule_ahead([a, b], 14, 3)  # could pass max_model_len: cut drafts need the answer


def test_schedule_ahead_refuses_waiting_admissions_budget_and_preemption():
    sched = Scheduler(make_config(max_num_seqs=2, num_blocks=7, block_size=4, max_num_batched_tokens=64))
    a, b, c = make_seq("a", num_prompt=7), make_seq("b", num_prompt=7), make_seq("c")
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.add(b)
    assert not sched.schedule_ahead([a], 1, 1)  # b waits and could be admitted
    run_step(sched, sched.schedule())
    sched.add(c)
    # a has 9 tokens, b 8: up to 10 and 9 after the step in flight, 3 blocks each.
    assert sched.num_running == 2 and sched.schedule_ahead([a, b], 1, 1)  # c waits for a slot either way
    assert sched.block_manager.num_free_blocks == 1
    assert not sched.schedule_ahead([a, b], 1, 33)  # over the token budget
    assert not sched.schedule_ahead([a, b], 6, 1)  # 15 and 14 slots: would need preemption
    assert sched.num_running == 2 and list(sched.waiting) == [c]


def run_chunked_step(sched, out, token=7):
    """run_step for chunked prefill: a chunk that ends inside its span samples nothing."""
    for seq, n in zip(out.seqs, out.num_scheduled_tokens):
        if n < seq.num_new_tokens:
            seq.commit_chunk(n)
        else:
            seq.commit(seq.draft_token_ids + [token])
    return sched.release_finished()


def test_chunked_prefill_never_stalls_running_decodes():
    sched = Scheduler(make_config(max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=True,
                                  num_lookahead_slots=2))
    a, b, long = make_seq("a", num_prompt=3), make_seq("b", num_prompt=4), make_seq("long", num_prompt=30)
    for seq in (a, b):
        sched.add(seq)
    run_chunked_step(sched, sched.schedule())
    a.draft_token_ids = [3, 4]
    sched.add(long)
    fed = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sched.schedule()
        assert out.seqs[-2:] == [a, b] and out.num_scheduled_tokens[-2:] == [3, 1]  # every decode, every step
        assert out.seqs[0] is long and out.num_prefill == 1 and sum(out.num_scheduled_tokens) <= 8
        fed.append(out.num_scheduled_tokens[0])
        run_chunked_step(sched, out)
        a.draft_token_ids = [3, 4]
    assert fed == [4, 4, 4, 4, 4, 4, 4, 2] and sum(fed) == 30  # the last chunk completes the prompt
    assert long.output_token_ids == [7] and long.num_computed_tokens == 30


def test_chunked_prefill_config_and_a_prompt_over_the_budget():
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        make_config(max_num_batched_tokens=16, max_model_len=64)
    with pytest.raises(ValueError, match="starve"):  # 4 decodes of 1 + 3 drafts would fill every step
        make_config(max_num_batched_tokens=15, enable_chunked_prefill=True, num_lookahead_slots=6)
    sched = Scheduler(make_config(max_num_batched_tokens=16, max_model_len=64, enable_chunked_prefill=True))
    seq = make_seq("a", num_prompt=40, max_tokens=2)
    sched.add(seq)
    counts = []
    while sched.has_unfinished():
        out = sched.schedule()
        counts.append(out.num_scheduled_tokens)
        run_chunked_step(sched, out)
    assert counts == [[16], [16], [8], [1]] and seq.output_token_ids == [7, 7]
    assert sched.block_manager.num_used_blocks == 0
