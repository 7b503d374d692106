"""vLLM beside peagle: the sweep's engine rows (no speculation, EAGLE-3 and P-EAGLE at each K) measured again by
vLLM's `LLM` on the same prompt token ids, concurrencies, temperatures and max tokens, so that peagle's lead over
vLLM is measured in the run that claims it.

Each row runs in a child process of its own, `python -m peagle.bench.vllm_baseline REQUEST RESULT`, in a process
group of its own: vLLM's CUDA context, compiled graphs, KV cache and engine-core process end with it, and the bench's
process never imports vLLM. The child measures the row with the sweep's own `measure_row` and `EngineRunner`, driving
vLLM's `LLMEngine` (add_request / step) through a thin adapter, so a point's requests, warm-up, timing and hygiene
re-measurement are exactly those of peagle's rows. A speculative row runs twice: once with vLLM's statistics off
(`LLM`'s default), which gives its speed, then once with them on, which gives its acceptance from vLLM's spec-decode
counters (vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens, _num_accepted_tokens_per_pos; read as
tests/interop/vllm_generate.py reads them) as their change over each point's timed requests: statistics cost vLLM
time on every step, so a pass that reads them would understate its speed. That pass's own rates are kept in
results["vllm"]["rows"][i]["acceptance"]["tokens_per_s"].

Mirrored from the sweep: model, tokenizer, dtype, max_model_len, max_num_seqs (the largest concurrency),
gpu_memory_utilization, enforce_eager, load_format, the seed, prefix caching (off, as in peagle's LLM, unless
--llm-option enable_prefix_caching=true: the warm-up requests would otherwise leave every measured prompt cached in
vLLM alone), synthetic acceptance (vLLM's synthetic rejection sampler takes the same unconditional per-position
rates), and per request temperature, max_tokens and ignore_eos; any other sampling option is refused by name. Each
engine keeps its own scheduling (chunked prefill, async scheduling, CUDA graph sizes); `vllm_options` adds LLM(...)
keywords. Adaptive rows have no vLLM counterpart.

A vLLM point is the sweep's point with `method` vllm_none | vllm_eagle3 | vllm_peagle, `"engine": "vllm"` and
`"vllm_version"`; results["vllm"] keeps, per row, vLLM's arguments, its start-up seconds and, for a row vLLM
refused, its error (and the same of its acceptance pass under "acceptance"). Each pass's log and result are in
OUT/vllm/ (ROW.log, ROW.acceptance.log).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from peagle.bench.engine_runner import EngineRunner
from peagle.bench.measurement import SpecCounts

logger = logging.getLogger(__name__)

VLLM_PREFIX = "vllm_"  # a vLLM point's method: vllm_none, vllm_eagle3, vllm_peagle
STAGING = ("install it (pip install vllm) or, on the GPU machine, stage vllm==0.25.0 from its wheels (docs/DEVICE.md, "
           "'vLLM beside peagle': scripts/device/stage_local.sh vllm here, then the vllm_part and vllm_stage stages)")
SAMPLING_OPTIONS = ("ignore_eos",)  # a request's SamplingParams from the sweep, beside temperature and max_tokens
STATS_OPTION = "disable_log_stats"  # set by the rows per pass: off to time vLLM, on to read its counters
# A speed point's fields that come from the acceptance pass (the rest are the speed pass's own).
ACCEPTANCE_KEYS = ("acceptance_length", "per_position_acceptance", "draft_acceptance_rate", "verified_per_round",
                   "accepted_per_round", "verified_per_accepted")
PROBE_TIMEOUT_S = 300  # importing vLLM (and torch) on a cold disk
GRACE_S = 30.0  # for a child and its engine core to end on SIGINT before SIGKILL
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # vllm:spec_decode_* -> SpecCounts' fields
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


# ---- the bench's side ------------------------------------------------------------------------------------------

def check_sampling(options: dict[str, Any]) -> None:
    """ValueError naming each sampling option the vLLM rows cannot reproduce."""
    unknown = sorted(set(options) - set(SAMPLING_OPTIONS))
    if unknown:
        raise ValueError(f"--vllm-baselines cannot reproduce the sampling option(s) {', '.join(unknown)} in vLLM "
                         f"(it mirrors temperature, max_tokens and {', '.join(SAMPLING_OPTIONS)})")


def check_options(options: dict[str, Any]) -> None:
    """ValueError for a --vllm-option that would stop the rows from being measured as peagle's are."""
    if STATS_OPTION in options:
        raise ValueError(f"--vllm-option {STATS_OPTION}={json.dumps(options[STATS_OPTION])}: the vLLM rows set it "
                         "themselves, true for the pass that times vLLM (LLM's default) and false for the pass that "
                         "reads its spec-decode counters")


