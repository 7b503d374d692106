import pytest

from peagle.bench.hf_baseline import HfBaseline

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def baseline(tiny_hf_checkpoint):
    return HfBaseline(str(tiny_hf_checkpoint("llama", num_layers=2)), dtype="float32", device="cpu",
                      max_tokens=MAX_TOKENS, ignore_eos=True)


PROMPTS = [[10, 11, 12, 13, 14, 15, 16], [20, 21, 22], [30, 31, 32, 33, 34]]


def test_left_padded_batch_generates_what_each_prompt_generates_alone(baseline):
    alone = [baseline._generate([p])[0] for p in PROMPTS]
    assert baseline._generate(PROMPTS) == alone
    assert all(len(row) == MAX_TOKENS for row in alone)


def test_run_all_reports_every_cpu_baseline(baseline):
    results = list(baseline.run_all(PROMPTS, num_prompts=2, batch_sizes=(1, 3)))
    # Static cache + compile needs CUDA: on the CPU it is skipped, never reported under its name.
    assert [(method, batch) for method, batch, _ in results] == [("hf_eager", 1), ("hf_eager", 3),
                                                                 ("hf_prompt_lookup", 1)]
    prompts_used = {(method, batch): m.num_prompts for method, batch, m in results}
    assert prompts_used == {("hf_eager", 1): 2, ("hf_eager", 3): 3, ("hf_prompt_lookup", 1): 2}
    for _, _, m in results:
        assert m.output_tokens == m.num_prompts * MAX_TOKENS  # ignore_eos: every request runs to max_tokens
        assert m.tokens_per_s > 0 and m.ttft_p50_ms is None and m.acceptance_length is None


def test_output_counts_stop_at_the_first_eos(baseline):
    eos = min(baseline.eos_ids)
    assert baseline._count_output([5, 6, eos, eos, eos]) == 3
    assert baseline._count_output([5, 6, 7]) == 3


def test_run_all_measures_only_the_baselines_asked_for(baseline):
    results = list(baseline.run_all(PROMPTS, num_prompts=2, batch_sizes=(1, 3), methods=("prompt_lookup",)))
    assert [(method, batch) for method, batch, _ in results] == [("hf_prompt_lookup", 1)]
    with pytest.raises(ValueError, match="unknown HF baseline"):
        list(baseline.run_all(PROMPTS, num_prompts=2, batch_sizes=(1,), methods=("eager", "beam")))


def test_a_fast_baseline_repeats_whole_passes_until_min_seconds(tiny_hf_checkpoint, monkeypatch):
    # A clock that advances 0.5 s per reading (a batch reads it twice, the check after a pass once): a pass over 2
    # prompts at batch 1 moves it 2.5 s, so a 6 s minimum needs three whole passes; without a minimum, one pass.
    from peagle.bench import hf_baseline

    now = [0.0]

    def clock():
        now[0] += 0.5
        return now[0]

    monkeypatch.setattr(hf_baseline.time, "perf_counter", clock)
    counts = {}
    for min_seconds in (0.0, 6.0):
        b = HfBaseline(str(tiny_hf_checkpoint("llama", num_layers=2)), dtype="float32", device="cpu",
                       max_tokens=MAX_TOKENS, ignore_eos=True, min_seconds=min_seconds)
        (_, _, m), = b.run_all(PROMPTS, num_prompts=2, batch_sizes=(1,), methods=("eager",))
        counts[min_seconds] = m.num_prompts
        assert m.output_tokens == m.num_prompts * MAX_TOKENS and m.wall_s >= min_seconds
    assert counts == {0.0: 2, 6.0: 6}
