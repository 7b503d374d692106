"""The sweep runner on a fake engine with a fake clock: every measured number is known exactly."""

import contextlib
import json
from dataclasses import dataclass, field

import pytest

from peagle.datasets import Prompt
from peagle.bench.engine_runner import EngineRunner
from peagle.bench.report import POINT_KEYS, markdown, summary_line
from peagle.bench.sweep import SweepConfig, run_benchmark, run_sweep

STEP_S = 0.010  # fixed cost of one engine step
PER_SEQ_S = 0.001  # plus this per running sequence


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeParams:
    max_tokens: int
    temperature: float = 0.0


class ListSink(list):
    """A sweep's sink that keeps points in a list."""

    def add(self, point):
        self.append(point)

    def flush(self):
        pass


@dataclass
class FakeMetrics:
    num_drafting_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_verified_tokens: int = 0


@dataclass
class FakeOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    metrics: FakeMetrics | None = None


class FakeEngine:
    """Runs every request at once; after the prefill step, each round accepts `accepted` of `k` drafts.

    A step costs STEP_S + PER_SEQ_S per running request (+ `draft_s` when speculating). Prompts whose first token
    is -1 fail at their first step, as an over-long prompt does in the real engine.
    """

    def __init__(self, clock: FakeClock, k: int = 0, accepted: int = 0, draft_s: float = 0.0, lose: bool = False,
                 verify_s: float = 0.0):
        self.clock, self.k, self.accepted, self.draft_s, self.lose = clock, k, accepted, draft_s, lose
        self.verify_s = verify_s  # per running request and draft: verification that grows with the batch
        self.extra_s = 0.0  # per step, to fake a stall
        self.running: dict[str, dict] = {}
        self.params_seen: list[int] = []
        self.temperatures_seen: list[float] = []

    def add_request(self, request_id, prompt_token_ids, sampling_params):
        self.params_seen.append(sampling_params.max_tokens)
        self.temperatures_seen.append(sampling_params.temperature)
        self.running[request_id] = {"left": sampling_params.max_tokens, "prefilled": False,
                                    "bad": prompt_token_ids[0] == -1,
                                    "m": FakeMetrics(accepted_per_position=[0] * self.k)}

    def has_unfinished_requests(self):
        return bool(self.running) and not self.lose

    def abort_request(self, request_id):
        return self.running.pop(request_id, None) is not None

    def stats(self):
        return {"running": len(self.running)}

    def step(self):
        self.clock.t += (STEP_S + PER_SEQ_S * len(self.running) + (self.draft_s if self.k else 0.0)
                         + self.verify_s * self.k * len(self.running) + self.extra_s)
        outputs = []
        for rid, r in list(self.running.items()):
            if r["bad"]:
                del self.running[rid]
                outputs.append(FakeOutput(rid, [], True, "error", error="prompt too long"))
                continue
            if not r["prefilled"]:
                n, r["prefilled"] = 1, True
            else:
                a = min(self.accepted, r["left"] - 1) if self.k else 0
                n = 1 + a
                if self.k:
                    m = r["m"]
                    m.num_drafting_rounds += 1
                    m.num_draft_tokens += self.k
                    m.num_verified_tokens += self.k
                    m.num_accepted_tokens += a
                    for i in range(a):
                        m.accepted_per_position[i] += 1
            r["left"] -= n
            done = r["left"] == 0
            if done:
                del self.running[rid]
            outputs.append(FakeOutput(rid, [7] * n, done, "length" if done else None,
                                      metrics=r["m"] if done else None))
        return outputs


def prompts(n: int) -> list[Prompt]:
    return [Prompt.user(f"p{i}", f"question {i}") for i in range(n)]


def runner(engine: FakeEngine, clock: FakeClock, max_tokens: int, bad: set[str] = frozenset()) -> EngineRunner:
    encode = lambda p: [-1] if p.id in bad else [1, 2, 3]  # noqa: E731
    return EngineRunner(engine, encode, lambda t, n: FakeParams(n, t), max_tokens, warmup_tokens=2, clock=clock)