def speculative_config(config, method: str, k: int | None) -> dict[str, Any] | None:
    """vLLM's speculative_config for a row: the head as peagle serves it (EAGLE-3 asked for explicitly, P-EAGLE with
    parallel_drafting), and with synthetic acceptance vLLM's synthetic rejection sampler at the same rates."""
    if method == "none":
        return None
    spec = {"method": "eagle3", "model": config.draft(method), "num_speculative_tokens": k,
            "parallel_drafting": method == "peagle"}
    if config.synthetic_acceptance is not None:
        spec.update(rejection_sample_method="synthetic",
                    synthetic_acceptance_rates=list(config.synthetic_acceptance[:k]))
    return spec


def llm_arguments(config, method: str, k: int | None, stats: bool = False) -> dict[str, Any]:
    """LLM(...) keywords of a row's pass, from the sweep's settings (module docstring: what is mirrored); `stats`:
    vLLM's statistics on (the acceptance pass)."""
    args: dict[str, Any] = {
        "model": config.model, "dtype": config.dtype, "max_num_seqs": max(config.concurrency),
        "gpu_memory_utilization": config.gpu_memory_utilization, "enforce_eager": config.enforce_eager,
        "enable_prefix_caching": bool(config.llm_options.get("enable_prefix_caching", False)),
        "seed": config.llm_options.get("seed", 0),
    }
    optional = {"max_model_len": config.max_model_len, "tokenizer": config.tokenizer,
                "speculative_config": speculative_config(config, method, k),
                "load_format": None if config.load_format == "auto" else config.load_format}
    args.update({key: value for key, value in optional.items() if value is not None})
    return {**args, **config.vllm_options, STATS_OPTION: not stats}


def vllm_rows(config) -> list[tuple[str, int | None]]:
    """The (method, K) rows vLLM measures: the sweep's fixed-K rows."""
    return [(method, k) for method, k, policy in config.groups() if policy is None]


def child_environment(config) -> dict[str, str]:
    """The child's environment: config.vllm_path first on its PYTHONPATH, then peagle's source tree (when peagle runs
    from one: a site-packages directory would bring another environment's packages along), then the caller's."""
    import peagle

    paths = list(config.vllm_path)
    root = Path(peagle.__file__).resolve().parents[1]
    if root.name not in ("site-packages", "dist-packages"):
        paths.append(str(root))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def vllm_python(config) -> str:
    return config.vllm_python or sys.executable


