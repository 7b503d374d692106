"""`peagle bench --vllm-baselines`: vLLM's rows beside peagle's, each in a child process, here with the stand-in vLLM
of tests/unit/fake_vllm (no model, a millisecond a step) and peagle's rows as fixed measurements."""

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.bench import vllm_baseline
from peagle.bench.measurement import RequestTrace, SpecCounts, summarize
from peagle.bench.report import POINT_KEYS, markdown, merge_results, summary_line
from peagle.bench.sweep import SweepConfig, encode_prompts, load_datasets, run_benchmark
from peagle.bench.vllm_baseline import (
    check_sampling,
    counts_since,
    end_group,
    group_alive,
    llm_arguments,
    spec_counts,
)

FAKE_VLLM = Path(__file__).parent / "fake_vllm"


class FixedRunner:
    """peagle's row as a fixed measurement: each request 8 tokens in a second; speculative rows accept 2 of K in
    each of 3 rounds, at the first two positions. `passes`: the prompts run that many times (a point that repeated
    waves to fill its seconds)."""

    def __init__(self, k: int | None, passes: int = 1):
        self.k, self.passes = k, passes

    def measure(self, prompts, concurrency, *, temperature=0.0, min_seconds=0.0):
        traces = [RequestTrace(submitted=0.0) for _ in range(len(prompts) * self.passes)]
        for trace in traces:
            trace.add_chunk(1.0, 8)
        spec = SpecCounts()
        if self.k:
            spec.add(3, 3 * self.k, 6, [3, 3] + [0] * (self.k - 2))
        return summarize(traces, 1.0, spec)


@contextlib.contextmanager
def peagle_rows(method, k, policy=None):
    yield FixedRunner(k)


def head(tmp_path: Path, name: str, readable: bool = True) -> str:
    """A head directory; the stand-in refuses one without config.json, as vLLM refuses a head it cannot read."""
    d = tmp_path / name
    d.mkdir()
    if readable:
        (d / "config.json").write_text("{}")
    return str(d)


def bench_config(tmp_path: Path, model: Path, **overrides) -> SweepConfig:
    settings = dict(model=str(model), draft_eagle3=head(tmp_path, "eagle3"), draft_peagle=head(tmp_path, "peagle"),
                    ks=(3,), concurrency=(1, 2), datasets=("mtbench",), num_prompts=2, max_tokens=8, ignore_eos=True,
                    vllm_baselines=True, vllm_path=(str(FAKE_VLLM),), remeasure=False)
    return SweepConfig(**{**settings, **overrides})