def test_concurrency_one_without_speculation():
    clock = FakeClock()
    engine = FakeEngine(clock)
    m = runner(engine, clock, max_tokens=5).measure(prompts(3), 1)
    step = STEP_S + PER_SEQ_S
    assert m.num_prompts == 3 and m.num_failed == 0
    assert m.output_tokens == 15  # the warm-up request's tokens are not counted
    assert m.wall_s == pytest.approx(15 * step)
    assert m.tokens_per_s == pytest.approx(15 / (15 * step))
    assert m.ttft_p50_ms == pytest.approx(step * 1e3) and m.itl_p99_ms == pytest.approx(step * 1e3)
    assert m.acceptance_length is None and m.per_position_acceptance == []
    assert engine.params_seen == [2, 2, 2, 5, 5, 5]  # every prompt warmed with the warm-up params first


def test_concurrency_two_with_speculation():
    clock = FakeClock()
    engine = FakeEngine(clock, k=3, accepted=2, draft_s=0.004)
    m = runner(engine, clock, max_tokens=7).measure(prompts(4), 2)
    step = STEP_S + 2 * PER_SEQ_S + 0.004
    # 7 tokens = prefill 1 + two rounds of 3: three steps per pair of requests, two pairs.
    assert m.output_tokens == 28
    assert m.wall_s == pytest.approx(6 * step)
    assert m.acceptance_length == pytest.approx(3.0)
    assert m.per_position_acceptance == pytest.approx([1.0, 1.0, 0.0])
    assert m.draft_acceptance_rate == pytest.approx(2 / 3)
    # A round's 3 tokens arrive together: each counts a third of the step as its inter-token latency.
    assert m.itl_p50_ms == pytest.approx(step / 3 * 1e3)
    assert engine.params_seen[:2] == [2, 2]  # warm-up fills the batch size being measured


def test_failed_requests_are_counted_not_measured():
    clock = FakeClock()
    m = runner(FakeEngine(clock), clock, max_tokens=4, bad={"p1"}).measure(prompts(3), 3)
    assert m.num_prompts == 2 and m.num_failed == 1 and m.output_tokens == 8


def test_engine_that_drops_requests_is_an_error():
    clock = FakeClock()
    with pytest.raises(RuntimeError, match="lost"):
        runner(FakeEngine(clock, lose=True), clock, max_tokens=4).measure(prompts(2), 2)


def fake_open_runner(clock: FakeClock, max_tokens: int):
    """(method, K) -> a runner on a fake engine where P-EAGLE drafts in one pass and EAGLE-3 in K passes."""

    @contextlib.contextmanager
    def open_runner(method, k, policy=None):
        if method == "none":
            engine = FakeEngine(clock)
        elif method == "eagle3":
            engine = FakeEngine(clock, k=k, accepted=min(2, k), draft_s=0.002 * k)
        else:
            engine = FakeEngine(clock, k=k, accepted=k - 1, draft_s=0.002)
        yield runner(engine, clock, max_tokens)

    return open_runner


def test_run_sweep_visits_every_point():
    config = SweepConfig(model="unused", draft_eagle3="e", draft_peagle="p", ks=(3, 7), concurrency=(1, 2),
                         datasets=("mtbench",), num_prompts=4, max_tokens=10)
    seen = ListSink()
    points = run_sweep(config, fake_open_runner(FakeClock(), 10), seen, {"mtbench": prompts(4)})
    assert seen == points and len(points) == 10  # (none + 2 K x 2 methods) x 2 concurrencies
    assert [(p["method"], p["k"], p["concurrency"]) for p in points[:3]] == [("none", None, 1), ("none", None, 2),
                                                                           ("eagle3", 3, 1)]
    assert all(list(p) == list(POINT_KEYS) for p in points)
    peagle7 = next(p for p in points if p["method"] == "peagle" and p["k"] == 7)
    # 10 tokens = prefill 1 + a round of 7 (6 accepted) + a round cut at max_tokens to 2 (1 accepted).
    assert peagle7["acceptance_length"] == pytest.approx(1 + 7 / 2)
    assert peagle7["per_position_acceptance"] == pytest.approx([1.0] + [0.5] * 5 + [0.0])


def test_every_point_has_at_least_its_concurrency_in_prompts():
    config = SweepConfig(model="unused", methods=("none",), concurrency=(1, 2, 8), datasets=("mtbench",),
                         num_prompts=3, max_tokens=4)
    points = run_sweep(config, fake_open_runner(FakeClock(), 4), ListSink(), {"mtbench": prompts(10)})
    # Rounded up to full waves: 3 at c=1, 4 at c=2, 8 at c=8.
    assert [(p["concurrency"], p["num_prompts"]) for p in points] == [(1, 3), (2, 4), (8, 8)]
    table = markdown({"points": points, "config": config.to_json()})
    assert "### mtbench (3-8 requests per point)" in table