def vllm_version(config) -> str:
    """The version of the vLLM the rows will run, checked before anything is measured; ValueError naming
    --vllm-baselines, and how to get vLLM, when it cannot be imported."""
    marker = "PEAGLE_VLLM_VERSION="
    cmd = [vllm_python(config), "-c", f"import vllm; print({marker!r} + vllm.__version__)"]
    try:
        done = subprocess.run(cmd, env=child_environment(config), capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    else:
        found = [line[len(marker):] for line in done.stdout.splitlines() if line.startswith(marker)]
        if done.returncode == 0 and found:
            return found[-1].strip()
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    path = f" with {os.pathsep.join(config.vllm_path)} first on its path" if config.vllm_path else ""
    raise ValueError(f"--vllm-baselines: {cmd[0]}{path} cannot import vllm ({why}); {STAGING}")


def row_name(method: str, k: int | None) -> str:
    return method if k is None else f"{method}-k{k}"


def run_vllm_baselines(config, prompts: dict[str, list], token_ids: dict[str, list[int]], writer,
                       version: str) -> list[dict]:
    """Every fixed-K row of the sweep measured by vLLM, one child process a row, into `writer` (a ResultsWriter);
    `token_ids`: prompt id -> the ids peagle's rows were given. A row vLLM refuses is logged and recorded in
    results["vllm"]["rows"], and the next row runs. Returns the points."""
    out = writer.out_dir / "vllm"
    out.mkdir(parents=True, exist_ok=True)
    record = {"version": version, "python": vllm_python(config), "path": list(config.vllm_path), "rows": []}
    writer.results["vllm"] = record
    points: list[dict] = []
    for method, k in vllm_rows(config):
        name = row_name(method, k)
        row = {"method": method, "k": k, "llm": llm_arguments(config, method, k), "log": f"vllm/{name}.log"}
        record["rows"].append(row)
        speed: list[dict] = []

        def keep_speed(got: list[dict]) -> None:
            speed.extend(got)
            for p in got:
                writer.add(p)
            writer.flush()

        run_row(config, method, k, prompts, token_ids, out, row, name, keep_speed, stats=False)
        if method != "none" and speed:
            acceptance = row["acceptance"] = {"llm": llm_arguments(config, method, k, stats=True),
                                              "log": f"vllm/{name}.acceptance.log"}

            def keep_counted(got: list[dict]) -> None:
                acceptance["tokens_per_s"] = join_acceptance(speed, got)
                writer.flush()

            run_row(config, method, k, prompts, token_ids, out, acceptance, f"{name}.acceptance", keep_counted,
                    stats=True, requests=peagle_requests(writer.results["points"], method, k))
        points += speed
    writer.flush()  # the rows' errors, set once their children have ended
    return points


def point_key(point: dict) -> str:
    return f"{point['dataset']}/t{float(point['temperature'])}/c{point['concurrency']}"


def parse_point_key(key: str) -> tuple[str, float, int]:
    dataset, temperature, concurrency = key.rsplit("/", 2)
    return dataset, float(temperature[1:]), int(concurrency[1:])


def peagle_requests(points: list[dict], method: str, k: int | None) -> dict[str, int]:
    """Request counts of peagle's own points of a row (fixed K), by point key."""
    return {point_key(p): p["num_prompts"] for p in points
            if p["method"] == method and p.get("k") == k and not p.get("engine") and not p.get("adaptive")
            and p.get("num_prompts")}


def join_acceptance(speed: list[dict], counted: list[dict]) -> dict[str, float]:
    """The acceptance pass's counts into the speed pass's points (in place), point by point; returns the
    acceptance pass's own rates by point (vLLM with its statistics on)."""
    by_key = {point_key(p): p for p in counted}
    for p in speed:
        if point_key(p) in by_key:
            p.update({key: by_key[point_key(p)].get(key) for key in ACCEPTANCE_KEYS})
    return {key: p["tokens_per_s"] for key, p in by_key.items()}


def run_row(config, method: str, k: int | None, prompts: dict[str, list], token_ids: dict[str, list[int]], out: Path,
            row: dict, name: str, keep: Callable[[list[dict]], None], stats: bool,
            requests: dict[str, int] | None = None) -> None:
    """One pass of a row in its child process, named NAME in OUT: its points, as far as it got, go to `keep` (also
    when interrupted); its start-up seconds, point count, duration and error to `row`. `requests`: by point key,
    how many requests each point runs (peagle's counts), instead of the time rule."""
    request_path, result_path = out / f"{name}.request.json", out / f"{name}.json"
    request = {"method": method, "k": k, "llm": row["llm"], "stats": stats, "requests": requests or {},
               "sampling": {"ignore_eos": config.ignore_eos},
               "grid": grid_of(config),
               "prompts": {dataset: [{**p.to_json(), "token_ids": token_ids[p.id]} for p in ps]
                           for dataset, ps in prompts.items()}}
    request_path.write_text(json.dumps(request))
    logger.info("vLLM %s K=%s%s: a child process, log in %s", method, k, ", counting acceptance" if stats else "",
                out / f"{name}.log")
    start = time.perf_counter()
    with open(out / f"{name}.log", "wb") as log:
        child = subprocess.Popen([vllm_python(config), "-m", "peagle.bench.vllm_baseline", str(request_path),
                                  str(result_path)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=child_environment(config), start_new_session=True)
        try:
            status = child.wait()
        finally:
            end_group(child)
            row["seconds"] = round(time.perf_counter() - start, 1)
            request_path.unlink(missing_ok=True)  # the prompts' token ids, large for long prompts
            keep(take_result(result_path, row, out / f"{name}.log"))
    if status and not row.get("error"):
        row["error"] = f"the child exited with status {status}"
    if row.get("error"):
        logger.warning("vLLM %s K=%s: %s (log: %s)", method, k, row["error"], out / f"{name}.log")


def grid_of(config) -> dict[str, Any]:
    """The settings of the sweep that `measure_row` reads, for the child's SweepConfig."""
    return {"concurrency": list(config.concurrency), "temperatures": list(config.temperatures),
            "num_prompts": config.num_prompts, "min_waves": config.min_waves, "min_seconds": config.min_seconds,
            "max_tokens": config.max_tokens, "remeasure": config.remeasure,
            "hygiene": dataclasses.asdict(config.hygiene)}


def take_result(result_path: Path, row: dict, log: Path) -> list[dict]:
    """The child's points, as vLLM points; its start-up time and error into `row`."""
    try:
        result = json.loads(result_path.read_text())
    except (OSError, json.JSONDecodeError):
        row["error"] = f"no result from the child; the end of its log: {log_tail(log)}"
        return []
    row.update(startup_s=result.get("startup_s"), points=len(result["points"]))
    if result.get("error"):
        row["error"] = result["error"]
    return [vllm_point(p, result.get("vllm_version")) for p in result["points"]]


def vllm_point(point: dict, version: str | None) -> dict:
    return {**point, "method": VLLM_PREFIX + point["method"], "engine": "vllm", "vllm_version": version}


def log_tail(log: Path, lines: int = 3) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(no log)"


def end_group(child: subprocess.Popen) -> None:
    """The child and whatever it started (vLLM's engine-core process) ended: SIGINT, then SIGKILL after GRACE_S."""
    for sig, grace_s in ((signal.SIGINT, GRACE_S), (signal.SIGKILL, 5.0)):
        if not group_alive(child):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        deadline = time.monotonic() + grace_s
        while group_alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)


def group_alive(child: subprocess.Popen) -> bool:
    child.poll()  # reaps the child itself once it has exited
    try:
        os.killpg(child.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- the child's side ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class StepOutput:
    """What EngineRunner reads of a step's output, from one of vLLM's RequestOutputs (delta output kind)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    error: str | None = None
    metrics: Any = None  # vLLM keeps no per-request acceptance: the runner reads its counters


class VllmEngine:
    """vLLM's LLMEngine behind the engine interface EngineRunner drives (peagle.bench.engine_runner)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any) -> None:
        self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, sampling_params)

    def step(self) -> list[StepOutput]:
        return [StepOutput(o.request_id, list(o.outputs[0].token_ids) if o.outputs else [], o.finished)
                for o in self.engine.step()]

    def abort_request(self, request_id: str) -> None:
        self.engine.abort_request([request_id])

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()


def spec_counts(llm: Any) -> SpecCounts:
    """vLLM's spec-decode counters since it started (zeros without speculation)."""
    metrics: dict[str, Any] = {}
    for m in llm.get_metrics():
        metrics.setdefault(m.name, []).append(m)
    values = [sum(int(getattr(m, "value", 0)) for m in metrics.get(f"vllm:spec_decode_{name}", []))
              for name in COUNTERS]
    per_position: list[int] = []
    for m in metrics.get(PER_POSITION, []):  # one vector per engine; summed position by position
        per_position = [a + b for a, b in zip_longest_zero(per_position, list(m.values))]
    counts = SpecCounts()
    counts.add(*values, per_position)  # vLLM verifies every draft
    return counts


def zip_longest_zero(a: Sequence[int], b: Sequence[int]) -> Iterator[tuple[int, int]]:
    for i in range(max(len(a), len(b))):
        yield (a[i] if i < len(a) else 0), (b[i] if i < len(b) else 0)


def counts_since(now: SpecCounts, before: SpecCounts) -> SpecCounts:
    counts = SpecCounts()
    counts.add(now.rounds - before.rounds, now.drafted - before.drafted, now.accepted - before.accepted,
               [a - b for a, b in zip_longest_zero(now.accepted_per_position, before.accepted_per_position)])
    return counts


class VllmRunner(EngineRunner):
    """EngineRunner over vLLM. With `counters` (vLLM's statistics on) the counters are read at the end of every drive
    (a warm-up's or the point's), so the point's acceptance is their change over its timed requests (nothing runs
    between a warm-up and the point), and only the one read that ends the point falls inside its timed seconds;
    without, no acceptance (the speed pass)."""

    def __init__(self, llm: Any, token_ids: dict[str, list[int]], params, max_tokens: int, counters: bool = True,
                 requests: dict[tuple, int] | None = None):
        super().__init__(VllmEngine(llm.llm_engine), lambda p: token_ids[p.id], params, max_tokens)
        self.llm = llm
        self.counters = counters
        self.requests = requests or {}  # (prompt ids, concurrency, temperature) -> peagle's point's request count
        self._counts = spec_counts(llm) if counters else SpecCounts()

    def measure(self, prompts, concurrency, *, temperature=0.0, min_seconds=0.0, requests=None):
        """A point; with peagle's request count for it (the acceptance pass) exactly its requests, in its order."""
        if requests is None:
            requests = self.requests.get((tuple(p.id for p in prompts), concurrency, float(temperature)))
        return super().measure(prompts, concurrency, temperature=temperature, min_seconds=min_seconds,
                               requests=requests)

    def _drive(self, token_ids, concurrency, params, min_seconds, requests=None):
        traces, _ = super()._drive(token_ids, concurrency, params, min_seconds, requests)
        if not self.counters:
            return traces, None
        before, self._counts = self._counts, spec_counts(self.llm)
        return traces, counts_since(self._counts, before)


class ResultFile:
    """The child's result, rewritten whole as it grows (a Sink for measure_row): the parent reads what a killed
    child got to."""

    def __init__(self, path: Path):
        self.path = path
        self.result: dict[str, Any] = {"vllm_version": None, "startup_s": None, "points": [], "error": None}
        self.flush()

    def update(self, **fields: Any) -> None:
        self.result.update(fields)
        self.flush()

    def add(self, point: dict) -> None:
        self.result["points"].append(point)
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        os.replace(tmp, self.path)


def measure_in_child(request: dict, result: ResultFile) -> None:
    """The row of REQUEST measured by vLLM into RESULT, as the sweep measures peagle's rows."""
    from tqdm import tqdm

    from peagle.bench.hygiene import HygieneRules
    from peagle.bench.sweep import SweepConfig, measure_row, point_prompts
    from peagle.datasets import Prompt

    check_sampling(request["sampling"])
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    result.update(vllm_version=vllm.__version__)
    grid = request["grid"]
    config = SweepConfig(model=request["llm"]["model"], methods=("none",), concurrency=tuple(grid["concurrency"]),
                         temperatures=tuple(grid["temperatures"]), num_prompts=grid["num_prompts"],
                         min_waves=grid["min_waves"], min_seconds=grid["min_seconds"], max_tokens=grid["max_tokens"],
                         remeasure=grid["remeasure"], hygiene=HygieneRules(**grid["hygiene"]))
    prompts = {dataset: [Prompt(p["id"], tuple(p["messages"])) for p in ps]
               for dataset, ps in request["prompts"].items()}
    token_ids = {p["id"]: p["token_ids"] for ps in request["prompts"].values() for p in ps}
    sampling = request["sampling"]

    def params(temperature: float, max_tokens: int):
        return SamplingParams(temperature=temperature, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA,
                              **sampling)

    # The acceptance pass repeats peagle's points request for request: its acceptance is then over the same requests.
    same_requests = {}
    for key, n in request.get("requests", {}).items():
        dataset, temperature, c = parse_point_key(key)
        if dataset in prompts:
            ids = tuple(p.id for p in point_prompts(prompts[dataset], config.num_prompts, c, config.min_waves))
            same_requests[(ids, c, temperature)] = n

    @contextlib.contextmanager
    def open_runner(method, k, policy=None):
        start = time.perf_counter()
        llm = LLM(**request["llm"])
        result.update(startup_s=round(time.perf_counter() - start, 2))
        yield VllmRunner(llm, token_ids, params, config.max_tokens, counters=request.get("stats", True),
                         requests=same_requests)

    measure_row(config, open_runner, (request["method"], request["k"], None), prompts, result, tqdm(disable=True))


def main(argv: list[str]) -> int:
    # A parent started under nohup or as a background job hands its children SIGINT ignored; end_group's SIGINT
    # must still end this child gracefully (its result file written), not after GRACE_S by SIGKILL.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    request = json.loads(Path(argv[0]).read_text())
    result = ResultFile(Path(argv[1]))
    try:
        measure_in_child(request, result)
    except BaseException as e:  # the parent reads why from the result; the traceback goes to the log
        result.update(error=f"{type(e).__name__}: {e}".strip())
        raise
    return 0


if __name__ == "__main__":  # vLLM may start its engine core by spawning, which imports this file again
    sys.exit(main(sys.argv[1:]))
