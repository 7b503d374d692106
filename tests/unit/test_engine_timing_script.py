"""The device script scripts/device/engine_timing.py on the CPU: its closed loop (answer lengths drawn apart, the
admitting steps split into their parts) and its variant names. The timings themselves are the GPU's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from peagle import LLM
from peagle.engine.model_runner import ModelRunner, StepHandle

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device" / "engine_timing.py"


@pytest.fixture(scope="module")
def timing():
    spec = importlib.util.spec_from_file_location("engine_timing", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama", num_layers=2)


def test_split_variant(timing):
    assert timing.split_variant("async+prefill-graphs") == ("async+prefill-graphs", set())
    assert timing.split_variant("async+prefill-graphs+coarse-buckets+fused-merge") == (
        "async+prefill-graphs", {"coarse-buckets", "fused-merge"})
    assert timing.split_variant("sync+fused-merge") == ("sync", {"fused-merge"})
    assert timing.split_variant("async+prefill-graphs+admit-ahead") == ("async+prefill-graphs", {"admit-ahead"})
    assert timing.split_variant("async+prefill-graphs+admit-ahead+mixed-tiles") == (
        "async+prefill-graphs", {"admit-ahead", "mixed-tiles"})
    assert timing.split_variant("async+prefill-graphs+admit-ahead+pdl") == (
        "async+prefill-graphs", {"admit-ahead", "pdl"})
    assert timing.split_variant("async+prefill-graphs+gemv+admit-ahead+pdl+gemv-wide") == (
        "async+prefill-graphs+gemv", {"admit-ahead", "pdl", "gemv-wide"})


def test_split_cutoff(timing):
    assert timing.split_cutoff("async+prefill-graphs") == ("async+prefill-graphs", None)
    assert timing.split_cutoff("async+prefill-graphs+fused-merge+cutoff=0.1") == (
        "async+prefill-graphs+fused-merge", 0.1)
    assert timing.split_variant(timing.split_cutoff("sync+admit-ahead+cutoff=0")[0]) == ("sync", {"admit-ahead"})
    with pytest.raises(SystemExit, match=r"\+cutoff=C needs a number"):
        timing.split_cutoff("sync+cutoff=high")


def test_engine_switches_are_llm_options(timing, target_dir):
    # each off without its modifier; LLM takes them (a tree from before took them as module switches)
    switches = timing.engine_switches(timing.split_variant("async+prefill-graphs+admit-ahead+pdl")[1])
    assert switches == {"fused_merge": False, "mixed_tiles": False, "admit_ahead": True}
    config = LLM(model=str(target_dir), device="cpu", dtype="float32", max_model_len=64, **switches).engine.config
    assert (config.fused_merge, config.mixed_tiles, config.admit_ahead) == (False, False, True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_closed_loop_jitter_and_parts(timing, target_dir, async_scheduling):
    llm = LLM(model=str(target_dir), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4,
              async_scheduling=async_scheduling)
    eng = llm.engine
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    lengths = {}
    for _, _, _, outs in timing.closed_loop(eng, prompts, "j", batch=4, num_requests=12, max_tokens=10, jitter=0.5):
        for o in outs:
            lengths[o.request_id] = lengths.get(o.request_id, 0) + len(o.new_token_ids)
    assert len(lengths) == 12
    assert all(5 <= n <= 15 for n in lengths.values()) and len(set(lengths.values())) > 2  # drawn apart
    again = {}
    for _, _, _, outs in timing.closed_loop(eng, prompts, "k", batch=4, num_requests=12, max_tokens=10, jitter=0.5):
        for o in outs:
            again[o.request_id] = again.get(o.request_id, 0) + len(o.new_token_ids)
    assert sorted(again.values()) == sorted(lengths.values())  # seeded by the request's index

    result = StepHandle.result
    row = timing.closed_loop_steps(eng, prompts, "s", batch=4, num_requests=12, max_tokens=10, jitter=0.5)
    # staggered finishes: new requests come in beside running ones, one or two at a time
    assert row["admit_steps"] >= 4 and row["steps"] > row["admit_steps"]
    assert row["admit_launch_ms_p50"] > 0  # every admitting step launches a step
    assert row["admit_gpu_ms_p50"] == 0.0  # no CUDA events on the CPU
    if async_scheduling:
        assert row["admit_wait_ms_p50"] > 0  # the answer before is awaited before admitting
    # the patched methods are restored
    assert StepHandle.result is result and "launch" not in vars(eng.runner)
    assert "launch_admit_next" not in vars(eng.runner)
    assert eng.runner.launch.__func__ is ModelRunner.launch


def test_profiled_closed_loop_splits_admitting_steps(timing, target_dir, tmp_path):
    """The third, profiled pass: every step in the window is a range of its own, admitting and other steps both
    seen, the table and the gzipped trace written, and the engine's step method restored."""
    import gzip
    import json

    llm = LLM(model=str(target_dir), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4)
    eng = llm.engine
    path = tmp_path / "prof" / "loop.txt"
    row = timing.profile_closed_loop(eng, [[5, 6, 7], [8, 9]], "p", batch=4, max_tokens=10, jitter=0.5,
                                     path=str(path), steps=12)
    assert row["profiled_admit_steps"] >= 1 and row["profiled_pure_steps"] >= 1
    assert row["profiled_admit_steps"] + row["profiled_pure_steps"] == 12
    assert row["profiled_admit_host_ms_p50"] > 0 and row["profiled_pure_host_ms_p50"] > 0
    assert row["profiled_admit_kernels_p50"] == 0  # no device kernels on the CPU
    text = path.read_text()
    assert "admit steps:" in text and "pure steps:" in text
    trace = json.loads(gzip.open(f"{path}.trace.json.gz").read())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert sum(n.startswith("peagle step ") for n in names) == 12
    assert "step" not in vars(eng) and not eng.has_unfinished_requests()
    # a window longer than the loop: the profiler stops with the loop, every step profiled
    row = timing.profile_closed_loop(eng, [[5, 6, 7]], "q", batch=4, max_tokens=4, jitter=0.0,
                                     path=str(tmp_path / "short.txt"), steps=10_000)
    assert row["profiled_admit_steps"] + row["profiled_pure_steps"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--loop-jitter", "1.5"], "--loop-jitter 1.5"),
    (["--synthetic-acceptance", "0.5,0.2"], "add --load-format dummy"),
    (["--load-format", "dummy", "--synthetic-acceptance", "0.5,x"], "comma-separated rates"),
    (["--closed-loop", "64"], "CONCURRENCY:TOKENS"),
    (["--closed-loop", "2:8", "--loop-dataset", "nope"], "--loop-dataset 'nope': unknown dataset"),
])
def test_bad_arguments_are_refused_by_name(timing, argv, message, capsys):
    with pytest.raises(SystemExit):
        timing.main(["target", "out.json", *argv])
    assert message in capsys.readouterr().err


def test_loop_dataset_keeps_only_prompts_that_fit(timing, target_dir, capsys):
    # Long-code prompts run to thousands of tokens: none fits a 256-token model beside its answer, which is refused
    # by name (a run that measured nothing would otherwise write an empty table).
    with pytest.raises(SystemExit):
        timing.main([str(target_dir), "out.json", "--closed-loop", "2:8", "--loop-dataset", "longcode",
                     "--max-model-len", "256"])
    assert "--loop-dataset 'longcode': no prompt fits --max-model-len 256" in capsys.readouterr().err