def test_run_benchmark_writes_results_table_and_plots(tmp_path):
    config = SweepConfig(model="unused", draft_eagle3="e", draft_peagle="p", ks=(3, 5), concurrency=(1, 4),
                         datasets=("mtbench", "humaneval"), num_prompts=4, max_tokens=16)
    results, files = run_benchmark(config, tmp_path, "peagle bench --test", fake_open_runner(FakeClock(), 16))
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved == json.loads(json.dumps(results)) and len(saved["points"]) == 20
    assert saved["command"] == "peagle bench --test" and saved["config"]["ks"] == [3, 5]
    table = (tmp_path / "results.md").read_text()
    assert "### mtbench (4 requests per point)" in table and "P-EAGLE / EAGLE-3" in table
    assert {p.name for p in files["plots"]} == {"throughput_mtbench.png", "throughput_humaneval.png",
                                                "speedup_peagle_vs_eagle3.png", "acceptance_vs_k.png",
                                                "acceptance_by_position.png"}
    for plot in files["plots"]:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_config_refuses_bad_combinations():
    with pytest.raises(ValueError, match="--draft-peagle"):
        SweepConfig(model="m", methods=("peagle",))
    with pytest.raises(ValueError, match="--model DIR"):
        SweepConfig(methods=("none",))
    with pytest.raises(ValueError, match="unknown method"):
        SweepConfig(model="m", methods=("medusa",))
    with pytest.raises(ValueError, match="server fixes method and K"):
        SweepConfig(url="http://x", methods=("peagle",), ks=(3, 7))
    with pytest.raises(ValueError, match=r"unknown HF baseline\(s\) \['beam'\]"):
        SweepConfig(model="m", methods=("none",), hf_baselines=True, hf_methods=("eager", "beam"))
    assert SweepConfig(url="http://x", methods=("peagle",), ks=(7,)).groups() == [("peagle", 7, None)]
    config = SweepConfig(model="m", draft_eagle3="e", draft_peagle="p", ks=(3,), api_key="secret")
    assert config.speculative_config("eagle3", 3)["parallel_drafting"] is False
    assert config.speculative_config("peagle", 3) == {"method": "eagle3", "model": "p", "num_speculative_tokens": 3,
                                                       "parallel_drafting": True, "adaptive": {}}
    assert config.speculative_config("none", None) is None
    assert config.to_json()["api_key"] == "(set)"


def test_sweep_on_the_real_engine_with_random_heads(tiny_hf_checkpoint, tmp_path):
    pytest.importorskip("peagle.engine.llm_engine")
    from peagle.cli import main

    model = tiny_hf_checkpoint("llama")
    for method in ("eagle3", "peagle"):
        assert main(["drafter", "init", "--target", str(model), "--method", method, "--num-layers", "1",
                     "--out", str(tmp_path / method)]) == 0
    config = SweepConfig(model=str(model), draft_eagle3=str(tmp_path / "eagle3"), draft_peagle=str(tmp_path / "peagle"),
                         ks=(2,), concurrency=(2,), datasets=("mtbench",), num_prompts=2, max_tokens=4,
                         ignore_eos=True, dtype="float32", device="cpu", max_model_len=256)
    results, files = run_benchmark(config, tmp_path / "out", "peagle bench --test")
    points = {p["method"]: p for p in results["points"]}
    assert set(points) == {"none", "eagle3", "peagle"}
    for method, p in points.items():
        assert p["num_prompts"] == 2 and p["num_failed"] == 0 and p["output_tokens"] == 8, method
        assert p["ttft_p50_ms"] > 0 and p["tokens_per_s"] > 0
    assert points["none"]["acceptance_length"] is None
    for method in ("eagle3", "peagle"):
        assert 1.0 <= points[method]["acceptance_length"] <= 3.0
        assert len(points[method]["per_position_acceptance"]) == 2
    assert files["results"].is_file() and files["markdown"].is_file()