@pytest.fixture
def vllm_log(tmp_path, monkeypatch) -> Path:
    log = tmp_path / "fake-vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return log


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_vllm_rows_land_beside_peagles_with_their_acceptance(tmp_path, tiny_hf_checkpoint, vllm_log):
    model = tiny_hf_checkpoint("llama", num_layers=1)
    config = bench_config(tmp_path, model)
    results, files = run_benchmark(config, tmp_path / "out", "peagle bench --vllm-baselines",
                                   peagle_rows)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved == json.loads(json.dumps(results, default=str))
    vllm = [p for p in saved["points"] if p.get("engine") == "vllm"]
    assert [(p["method"], p["k"], p["concurrency"]) for p in vllm] == [
        ("vllm_none", None, 1), ("vllm_none", None, 2), ("vllm_eagle3", 3, 1), ("vllm_eagle3", 3, 2),
        ("vllm_peagle", 3, 1), ("vllm_peagle", 3, 2)]
    assert all(list(p) == [*POINT_KEYS, "engine", "vllm_version"] and p["vllm_version"] == "0.25.0+fake"
               for p in vllm)
    assert all(p["num_prompts"] == 2 and p["output_tokens"] == 16 and p["tokens_per_s"] > 0 for p in vllm)
    # 8 tokens = the prefill's 1 + rounds accepting 2 of 3 drafts (3 tokens each) + a round cut to 1 token.
    peagle = next(p for p in vllm if p["method"] == "vllm_peagle" and p["concurrency"] == 1)
    assert peagle["acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert peagle["per_position_acceptance"] == pytest.approx([2 / 3, 2 / 3, 0.0])
    assert next(p for p in vllm if p["method"] == "vllm_none")["acceptance_length"] is None
    assert saved["vllm"]["version"] == "0.25.0+fake" and len(saved["vllm"]["rows"]) == 3
    assert not any(row.get("error") for row in saved["vllm"]["rows"])
    # A speculative row's speed comes from a pass with vLLM's statistics off, its acceptance from a second pass with
    # them on; that pass's own rates are kept beside it. No speculation: the one pass.
    rows = {row["method"]: row for row in saved["vllm"]["rows"]}
    assert "acceptance" not in rows["none"]
    for method in ("eagle3", "peagle"):
        assert rows[method]["llm"]["disable_log_stats"] is True
        assert rows[method]["acceptance"]["llm"]["disable_log_stats"] is False
        assert set(rows[method]["acceptance"]["tokens_per_s"]) == {"mtbench/t0.0/c1", "mtbench/t0.0/c2"}
        assert (tmp_path / "out" / "vllm" / f"{method}-k3.acceptance.log").is_file()

    # vLLM was given what peagle's rows were: the same token ids, max tokens, greedy, ignore_eos, one engine a pass.
    seen = records(vllm_log)
    llms = [r["llm"] for r in seen if "llm" in r]
    assert [((a["speculative_config"] or {}).get("parallel_drafting"), a["disable_log_stats"]) for a in llms] == [
        (None, True), (False, True), (False, False), (True, True), (True, False)]
    assert all(a["max_num_seqs"] == 2 and a["enable_prefix_caching"] is False for a in llms)
    requests = [r for r in seen if "request" in r]
    ids = encode_prompts(config, load_datasets(config))
    assert {tuple(r["prompt_token_ids"]) for r in requests} == {tuple(v) for v in ids.values()}
    assert all(r["temperature"] == 0.0 and r["ignore_eos"] and r["output_kind"] == "DELTA" for r in requests)
    assert {r["max_tokens"] for r in requests} == {8}  # the warm-up's tokens (8, capped) and the point's

    table = (tmp_path / "out" / "results.md").read_text()
    assert "peagle against vLLM 0.25.0+fake on the same prompts (mtbench" in table
    assert "| P-EAGLE | 3 | 1 |" in table
    assert "peagle_vs_vllm.png" in {p.name for p in files["plots"]}
    summary = json.loads(summary_line(results, files))
    assert set(summary["speedup_peagle_vs_vllm_peagle"]["mtbench"]) == {"1", "2"}
    assert (tmp_path / "out" / "vllm" / "peagle-k3.log").is_file()
    assert not list((tmp_path / "out" / "vllm").glob("*.request.json"))  # token ids: not kept


def test_a_head_vllm_refuses_is_recorded_and_the_next_row_runs(tmp_path, tiny_hf_checkpoint, vllm_log):
    model = tiny_hf_checkpoint("llama", num_layers=1)
    config = bench_config(tmp_path, model, draft_eagle3=head(tmp_path, "unreadable", readable=False),
                          concurrency=(1,))
    results, _ = run_benchmark(config, tmp_path / "out", "peagle bench", peagle_rows)
    rows = {row["method"]: row for row in results["vllm"]["rows"]}
    assert "cannot read a draft model config" in rows["eagle3"]["error"] and rows["eagle3"]["points"] == 0
    assert not rows["none"].get("error") and not rows["peagle"].get("error")
    assert {p["method"] for p in results["points"] if p.get("engine")} == {"vllm_none", "vllm_peagle"}
    assert "vLLM EAGLE-3 K=3: ValueError: fake vLLM: cannot read" in markdown(results)


def test_an_acceptance_pass_that_fails_leaves_the_speed_and_says_why(tmp_path, tiny_hf_checkpoint, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_REFUSE_STATS", "1")
    model = tiny_hf_checkpoint("llama", num_layers=1)
    config = bench_config(tmp_path, model, methods=("peagle",), concurrency=(1,))
    results, _ = run_benchmark(config, tmp_path / "out", "peagle bench", peagle_rows)
    (row,) = results["vllm"]["rows"]
    assert not row.get("error") and "statistics refused" in row["acceptance"]["error"]
    assert row["acceptance"]["tokens_per_s"] == {}
    (point,) = [p for p in results["points"] if p.get("engine") == "vllm"]
    assert point["tokens_per_s"] > 0 and point["acceptance_length"] is None  # timed, but no acceptance to show


def test_the_acceptance_pass_repeats_peagles_points_request_for_request(tmp_path, tiny_hf_checkpoint, vllm_log):
    model = tiny_hf_checkpoint("llama", num_layers=1)
    config = bench_config(tmp_path, model, methods=("peagle",), concurrency=(1, 2))

    @contextlib.contextmanager
    def three_passes(method, k, policy=None):  # peagle's points ran their 2 prompts 3 times over
        yield FixedRunner(k, passes=3)

    results, _ = run_benchmark(config, tmp_path / "out", "peagle bench", three_passes)
    peagle = {p["concurrency"]: p["num_prompts"] for p in results["points"] if p["method"] == "peagle"}
    assert peagle == {1: 6, 2: 6}
    counted = json.loads((tmp_path / "out" / "vllm" / "peagle-k3.acceptance.json").read_text())["points"]
    assert {p["concurrency"]: p["num_prompts"] for p in counted} == peagle  # the same requests, in the same order
    timed = json.loads((tmp_path / "out" / "vllm" / "peagle-k3.json").read_text())["points"]
    assert {p["concurrency"]: p["num_prompts"] for p in timed} == {1: 2, 2: 2}  # the speed pass: the time rule


def test_an_interrupted_vllm_row_keeps_what_its_child_measured(tmp_path, tiny_hf_checkpoint, monkeypatch):
    real = subprocess.Popen

    class InterruptedWhileWaiting(real):  # SIGINT (the device stage's `timeout -s INT`) as a row's child ends
        def wait(self, timeout=None):
            status = super().wait(timeout)
            if "peagle.bench.vllm_baseline" in self.args:
                raise KeyboardInterrupt
            return status

    monkeypatch.setattr(vllm_baseline.subprocess, "Popen", InterruptedWhileWaiting)
    model = tiny_hf_checkpoint("llama", num_layers=1)
    config = bench_config(tmp_path, model, methods=("peagle",), concurrency=(1, 2))
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(config, tmp_path / "out", "peagle bench", peagle_rows)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    vllm = [p for p in saved["points"] if p.get("engine") == "vllm"]
    assert [(p["method"], p["concurrency"]) for p in vllm] == [("vllm_peagle", 1), ("vllm_peagle", 2)]
    assert all(p["tokens_per_s"] > 0 for p in vllm) and saved["vllm"]["rows"][0]["points"] == 2


def test_vllm_absent_is_refused_by_name_before_anything_is_measured(tmp_path):
    broken = tmp_path / "site" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('no vllm here')\n")
    config = SweepConfig(model="m", methods=("none",), vllm_baselines=True, vllm_path=(str(broken.parent),))
    opened = []

    def open_runner(*row):
        opened.append(row)
        raise AssertionError("nothing is measured without vLLM")

    with pytest.raises(ValueError, match=r"--vllm-baselines: .* cannot import vllm \(ImportError: no vllm here\); "
                                         r"install it .*docs/DEVICE.md"):
        run_benchmark(config, tmp_path / "out", "peagle bench", open_runner)
    assert not opened and not (tmp_path / "out").exists()


@pytest.mark.parametrize("settings, named", [
    ({"url": "http://127.0.0.1:8000", "methods": ("none",)}, "drop --url"),
    ({"draft_peagle": "dummy", "load_format": "dummy", "methods": ("peagle",)}, "--draft-peagle dummy"),
    ({"draft_peagle": "p", "methods": ("peagle",), "load_format": "dummy", "ks": (3,),
      "synthetic_acceptance": (0.5, 0.6, 0.2)}, "--synthetic-acceptance 0.5,0.6,0.2 rises"),
    ({"methods": ("none",), "vllm_options": {"disable_log_stats": True}}, "--vllm-option disable_log_stats=true: the "
                                                                            "vLLM rows set it themselves"),
])
def test_settings_vllm_cannot_reproduce_are_refused_by_name(settings, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")):
        SweepConfig(**{"model": "m", "vllm_baselines": True, **settings})


def test_a_sampling_option_vllm_cannot_reproduce_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="cannot reproduce the sampling option.s. top_k in vLLM"):
        check_sampling({"ignore_eos": True, "top_k": 5})
    # The child refuses it too, before it builds an engine, and says so in its result.
    request, result = tmp_path / "request.json", tmp_path / "result.json"
    request.write_text(json.dumps({"method": "none", "k": None, "llm": {"model": "m"},
                                   "sampling": {"ignore_eos": False, "top_k": 5}, "grid": {}, "prompts": {}}))
    config = SweepConfig(model="m", methods=("none",), vllm_path=(str(FAKE_VLLM),))
    done = subprocess.run([sys.executable, "-m", "peagle.bench.vllm_baseline", str(request), str(result)],
                          env=vllm_baseline.child_environment(config), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "top_k" in json.loads(result.read_text())["error"]


def test_vllm_is_given_the_sweeps_settings():
    config = SweepConfig(model="m", draft_peagle="p", methods=("peagle",), ks=(2,), concurrency=(1, 64),
                         load_format="dummy", tokenizer="t", max_model_len=4096, dtype="float16",
                         synthetic_acceptance=(0.8, 0.5, 0.2), llm_options={"enable_prefix_caching": True},
                         vllm_options={"async_scheduling": True})
    args = llm_arguments(config, "peagle", 2)
    assert args == {"model": "m", "dtype": "float16", "max_num_seqs": 64, "gpu_memory_utilization": 0.9,
                    "enforce_eager": False, "enable_prefix_caching": True, "seed": 0, "max_model_len": 4096,
                    "tokenizer": "t", "load_format": "dummy", "async_scheduling": True, "disable_log_stats": True,
                    "speculative_config": {"method": "eagle3", "model": "p", "num_speculative_tokens": 2,
                                           "parallel_drafting": True, "rejection_sample_method": "synthetic",
                                           "synthetic_acceptance_rates": [0.8, 0.5]}}
    assert "speculative_config" not in llm_arguments(config, "none", None)
    assert llm_arguments(config, "peagle", 2, stats=True) == {**args, "disable_log_stats": False}


def test_counters_are_summed_over_engines_and_taken_as_changes():
    class Metric:
        def __init__(self, name, value=None, values=None):
            self.name, self.value, self.values = name, value, values

    class Llm:
        def get_metrics(self):
            return [Metric("vllm:spec_decode_num_drafts", 4), Metric("vllm:spec_decode_num_drafts", 6),
                    Metric("vllm:spec_decode_num_draft_tokens", 30), Metric("vllm:spec_decode_num_accepted_tokens", 12),
                    Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[5, 3]),
                    Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[2, 1, 1]),
                    Metric("vllm:num_requests_running", 3)]

    def fields(c: SpecCounts) -> tuple:
        return c.rounds, c.drafted, c.accepted, c.accepted_per_position

    now = spec_counts(Llm())
    assert fields(now) == (10, 30, 12, [7, 4, 1])
    assert fields(counts_since(now, SpecCounts(4, 12, 5, [3, 2]))) == (6, 18, 7, [4, 2, 1])


def test_a_child_and_what_it_started_are_ended_together(monkeypatch):
    # Both processes ignore nothing: a parent run under nohup hands SIGINT ignored to its children, and the real
    # child restores it (vllm_baseline.main) as these do. Ended by SIGINT, not by the SIGKILL after the grace.
    monkeypatch.setattr(vllm_baseline, "GRACE_S", 600.0)
    restore = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    code = (f"{restore}import subprocess, sys, time; "
            f"subprocess.Popen([sys.executable, '-c', {restore + 'import time; time.sleep(600)'!r}]); "
            "print('ready', flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    end_group(child)
    assert not group_alive(child)
    assert child.returncode == -signal.SIGINT  # KeyboardInterrupt uncaught: the interpreter ends by the signal


def test_the_vllm_child_restores_sigint_that_a_background_parent_ignores(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(vllm_baseline, "measure_in_child",
                        lambda request, result: seen.append(signal.getsignal(signal.SIGINT)))
    request = tmp_path / "request.json"
    request.write_text("{}")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as nohup or a background job leaves it
    try:
        assert vllm_baseline.main([str(request), str(tmp_path / "result.json")]) == 0
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [signal.default_int_handler]


def test_merged_runs_keep_every_runs_vllm_rows():
    def run(method, k):
        return {"command": f"peagle bench --methods {method}", "config": {}, "points": [],
                "vllm": {"version": "0.25.0", "rows": [{"method": method, "k": k}]}}

    merged = merge_results([run("none", None), run("peagle", 7)])
    assert merged["vllm"]["rows"] == [{"method": "none", "k": None}, {"method": "peagle", "k": 7}]


def test_bench_command_line_builds_the_vllm_settings():
    from peagle.cli import build_parser
    from peagle.bench.cli import sweep_config_from_args

    args = build_parser().parse_args(["bench", "--model", "m", "--methods", "none", "--vllm-baselines",
                                      "--vllm-path", "/tmp/vllm-site:/tmp/x", "--vllm-python", "python3.12",
                                      "--vllm-option", "async_scheduling=true"])
    config = sweep_config_from_args(args)
    assert config.vllm_baselines and config.vllm_path == ("/tmp/vllm-site", "/tmp/x")
    assert config.vllm_python == "python3.12" and config.vllm_options == {"async_scheduling": True}
