"""Async scheduling that admits waiting prompts in a step launched before the answer in flight arrives
(`EngineConfig.admit_ahead`, on by default since run 14): the prompts' rows built on the host, the decodes' rows on
the device from the answer in flight. Output must equal the engine's without async scheduling, token for token; the
scheduler's part (`Scheduler.admit_ahead`) admits only what fits whole."""

from __future__ import annotations

import pytest
from engine_helpers import cpu_llm, spec_config
from test_engine_prefill_graphs import heads, target_dir  # noqa: F401 (fixtures: a 4-layer target, random heads)

from peagle import SamplingParams
from peagle.engine.scheduler import Scheduler, SchedulerConfig
from peagle.engine.sequence import Sequence, SequenceStatus

PROMPTS = [[7, 20, 31, 40], [9, 15], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30], [50, 60, 70],
           list(range(100, 135)), [3, 4], [80, 81, 82, 83, 84, 85]]


def make_llm(target_dir, head, method, *, async_scheduling: bool, padded: bool = False, admit_ahead: bool = True):
    llm = cpu_llm(target_dir, spec_config(head, 3, method == "peagle"), max_num_seqs=3,
                  async_scheduling=async_scheduling, admit_ahead=admit_ahead)
    if padded:
        llm.engine.runner.general_graphs = llm.engine.general_graphs(capture=False)
    return llm


def params(temperature=0.0):
    # Lengths apart, so requests finish at different steps and the waiting ones come in beside running decodes.
    return [SamplingParams(temperature=temperature, max_tokens=6 + 5 * (i % 4), ignore_eos=True, seed=i)
            for i in range(len(PROMPTS))]


def count_admit_ahead(runner) -> list[int]:
    """The number of prompts each admit-ahead launch took in."""
    calls, real = [], runner.launch_admit_next

    def launch_admit_next(prev, rows, seqs, new, st, plan):
        calls.append(len(new))
        return real(prev, rows, seqs, new, st, plan)

    runner.launch_admit_next = launch_admit_next
    return calls


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("method", [None, "eagle3", "peagle"])
def test_admit_ahead_keeps_greedy_output(target_dir, heads, method, padded):
    ref = make_llm(target_dir, heads[method], method, async_scheduling=False).generate(PROMPTS, params(),
                                                                                       use_tqdm=False)
    llm = make_llm(target_dir, heads[method], method, async_scheduling=True, padded=padded, admit_ahead=True)
    calls = count_admit_ahead(llm.engine.runner)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert len(calls) >= 2, calls  # prompts came in ahead of the answers while others decoded
    if method is not None:
        assert all(o.metrics.num_drafting_rounds > 0 for o in outs)


def test_admit_ahead_off_launches_none(target_dir, heads):
    llm = make_llm(target_dir, heads["peagle"], "peagle", async_scheduling=True, admit_ahead=False)
    calls = count_admit_ahead(llm.engine.runner)
    llm.generate(PROMPTS, params(), use_tqdm=False)
    assert calls == []


def test_admit_ahead_keeps_seeded_sampling(target_dir, heads):
    """Seeded sampling draws from each request's own generator: the same text with and without admission ahead."""
    ref = make_llm(target_dir, heads["peagle"], "peagle", async_scheduling=True, admit_ahead=False).generate(
        PROMPTS, params(0.8), use_tqdm=False)
    llm = make_llm(target_dir, heads["peagle"], "peagle", async_scheduling=True, admit_ahead=True)
    calls = count_admit_ahead(llm.engine.runner)
    outs = llm.generate(PROMPTS, params(0.8), use_tqdm=False)
    assert calls
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_prompts_needing_logits_processing_wait_for_the_answer(target_dir, heads):
    llm = make_llm(target_dir, heads["peagle"], "peagle", async_scheduling=True, admit_ahead=True)
    calls = count_admit_ahead(llm.engine.runner)
    p = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.2)] * len(PROMPTS)
    ref = make_llm(target_dir, heads["peagle"], "peagle", async_scheduling=False).generate(PROMPTS, p,
                                                                                           use_tqdm=False)
    outs = llm.generate(PROMPTS, p, use_tqdm=False)
    assert calls == [] and [o.token_ids for o in outs] == [o.token_ids for o in ref]


def _scheduler(**kw) -> Scheduler:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=40, max_model_len=40, block_size=4, num_blocks=40,
               num_lookahead_slots=6)
    return Scheduler(SchedulerConfig(**{**cfg, **kw}))


def _running(sched: Scheduler, n: int) -> list[Sequence]:
    """n sequences admitted and prefilled (as after one step), each decoding with 3 drafts."""
    for i in range(n):
        sched.add(Sequence(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50), 0.0))
    out = sched.schedule()
    for seq in out.seqs:
        seq.commit([9])
        seq.draft_token_ids = [1, 2, 3]
    return list(sched.running)


def test_scheduler_admits_whole_prompts_within_budget_slots_and_blocks():
    sched = _scheduler()
    seqs = _running(sched, 2)
    for i, n in enumerate((10, 12, 3)):
        sched.add(Sequence(f"w{i}", list(range(1, n + 1)), SamplingParams(max_tokens=5), 0.0))
    # decodes: 2 x (1 + 3) = 8 of the 40 tokens; 10 + 12 fit (30), then no request slot is left (4 running)
    new = sched.admit_ahead(seqs, 4, 4)
    assert [s.seq_id for s in new] == ["w0", "w1"]
    assert all(s.status is SequenceStatus.RUNNING and s.block_table for s in new)
    assert sched.running == seqs + new and [s.seq_id for s in sched.waiting] == ["w2"]
    assert sched.admit_ahead(sched.running, 4, 4) == []  # no slot left


def test_scheduler_leaves_a_prompt_that_would_need_chunks_or_room_to_schedule():
    sched = _scheduler()
    seqs = _running(sched, 2)
    sched.add(Sequence("long", list(range(1, 34)), SamplingParams(max_tokens=5), 0.0))  # 33 > 40 - 8
    assert sched.admit_ahead(seqs, 4, 4) == [] and sched.num_waiting == 1
    sched = _scheduler(num_blocks=10)
    seqs = _running(sched, 2)
    sched.add(Sequence("w", list(range(1, 11)), SamplingParams(max_tokens=5), 0.0))
    assert sched.admit_ahead(seqs, 4, 4) == [] and sched.num_waiting == 1  # not free once the decodes reserve
    out = sched.schedule()  # the full schedule decides after the answer
    assert out.seqs