def test_adaptive_policy_reaches_the_speculative_config():
    from peagle.bench.cli import sweep_config_from_args
    from peagle.cli import build_parser
    from peagle.engine.config import SpeculativeConfig

    args = build_parser().parse_args(["bench", "--model", "m", "--draft-peagle", "p", "--methods", "peagle",
                                      "--k", "7", "--adaptive", "8:7,32:5,above:3"])
    config = sweep_config_from_args(args)
    # The adaptive row comes after the fixed one, at the largest K its policy verifies.
    assert [(m, k) for m, k, _ in config.groups()] == [("peagle", 7), ("peagle", 7)]
    method, k, policy = config.groups()[1]
    spec = SpeculativeConfig.from_dict(config.speculative_config(method, k, policy))
    assert [spec.adaptive.k_for(n, 7) for n in (1, 8, 9, 32, 33, 64)] == [7, 7, 5, 5, 3, 3]
    assert json.loads(json.dumps(config.to_json()))["adaptive"] == [[8, 7], [32, 5]]  # kept in results.json
    plain = sweep_config_from_args(build_parser().parse_args(["bench", "--model", "m", "--draft-peagle", "p",
                                                              "--methods", "peagle"]))
    assert plain.speculative_config("peagle", 7)["adaptive"] == {} and all(p is None for *_, p in plain.groups())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--model", "m", "--adaptive", "8-7"])
    with pytest.raises(ValueError, match="increasing"):
        SweepConfig(model="m", draft_peagle="p", methods=("peagle",), adaptive=((32, 5), (8, 7)))


def test_bench_command_line_builds_the_config():
    from peagle.bench.cli import sweep_config_from_args
    from peagle.cli import build_parser

    args = build_parser().parse_args([
        "bench", "--model", "m", "--draft-peagle", "p", "--methods", "none,peagle", "--k", "5,7",
        "--concurrency", "1,64", "--datasets", "humaneval,mine.jsonl", "--llm-option", "num_kv_blocks=512",
        "--llm-option", "load_format=dummy", "--note", "testbed v1", "--hf-baselines",
        "--hf-methods", "static_compile"])
    config = sweep_config_from_args(args)
    assert config.hf_baselines and config.hf_methods == ("static_compile",)
    assert config.methods == ("none", "peagle") and config.ks == (5, 7) and config.concurrency == (1, 64)
    assert config.datasets == ("humaneval", "mine.jsonl") and config.note == "testbed v1"
    assert config.llm_options == {"num_kv_blocks": 512, "load_format": "dummy"}
    assert config.groups() == [("none", None, None), ("peagle", 5, None), ("peagle", 7, None)]


def test_completions_encode_each_prompt_as_plain_text(tiny_hf_checkpoint):
    """--completions (a base model): prompts are continued as raw text with the tokenizer's own specials, HumanEval
    as its code alone; the flag reaches the config, its note and results.json; a server is refused (chat only)."""
    from peagle.bench.cli import sweep_config_from_args
    from peagle.bench.sweep import load_datasets, prompt_encoder
    from peagle.cli import build_parser
    from peagle.models.loader import load_tokenizer

    args = build_parser().parse_args(["bench", "--model", "m", "--methods", "none", "--completions",
                                      "--datasets", "humaneval", "--num-prompts", "2", "--concurrency", "1"])
    config = sweep_config_from_args(args)
    assert config.completions and config.to_json()["completions"] is True and "COMPLETIONS" in config.note
    (code,) = load_datasets(config).values()
    assert code[0].text.startswith("from typing import List") and "```" not in code[0].text
    tokenizer = load_tokenizer(tiny_hf_checkpoint("llama", num_layers=1))
    assert prompt_encoder(tokenizer, completions=True)(code[0]) == tokenizer.encode(code[0].text,
                                                                                  add_special_tokens=True)
    chat = Prompt.user("q", "What is 2 + 2?")
    assert prompt_encoder(tokenizer)(chat) == tokenizer.encode_chat(list(chat.messages))
    with pytest.raises(ValueError, match="--completions runs in process"):
        SweepConfig(url="http://x", methods=("none",), completions=True)


def test_min_waves_reuses_prompts_when_the_dataset_runs_out():
    config = SweepConfig(model="unused", methods=("none",), concurrency=(1, 4, 8), datasets=("mtbench",),
                         num_prompts=3, max_tokens=4, min_waves=3)
    seen = []

    def open_runner(method, k, policy=None):
        runner = fake_open_runner(FakeClock(), 4)(method, k)

        @contextlib.contextmanager
        def recording():
            with runner as r:
                real = r.measure

                def measure(ps, c, **options):
                    seen.append((c, [p.messages[0]["content"] for p in ps]))
                    return real(ps, c, **options)

                r.measure = measure
                yield r
        return recording()

    points = run_sweep(config, open_runner, ListSink(), {"mtbench": prompts(10)})
    # At least 3 waves: 3 at c=1, 12 at c=4, 24 at c=8; the 10 distinct prompts first, then again in order.
    assert [(p["concurrency"], p["num_prompts"]) for p in points] == [(1, 3), (4, 12), (8, 24)]
    texts = dict(seen)
    assert len(set(texts[4])) == 10 and texts[4][10:] == texts[4][:2]
    assert texts[8] == [texts[8][i % 10] for i in range(24)]
    with pytest.raises(ValueError, match="min_waves"):
        SweepConfig(model="unused", methods=("none",), min_waves=0)


def test_min_seconds_adds_whole_waves_of_the_same_prompts():
    clock = FakeClock()
    engine = FakeEngine(clock)
    m = runner(engine, clock, max_tokens=5).measure(prompts(4), 2, min_seconds=0.25)
    wave = 5 * (STEP_S + 2 * PER_SEQ_S)  # 0.06 s: five steps of two requests
    # 2 waves give 0.12 s, so waves are added while less than 0.25 s has passed: 5 waves, 10 requests.
    assert m.num_prompts == 10 and m.wall_s == pytest.approx(5 * wave)
    # warm-up covers the distinct prompts only: all at once, then staggered (2 + i mod 2 tokens)
    assert engine.params_seen == [2] * 4 + [2, 3, 2, 3] + [5] * 10


def test_warm_up_admits_prompts_beside_running_decodes():
    # The measurement admits a prompt whenever a request finishes, beside the others' decodes: a step whose graph
    # bucket the engine captures on first use. The warm-up's second pass staggers the lengths so that requests
    # finish a step apart and its steps admit beside decodes too, before anything is timed.
    clock = FakeClock()
    engine = FakeEngine(clock)
    beside: list[int] = []  # per request added: how many requests were running (decoding) then
    add = engine.add_request
    engine.add_request = lambda rid, ids, params: (beside.append(len(engine.running)), add(rid, ids, params))
    m = runner(engine, clock, max_tokens=16).measure(prompts(16), 4)
    assert m.num_prompts == 16 and m.output_tokens == 16 * 16
    first, staggered = beside[:16], beside[16:32]
    # all at once: each wave of 4 is admitted into an empty engine (3 of them beside the wave's own new prompts)
    assert first == [0, 1, 2, 3] * 4
    assert engine.params_seen[16:32] == [2 + i % 4 for i in range(16)]
    # staggered: after the first wave, prompts join running requests (the first pass's never do)
    assert staggered[:4] == [0, 1, 2, 3] and min(staggered[4:]) >= 2 and staggered[4:].count(3) >= 8
    # a concurrency-1 point has no decodes beside an admission: one warm-up pass only
    engine.params_seen.clear()
    runner(engine, clock, max_tokens=16).measure(prompts(3), 1)
    assert engine.params_seen == [2, 2, 2] + [16] * 3


def test_request_plan_cycles_prompts_in_whole_waves():
    from peagle.bench.measurement import RequestPlan

    clock = FakeClock()
    plan = RequestPlan(3, 3, 1.0, clock, clock())
    assert [plan.take() for _ in range(3)] == [0, 1, 2]
    assert [plan.take() for _ in range(3)] == [0, 1, 2]  # time left: another wave
    clock.t += 1.0
    assert plan.take() is None and RequestPlan(0, 1, 1.0, clock, clock()).take() is None
    # `exact`: another engine's point repeated request for request, whatever the time.
    exact = RequestPlan(3, 2, 100.0, clock, clock(), exact=5)
    assert [exact.take() for _ in range(6)] == [0, 1, 2, 0, 1, None]
    clock.t += 1000.0
    assert RequestPlan(3, 2, 0.0, clock, clock(), exact=4).take() == 0


def test_temperatures_make_tables_of_their_own(tmp_path):
    config = SweepConfig(model="unused", draft_peagle="p", methods=("none", "peagle"), ks=(3,), concurrency=(1, 2),
                         datasets=("mtbench",), num_prompts=2, max_tokens=6, temperatures=(0.0, 0.7))
    engines = []

    @contextlib.contextmanager
    def open_runner(method, k, policy=None):
        with fake_open_runner(FakeClock(), 6)(method, k, policy) as r:
            engines.append(r.engine)
            yield r

    results, files = run_benchmark(config, tmp_path, "peagle bench --test", open_runner)
    assert [(p["method"], p["temperature"], p["concurrency"]) for p in results["points"][:4]] == [
        ("none", 0.0, 1), ("none", 0.0, 2), ("none", 0.7, 1), ("none", 0.7, 2)]
    assert set(engines[0].temperatures_seen) == {0.0, 0.7}  # warm-up and measured requests alike
    table = (tmp_path / "results.md").read_text()
    assert table.index("## Greedy") < table.index("## Temperature 0.7 sampling")
    assert {p.name for p in files["plots"]} >= {"throughput_mtbench.png", "throughput_mtbench_t0.7.png"}
    assert "speedup_peagle_vs_none_t0.7" in summary_line(results, files)


def test_a_stalled_point_is_remeasured_with_the_same_engine(tmp_path):
    config = SweepConfig(model="unused", methods=("none",), concurrency=(1, 2, 4, 8), datasets=("mtbench",),
                         num_prompts=8, max_tokens=4)
    opened = []

    @contextlib.contextmanager
    def open_runner(method, k, policy=None):
        with fake_open_runner(FakeClock(), 4)(method, k, policy) as r:
            real, calls = r.measure, []

            def measure(ps, c, **options):
                calls.append(c)
                r.engine.extra_s = 0.05 if calls.count(4) == 1 and c == 4 else 0.0  # the first c=4 stalls
                return real(ps, c, **options)

            r.measure = measure
            opened.append(calls)
            yield r

    results, _ = run_benchmark(config, tmp_path, "peagle bench --test", open_runner)
    assert opened == [[1, 2, 4, 8, 4]]  # one engine; c=4 measured again at the end of its row
    by_c = {p["concurrency"]: p for p in results["points"]}
    assert by_c[4]["remeasured"]["tokens_per_s"] < 0.5 * by_c[4]["tokens_per_s"]
    assert all(p["flags"] == [] for p in results["points"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["points"][2]["remeasured"] == by_c[4]["remeasured"]  # the file has the second measurement
    assert "1 point(s) re-measured once, 0 still flagged" in (tmp_path / "results.md").read_text()


def test_calibrate_writes_the_policy_beside_the_head_and_measures_it(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    config = SweepConfig(model="unused", draft_peagle=str(head), methods=("none", "peagle"), ks=(3, 5),
                         concurrency=(1, 8, 64), datasets=("mtbench",), num_prompts=4, max_tokens=16,
                         calibrate=("peagle",))
    rows = []

    @contextlib.contextmanager
    def open_runner(method, k, policy=None):
        rows.append((method, k, policy))
        clock = FakeClock()
        # Acceptance saturates at 3 drafts; verification costs grow with K and the batch: K=3 wins alone, plain
        # decoding wins from 8 requests on.
        engine = FakeEngine(clock) if method == "none" else FakeEngine(clock, k=k, accepted=3, draft_s=0.002,
                                                                       verify_s=0.005)
        yield runner(engine, clock, 16)

    results, files = run_benchmark(config, tmp_path / "out", "peagle bench --calibrate", open_runner)
    policy = {"thresholds": [[2, 3]], "above": 0}
    assert rows[-1] == ("peagle", 3, policy)  # measured last, as a row of its own
    saved = json.loads((head / "adaptive.json").read_text())
    assert {k: saved[k] for k in ("thresholds", "above")} == policy
    assert [r["winner"] for r in saved["calibration"]["table"]] == [3, 0, 0]
    assert files["policies"] == {"peagle": head / "adaptive.json"}
    assert (tmp_path / "out" / "adaptive-peagle.json").is_file()
    adaptive = [p for p in results["points"] if p["adaptive"]]
    assert len(adaptive) == 3 and all(p["adaptive"] == policy and p["k"] == 3 for p in adaptive)
    assert "P-EAGLE adaptive (2:3,above:0) tok/s" in (tmp_path / "out" / "results.md").read_text()
    # A later run can measure the head's policy without deriving it again.
    again = SweepConfig(model="unused", draft_peagle=str(head), methods=("peagle",), ks=(3,), adaptive_head=True)
    assert again.groups()[-1] == ("peagle", 3, policy)
    with pytest.raises(ValueError, match="--calibrate compares K against no speculation"):
        SweepConfig(model="unused", draft_peagle=str(head), methods=("peagle",), calibrate=("peagle",))
    with pytest.raises(ValueError, match="is not a directory"):
        SweepConfig(model="unused", draft_peagle="dummy", methods=("none", "peagle"), calibrate=("peagle",))


def test_cutoff_rows_are_measured_beside_fixed_k_and_calibrated_with_it(tmp_path):
    from peagle.bench.cli import sweep_config_from_args
    from peagle.cli import build_parser

    head = tmp_path / "head"
    head.mkdir()
    args = build_parser().parse_args([
        "bench", "--model", "unused", "--draft-peagle", str(head), "--methods", "none,peagle", "--k", "5",
        "--concurrency", "1,8,64", "--datasets", "mtbench", "--num-prompts", "4", "--max-tokens", "16",
        "--draft-confidence-cutoff", "0.2,0.5", "--calibrate"])
    config = sweep_config_from_args(args)
    cut = {"thresholds": [], "above": 5, "cutoffs": []}
    assert config.groups() == [("none", None, None), ("peagle", 5, None),
                               ("peagle", 5, {**cut, "cutoff_above": 0.2}), ("peagle", 5, {**cut, "cutoff_above": 0.5})]
    rows = []

    @contextlib.contextmanager
    def open_runner(method, k, policy=None):
        rows.append((method, k, policy))
        clock = FakeClock()
        # A cutoff verifies fewer drafts (cheaper verification) and accepts as many: it wins where verification
        # costs most, from 8 requests on; the higher cutoff more.
        cutoff = (policy or {}).get("cutoff_above") or 0.0
        engine = FakeEngine(clock) if method == "none" else FakeEngine(clock, k=k, accepted=2, draft_s=0.001,
                                                                       verify_s=0.0005 * (1 - cutoff))
        yield runner(engine, clock, 16)

    results, _ = run_benchmark(config, tmp_path / "out", "peagle bench --calibrate", open_runner)
    saved = json.loads((head / "adaptive.json").read_text())
    table = saved["calibration"]["table"]
    assert [(r["winner"], r["cutoff"]) for r in table][1:] == [(5, 0.5), (5, 0.5)]
    assert saved["cutoff_above"] == 0.5 and rows[-1][2]["cutoff_above"] == 0.5  # measured as a row of its own
    assert [r[2] for r in rows[:4]] == [g[2] for g in config.groups()]  # the cutoff rows came before calibrating
    cut_points = [p for p in results["points"] if (p["adaptive"] or {}).get("cutoff_above") == 0.5]
    assert cut_points and all(p["verified_per_round"] is not None for p in cut_points)
    table_md = (tmp_path / "out" / "results.md").read_text()
    assert "P-EAGLE K=5 cutoff 0.5 tok/s" in table_md and "cutoff above" not in table_md  # a fixed K, named so
    assert "| P-EAGLE K=5 cutoff 0.5 |" in table_md and "cutoff 0.5 K=5" not in table_md  # its K said once
    with pytest.raises(ValueError, match="cutoffs in"):
        SweepConfig(model="m", draft_peagle="p", methods=("peagle",), cutoffs=(0.0,))


def test_an_in_process_row_runs_with_the_engine_frozen_out_of_the_collector(tiny_hf_checkpoint):
    """While a row's engine serves, its objects are out of the cyclic collector's walks (as in `peagle serve`'s engine
    process, so that in-process and served rows pay alike); after the row they are back, so that freeing the engine
    frees its cycles too."""
    import gc

    from peagle.bench.sweep import open_engine_runner

    config = SweepConfig(model=str(tiny_hf_checkpoint("llama", num_layers=2)), methods=("none",), concurrency=(1,),
                         dtype="float32", device="cpu", max_model_len=128)
    with open_engine_runner(config, "none", None) as runner:
        assert runner.engine is not None
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
