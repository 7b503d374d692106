"""Per-round time breakdown of the engine on the GPU: target verify, drafting, everything else.

Usage: python scripts/device/engine_timing.py TARGET_DIR OUT.json --head eagle3=DIR --head peagle=DIR
       [--methods none,peagle] [--variants sync,async,gemv,async+gemv,prefill-graphs] [--stall N] [--arrivals]
       [--ttft-prompts 16]
For each method, engine variant and batch size (1 and 64) it runs real requests to a steady decode state, then times
- the whole round (engine.step wall time, median over N rounds),
- the whole round's GPU work (the greedy round's CUDA graph replayed alone, timed with CUDA events), and inside it
  the target's verify forward and the drafting pass (their own graphs); verification = the remainder,
- the host-side input building (perf_counter),
and reports "other" = round wall time - the round's GPU time: what the host adds.
With --profile DIR, 10 more rounds per method and batch run under torch.profiler and their operator table (CPU and
CUDA time) is written to DIR/profile-METHOD-kK-bB.txt: where "other" goes.

Variants (one engine each, timed side by side per method): `sync` is the engine without async scheduling (the
default); `async` schedules the next
step while the GPU runs the current one (async_scheduling: "other" then is the host time the GPU waits for, and
`ahead_share` the rounds launched before the previous answer arrived); `gemv` runs the target's linear layers at
<= 8 rows through the split-K GEMV kernel (decode_gemv: it changes the GPU columns); `async+gemv` both;
`chunked` prefills in chunks of what the decodes leave of 512 tokens per step (enable_chunked_prefill);
`async+chunked` both; `prefill-graphs` replays CUDA graphs for steps that prefill too (prefill_cuda_graphs),
`async+prefill-graphs` with async scheduling (the engine's defaults), `async+prefill-graphs+gemv` and the GEMV
(decode_gemv: since run 8 with each decoder norm and the MLP's activation inside the GEMVs). Any variant may end in
`+fused-merge`: the paged attention's KV splits merged by their last arrival inside the attention kernel, one launch
instead of two per layer (EngineConfig.fused_merge, on by default since run 17; without the
modifier the variant runs with it off, as with admit-ahead), and in
`+coarse-buckets`: general steps' graphs padded to powers of two of tokens, the ladder before run 14
(peagle.engine.cuda_graph.TOKEN_BUCKET_STEPS = 1; four buckets per doubling from 128 tokens since), and in
`+admit-ahead`: with async scheduling, a step that admits waiting prompts launched before the answer in flight
arrives (EngineConfig.admit_ahead, on by default since run 14; without the modifier the variant runs
with it off, so rows mean the same in every run), and in `+mixed-tiles`: the attention of a step that prefills beside
decodes in two launches, short requests in small tiles and long ones listed by a tile map
(EngineConfig.mixed_tiles, on by default since run 16; without the modifier the variant runs with
it off, as with admit-ahead), and in `+pdl`: the decode path's Triton
kernels launched with programmatic dependent launch, each starting while the one before finishes
(peagle.kernels.pdl.ENABLED, off by default: no gain on the default path in run 16; Hopper and newer), and in
`+gemv-wide` (with a `gemv` variant): the GEMV reads a short reduction's (K < 1,024) whole weight slice as one
16 x 1,024 tile, all of it before PDL's wait (peagle.kernels.gemv.SHORT_K_TILING; 16 x 256 otherwise).
Each variant first times the time to first token at concurrency 1 (`ttft_p50_ms`, median over --ttft-prompts MT-Bench
first turns: from add_request to the step that returns the token). Prefill graphs are captured on a shape's first
use, so the prompts run twice: the first pass is reported as `ttft_cold_p50_ms`, the second is the measurement.
With --stall N, each variant also times the stall a new N-token prompt causes: 8 requests decode, the prompt
arrives, and `stall_max_ms` is the longest step until its first token, against `stall_decode_ms`, a decode step's
median before it arrived (without chunking, one step prefills the whole prompt); `stall_ratio` is their ratio. The
scenario runs twice and the second is reported (`stall_cold_max_ms`: the first, graph captures included).
With --arrivals, each variant also runs a closed loop at concurrency 8 (a new MT-Bench request, 64 tokens, as each
finishes; 48 requests, twice, the second reported) and reports the inter-token latencies of all requests,
`itl_p50_ms` and `itl_p99_ms` (the time between consecutive steps that return tokens to a request).
With --closed-loop C:T, closed loops of C requests answering T tokens (a new MT-Bench request as each finishes, 3
waves, twice, the second reported), the sweep's high-concurrency points without its harness: output tokens/s, and
the steps that admit a request (prefill its prompt) against the others, by count, median time and share of the wall
time (run 12's sweep at 64: a P-EAGLE round cost 2.3-2.4x a plain step, 1.6x in the steady state above). An admitting
step's median is split into the host's wait for the answer of the step before (`admit_wait_ms_p50`: the async
pipeline drained), its launch (`admit_launch_ms_p50`: scheduling aside, building and enqueueing the step) and the GPU
span of that launch (`admit_gpu_ms_p50`, CUDA events: the mixed step's own GPU time, host gaps inside it included).
--profile-loop DIR profiles a third pass of each closed loop: the kernels an admitting step launches against another
step's, per step (what makes a step that prefills a prompt among 64 decodes cost twice a decode round).
--loop-jitter F draws each request's answer length from T x [1 - F, 1 + F] (seeded): requests then finish apart, as
answers that end at EOS do, and plain decoding admits one request at a time too.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from peagle import LLM, SamplingParams
from peagle.engine import cuda_graph, llm_engine
from peagle.engine.model_runner import StepHandle
from peagle.datasets import load_prompts
from peagle.models.loader import load_tokenizer

paged_attention_module = importlib.import_module("peagle.kernels.paged_attention")  # the package shadows the name
try:  # trees before programmatic dependent launch lack it (`+pdl` is refused there)
    pdl = importlib.import_module("peagle.kernels.pdl")
except ImportError:
    pdl = None
TOKEN_BUCKET_STEPS = getattr(cuda_graph, "TOKEN_BUCKET_STEPS", 1)  # 1 in trees before run 14
try:  # trees before the GEMV's tiling choice lack it (`+gemv-wide` is refused there)
    gemv_module = importlib.import_module("peagle.kernels.gemv")
    SHORT_K_TILING = gemv_module.SHORT_K_TILING
except (ImportError, AttributeError):
    gemv_module = SHORT_K_TILING = None
WIDE_TILING = (16, 1024)  # `+gemv-wide`: a short reduction's whole weight slice in one tile (K <= 1,024)
MODIFIERS = ("fused-merge", "coarse-buckets", "admit-ahead", "mixed-tiles", "pdl", "gemv-wide")
# The modifiers that are engine options (EngineConfig): modifier -> LLM keyword
ENGINE_SWITCHES = {"fused-merge": "fused_merge", "mixed-tiles": "mixed_tiles", "admit-ahead": "admit_ahead"}


def split_variant(variant: str) -> tuple[str, set[str]]:
    """A variant's engine options' name and its module switches (+fused-merge, +coarse-buckets, +admit-ahead,
    +mixed-tiles, +pdl, +gemv-wide, in any order)."""
    mods = set()
    while any(variant.endswith("+" + m) for m in MODIFIERS):
        m = next(m for m in MODIFIERS if variant.endswith("+" + m))
        variant = variant.removesuffix("+" + m)
        mods.add(m)
    return variant, mods


def split_cutoff(variant: str) -> tuple[str, float | None]:
    """A variant without its "+cutoff=C" (the draft confidence cutoff its speculative engines run with), and C."""
    rest, sep, cutoff = variant.partition("+cutoff=")
    if not sep:
        return variant, None
    try:
        value = float(cutoff)
    except ValueError:
        raise SystemExit(f"{variant}: +cutoff=C needs a number C in [0, 1]") from None
    return rest, value


def engine_switches(mods: set[str]) -> dict[str, bool]:
    """The LLM options of a variant's modifiers, each off without its modifier. A tree from before they were options
    (an earlier tree timed beside this one) reads them as module switches: set there, and no options returned."""
    options = {option: mod in mods for mod, option in ENGINE_SWITCHES.items()}
    if "admit_ahead" in inspect.signature(LLM).parameters:
        return options
    paged_attention_module.FUSED_MERGE = options["fused_merge"]
    paged_attention_module.MIXED_TILES = options["mixed_tiles"]  # harmless in trees without it
    llm_engine.ADMIT_AHEAD = options["admit_ahead"]  # harmless in trees without it
    return {}

CONFIGS = {"none": ("none", None, 0, False), "peagle": ("peagle", "peagle", 7, True),
           "peagle-k3": ("peagle", "peagle", 3, True),
           "eagle3-k3": ("eagle3", "eagle3", 3, False), "eagle3-k7": ("eagle3", "eagle3", 7, False)}
# Each variant names every engine option it times (the engine's defaults move: async scheduling and prefill graphs
# are on by default since runs 6 and 7), so a row means the same in every run.
_OFF = {"async_scheduling": False, "decode_gemv": False, "enable_chunked_prefill": False, "prefill_cuda_graphs": False}
_CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 512}
VARIANTS = {name: {**_OFF, **options} for name, options in {
    "sync": {}, "async": {"async_scheduling": True},
    "gemv": {"decode_gemv": True}, "async+gemv": {"async_scheduling": True, "decode_gemv": True},
    "chunked": _CHUNKED, "async+chunked": {"async_scheduling": True, **_CHUNKED},
    "prefill-graphs": {"prefill_cuda_graphs": True},
    "async+prefill-graphs": {"async_scheduling": True, "prefill_cuda_graphs": True},
    "async+chunked+prefill-graphs": {"async_scheduling": True, "prefill_cuda_graphs": True, **_CHUNKED},
    "async+prefill-graphs+gemv": {"async_scheduling": True, "prefill_cuda_graphs": True, "decode_gemv": True},
}.items()}


def gpu_ms(fn, iters=50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def profile_rounds(eng, path, rounds: int = 10) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            eng.step()
    averages = prof.key_averages()
    host = averages.table(sort_by="cpu_time_total", row_limit=50, max_name_column_width=70)
    device = averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70)
    with open(path, "w") as f:
        f.write(f"torch.profiler over {rounds} engine rounds, sorted by CPU time total\n\n{host}\n\n"
                f"the same rounds, sorted by the kernels' own GPU time (what a round's GPU time is made of)\n\n"
                f"{device}\n")


def measure(llm, prompts, batch: int, k: int, rounds: int = 40, profile_path=None) -> dict:
    eng = llm.engine
    for i in range(batch):
        eng.add_request(f"t{batch}-{i}", prompts[i % len(prompts)],
                        SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True))
    while eng.scheduler.num_waiting or any(s.num_computed_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    times, tokens, build, launches = [], 0, [], []
    runner = eng.runner

    def timed(name):  # host-side input building: from the sequences, or (async) beside the step in flight
        real = getattr(runner, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = real(*a, **kw)
            build.append(time.perf_counter() - t)
            launches.append(name)
            return out

        setattr(runner, name, wrapper)

    timed("build_inputs")
    timed("build_next_inputs")
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t0)
        tokens += sum(len(o.new_token_ids) for o in outs)
    graphs = runner.graphs
    bucket = graphs.bucket_for(batch)
    g = {kind: graphs.graphs[(kind, bucket, k)][0] for kind in ("greedy", "target", "draft")
         if (kind, bucket, k) in graphs.graphs}
    row = {"batch": batch, "k": k, "round_ms": 1e3 * statistics.median(times),
           "tokens_per_round": tokens / rounds, "output_tokens_per_s": tokens / sum(times),
           "gpu_round_ms": gpu_ms(g["greedy"].replay), "target_ms": gpu_ms(g["target"].replay),
           "draft_ms": gpu_ms(g["draft"].replay) if "draft" in g else 0.0}
    row["verify_ms"] = max(0.0, row["gpu_round_ms"] - row["target_ms"] - row["draft_ms"])
    del runner.build_inputs, runner.build_next_inputs  # the methods again
    row["host_build_ms"] = 1e3 * statistics.median(build)
    row["ahead_share"] = launches.count("build_next_inputs") / len(launches)
    if profile_path is not None:
        profile_rounds(eng, profile_path)
    seqs = list(eng.scheduler.running)
    row["other_ms"] = row["round_ms"] - row["gpu_round_ms"]
    row["other_share"] = row["other_ms"] / row["round_ms"]
    for s in seqs:
        eng.abort_request(s.seq_id)
    return row


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def first_token_s(eng, request_id: str, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    eng.add_request(request_id, prompt, params)
    while not any(o.request_id == request_id and o.new_token_ids for o in eng.step()):
        pass
    return time.perf_counter() - t0


def measure_ttft(llm, prompts, n: int) -> dict:
    """Time to first token at concurrency 1; the first pass captures the prefill graphs' shapes (see the docstring)."""
    eng = llm.engine
    passes = []
    for p in range(2):
        passes.append([first_token_s(eng, f"ttft{p}-{i}", prompt) for i, prompt in enumerate(prompts[:n])])
        while eng.has_unfinished_requests():
            eng.step()
    cold, warm = passes
    return {"ttft_prompts": len(warm), "ttft_prompt_tokens_p50": statistics.median(len(p) for p in prompts[:n]),
            "ttft_p50_ms": 1e3 * statistics.median(warm), "ttft_p90_ms": 1e3 * percentile(warm, 0.9),
            "ttft_cold_p50_ms": 1e3 * statistics.median(cold)}


def closed_loop(eng, prompts, tag: str, batch: int, num_requests: int, max_tokens: int, jitter: float = 0.0):
    """A closed loop of `batch` requests of `max_tokens` answer tokens (each drawn from max_tokens x [1 - jitter,
    1 + jitter], seeded by its index), a new one added as each finishes; yields each step's (end time, seconds,
    whether it admitted a request (prefilled a prompt), outputs)."""
    added = 0
    while added < num_requests or eng.has_unfinished_requests():
        while added < num_requests and eng.scheduler.num_running + eng.scheduler.num_waiting < batch:
            n = max(1, round(max_tokens * random.Random(added).uniform(1 - jitter, 1 + jitter)))
            eng.add_request(f"{tag}-{added}", prompts[added % len(prompts)],
                            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            added += 1
        admits = eng.scheduler.num_waiting > 0 or any(s.num_computed_tokens == 0 for s in eng.scheduler.running)
        t0 = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        yield now, now - t0, admits, outs


def closed_loop_itl(eng, prompts, tag: str, batch: int, num_requests: int, max_tokens: int) -> list[float]:
    """Inter-token latencies of a closed loop (the time between consecutive steps that return tokens to a request)."""
    last: dict[str, float] = {}
    gaps = []
    for now, _, _, outs in closed_loop(eng, prompts, tag, batch, num_requests, max_tokens):
        for o in outs:
            if o.new_token_ids and o.request_id in last:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
    return gaps


def measure_arrivals(llm, prompts, batch: int = 8, num_requests: int = 48, max_tokens: int = 64) -> dict:
    eng = llm.engine
    cold = closed_loop_itl(eng, prompts, "arrivals0", batch, num_requests, max_tokens)
    warm = closed_loop_itl(eng, prompts, "arrivals1", batch, num_requests, max_tokens)
    return {"batch": batch, "arrivals": num_requests, "itl_p50_ms": 1e3 * statistics.median(warm),
            "itl_p99_ms": 1e3 * percentile(warm, 0.99), "itl_cold_p99_ms": 1e3 * percentile(cold, 0.99)}


class StepParts:
    """Times one engine step's parts: the host's waits for answers (StepHandle.result) and the model runner's
    launches (host time, and their GPU span between CUDA events), by patching them for the loop's duration. The
    launches: `launch`, and `launch_admit_next` where the tree has it (admit-ahead: a step that admits prompts is
    launched inside the engine step that finds them waiting, before the answer in flight arrives, so its launch is
    timed in that step, as an admitting step's launch is without admit-ahead)."""

    LAUNCHES = ("launch", "launch_admit_next")

    def __init__(self, eng):
        self.runner, self.wait, self.launch, self.events = eng.runner, 0.0, 0.0, []
        self._result = StepHandle.result
        self._launches = {name: getattr(eng.runner, name) for name in self.LAUNCHES if hasattr(eng.runner, name)}

    def __enter__(self):
        parts, result = self, self._result

        def timed_result(handle):
            t0 = time.perf_counter()
            try:
                return result(handle)
            finally:
                parts.wait += time.perf_counter() - t0

        def timed(launch):
            def timed_launch(*args, **kwargs):
                cuda = parts.runner.device.type == "cuda"
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                try:
                    return launch(*args, **kwargs)
                finally:
                    parts.launch += time.perf_counter() - t0
                    if cuda:
                        end.record()
                        parts.events.append((start, end))
            return timed_launch

        StepHandle.result = timed_result
        for name, launch in self._launches.items():
            setattr(self.runner, name, timed(launch))
        return self

    def __exit__(self, *exc):
        StepHandle.result = self._result
        for name in self._launches:
            delattr(self.runner, name)  # the instance attribute; the class's method shows again

    def take(self) -> tuple[float, float, list]:
        """This step's (wait seconds, launch seconds, launch events) so far; the counters start again."""
        out, (self.wait, self.launch, self.events) = (self.wait, self.launch, self.events), (0.0, 0.0, [])
        return out


def closed_loop_steps(eng, prompts, tag: str, batch: int, num_requests: int, max_tokens: int,
                      jitter: float = 0.0) -> dict:
    """A closed loop's output tokens/s, and its steps split into those that admit a request and the rest; an
    admitting step's time split into waiting for the answer before, launching, and the launch's GPU span."""
    admit, pure, waits, launches, spans, tokens = [], [], [], [], [], 0
    began = time.perf_counter()
    with StepParts(eng) as parts:
        for _, seconds, admits, outs in closed_loop(eng, prompts, tag, batch, num_requests, max_tokens, jitter):
            wait, launch, events = parts.take()
            (admit if admits else pure).append(seconds)
            if admits:
                waits.append(wait)
                launches.append(launch)
                spans.append(events)
            tokens += sum(len(o.new_token_ids) for o in outs)
    wall = time.perf_counter() - began
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    gpu = [sum(s.elapsed_time(e) for s, e in events) for events in spans if events]
    p50 = lambda xs, scale=1e3: scale * statistics.median(xs) if xs else 0.0  # noqa: E731
    return {"output_tokens_per_s": tokens / wall, "steps": len(admit) + len(pure), "admit_steps": len(admit),
            "admit_step_ms_p50": p50(admit), "pure_step_ms_p50": p50(pure), "admit_time_share": sum(admit) / wall,
            "admit_wait_ms_p50": p50(waits), "admit_launch_ms_p50": p50(launches), "admit_gpu_ms_p50": p50(gpu, 1)}


def measure_closed_loop(llm, prompts, batch: int, max_tokens: int, jitter: float = 0.0,
                        profile_path: str | None = None) -> dict:
    """The closed loop twice (the first captures graphs), the second reported; 3 waves of `batch` requests. With
    `profile_path`, a third pass under the profiler (`profile_closed_loop`), its medians added to the row."""
    eng = llm.engine
    for tag in ("loop0", "loop1"):
        row = closed_loop_steps(eng, prompts, f"{tag}-{batch}-{max_tokens}", batch, 3 * batch, max_tokens, jitter)
    if profile_path is not None:
        row.update(profile_closed_loop(eng, prompts, f"loop2-{batch}-{max_tokens}", batch, max_tokens, jitter,
                                       profile_path))
    return {"loop_batch": batch, "loop_max_tokens": max_tokens, "loop_jitter": jitter, **row}


def _step_kernels(event) -> list:
    """The device kernels launched inside a profiler range: its own and its descendants' (name, duration us)."""
    found, todo = [], [event]
    while todo:
        e = todo.pop()
        found += [(k.name, k.duration) for k in e.kernels]
        todo += e.cpu_children
    return found


def profile_closed_loop(eng, prompts, tag: str, batch: int, max_tokens: int, jitter: float, path: str,
                        steps: int = 40) -> dict:
    """One more pass of the closed loop with `steps` engine steps after its first wave under torch.profiler, each
    step in a range of its own ("peagle step N admit" or "... pure", admit as `closed_loop` counts it). A step's
    kernels are those launched inside it, i.e. the GPU work of the round it launches: an admitting step launches the
    mixed step that prefills the new prompts (after the answer before, or ahead of it with admit-ahead). Writes a
    table to `path` (per step kind: the median host time, kernel count and summed kernel time per step, and each
    kernel's mean time per step) and the Chrome trace beside it (`path`.trace.json.gz); returns the medians."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    real_step, count, kinds = eng.step, 0, {}

    def step():
        nonlocal count
        i, count = count, count + 1
        if i == batch:
            prof.start()
        if not batch <= i < batch + steps:
            return real_step()
        sched = eng.scheduler
        kind = "admit" if sched.num_waiting > 0 or any(s.num_computed_tokens == 0 for s in sched.running) else "pure"
        kinds[i] = kind
        try:
            with record_function(f"peagle step {i} {kind}"):
                return real_step()
        finally:
            if i == batch + steps - 1:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                prof.stop()

    eng.step = step
    try:
        for _ in closed_loop(eng, prompts, tag, batch, 3 * batch, max_tokens, jitter):
            pass
    finally:
        del eng.step  # the instance attribute; the class's method shows again
        if prof.profiler is not None and count < batch + steps:  # the loop ended inside the window
            prof.stop()
    per_kind: dict[str, list] = {"admit": [], "pure": []}
    for e in prof.events():
        if e.name.startswith("peagle step "):
            kernels = _step_kernels(e)
            per_kind[e.name.rsplit(" ", 1)[1]].append((e.cpu_time_total / 1e3, kernels))
    out, lines = {}, [f"torch.profiler over {sum(map(len, per_kind.values()))} engine steps of a closed loop of "
                      f"{batch} requests (answers of {max_tokens} tokens, jitter {jitter}), after its first wave\n"]
    for kind, rows in per_kind.items():
        p50 = (lambda xs: statistics.median(xs) if xs else 0.0)  # noqa: E731
        host = p50([r[0] for r in rows])
        count_k = p50([len(r[1]) for r in rows])
        gpu = p50([sum(d for _, d in r[1]) / 1e3 for r in rows])
        out.update({f"profiled_{kind}_steps": len(rows), f"profiled_{kind}_host_ms_p50": host,
                    f"profiled_{kind}_kernels_p50": count_k, f"profiled_{kind}_kernel_ms_p50": gpu})
        lines.append(f"{kind} steps: {len(rows)}; per step (medians): host {host:.3f} ms, {count_k:.0f} kernels, "
                     f"kernel time {gpu:.3f} ms")
        totals: dict[str, list] = {}
        for _, kernels in rows:
            for name, d in kernels:
                totals.setdefault(name, []).append(d)
        ranked = sorted(totals.items(), key=lambda kv: -sum(kv[1]))
        lines.append(f"  {'mean us per step':>16} {'calls per step':>14}  kernel")
        for name, ds in ranked[:30]:
            lines.append(f"  {sum(ds) / max(1, len(rows)):16.1f} {len(ds) / max(1, len(rows)):14.1f}  {name[:110]}")
        lines.append("")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines))
    trace = f"{path}.trace.json"
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    Path(trace).unlink()
    return out


def measure_stall(llm, prompts, prompt_len: int) -> dict:
    cold, warm = (stall_once(llm, prompts, prompt_len, tag) for tag in ("s0", "s1"))
    return {**warm, "stall_cold_max_ms": cold["stall_max_ms"]}


def stall_once(llm, prompts, prompt_len: int, tag: str, batch: int = 8, rounds: int = 20) -> dict:
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"{tag}-{i}", prompts[i % len(prompts)], params)
    while eng.scheduler.num_waiting or any(s.num_computed_tokens == 0 for s in eng.scheduler.running):
        eng.step()
    before = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        eng.step()
        before.append(time.perf_counter() - t0)
    long_prompt = [t for p in prompts for t in p][:prompt_len]
    seq = eng.add_request(f"{tag}-long", long_prompt, params)
    during = []
    while seq.num_output_tokens == 0:
        t0 = time.perf_counter()
        eng.step()
        during.append(time.perf_counter() - t0)
    for s in list(eng.scheduler.running):
        eng.abort_request(s.seq_id)
    while eng.has_unfinished_requests():  # the aborted requests leave the engine
        eng.step()
    decode_ms, max_ms = 1e3 * statistics.median(before), 1e3 * max(during)
    return {"batch": batch, "stall_prompt_tokens": len(long_prompt), "stall_decode_ms": decode_ms,
            "stall_max_ms": max_ms, "stall_ratio": max_ms / decode_ms, "stall_steps": len(during),
            "stall_ttft_ms": 1e3 * sum(during)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--head", action="append", default=[], help="METHOD=DIR (eagle3 or peagle)")
    ap.add_argument("--batches", default="1,64",
                    help="batch sizes of the steady-state round timing (default 1,64; '' for none: loops only)")
    ap.add_argument("--methods", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)} (those with a --head)")
    ap.add_argument("--variants", default="sync", help=f"engine variants timed side by side: {', '.join(VARIANTS)}; "
                    "each may end in +fused-merge (the attention's KV splits merged inside its kernel) and "
                    "+coarse-buckets (general graphs padded to powers of two of tokens, the ladder before run 14) and "
                    "+admit-ahead (a step that admits prompts launched before the answer in flight) and "
                    "+mixed-tiles (a mixed step's short and long requests tiled apart in its attention) and "
                    "+pdl (the Triton kernels launched with programmatic dependent launch); a last "
                    "+cutoff=C runs the speculative methods with draft confidence cutoff C (e.g. "
                    "async+prefill-graphs+cutoff=0.1)")
    ap.add_argument("--stall", type=int, metavar="N", help="also time the stall a new N-token prompt causes")
    ap.add_argument("--arrivals", action="store_true", help="also time inter-token latencies as requests arrive")
    ap.add_argument("--ttft-prompts", type=int, default=16, metavar="N",
                    help="MT-Bench first turns for the time to first token at concurrency 1 (default 16; 0: skip)")
    ap.add_argument("--profile", metavar="DIR", help="also write a torch.profiler table per method and batch here")
    ap.add_argument("--closed-loop", default="", metavar="C:T,...",
                    help="also run closed loops of C requests answering T tokens each (e.g. 64:128,64:256; MT-Bench "
                         "prompts, 3 waves): tokens/s, and the steps that admit a request against the rest")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="dummy: random weights from TARGET's config.json (a --head may then be 'dummy': a random head)")
    ap.add_argument("--synthetic-acceptance", metavar="R1,R2,...",
                    help="with --load-format dummy: accept draft position i with rate Ri (accepted at i / rounds) "
                         "instead of asking the target, so rounds carry a trained head's tokens and requests finish "
                         "apart as with one (the decode round then verifies eagerly between its graphs)")
    ap.add_argument("--profile-loop", metavar="DIR",
                    help="closed loops: a third pass with 40 steps after its first wave under torch.profiler; per "
                         "method and variant a table of the kernels each admitting step and each other step launches "
                         "(DIR/loop-METHOD-kK-VARIANT-cC-tT.txt, + written _) and the Chrome trace beside it "
                         "(.trace.json.gz)")
    ap.add_argument("--loop-jitter", type=float, default=0.0, metavar="F",
                    help="closed loops: each answer's length drawn from T x [1 - F, 1 + F] (0 <= F < 1; default 0)")
    ap.add_argument("--loop-dataset", default="mtbench", metavar="NAME",
                    help="closed loops: the prompts' data set (a name `peagle bench --datasets` takes, e.g. longcode "
                         "for prompts of thousands of tokens; those that do not fit --max-model-len beside twice T "
                         "tokens are left out; default mtbench)")
    ap.add_argument("--max-model-len", type=int, default=4096, metavar="N",
                    help="the engines' max_model_len (default 4096; 8192 for --loop-dataset longcode)")
    args = ap.parse_args(argv)
    if not 0 <= args.loop_jitter < 1:
        ap.error(f"--loop-jitter {args.loop_jitter}: expected 0 <= F < 1")
    rates = None
    if args.synthetic_acceptance:
        try:
            rates = tuple(float(r) for r in args.synthetic_acceptance.split(","))
        except ValueError:
            ap.error(f"--synthetic-acceptance {args.synthetic_acceptance!r}: expected comma-separated rates")
        if args.load_format != "dummy":
            ap.error("--synthetic-acceptance is for random weights only: add --load-format dummy")
    loops = []
    for item in filter(None, args.closed_loop.split(",")):
        c, sep, t = item.partition(":")
        if not (sep and c.isdigit() and t.isdigit() and int(c) > 0 and int(t) > 0):
            ap.error(f"--closed-loop {item!r}: expected CONCURRENCY:TOKENS, two positive integers")
        loops.append((int(c), int(t)))
    loop_data = None
    if loops and args.loop_dataset != "mtbench":
        try:
            loop_data = load_prompts(args.loop_dataset)
        except ValueError as e:
            ap.error(f"--loop-dataset {args.loop_dataset!r}: {e}")
    heads = dict(h.split("=", 1) for h in args.head)
    tok = load_tokenizer(args.target)
    prompts = [tok.encode_chat(p.messages) for p in load_prompts("mtbench")]
    loop_prompts = prompts
    if loop_data is not None:  # those that fit beside twice the longest answer
        room = args.max_model_len - 2 * max(t for _, t in loops)
        loop_prompts = [ids for ids in (tok.encode_chat(p.messages) for p in loop_data) if len(ids) <= room]
        if not loop_prompts:
            ap.error(f"--loop-dataset {args.loop_dataset!r}: no prompt fits --max-model-len {args.max_model_len} "
                     "beside its answer")
    unknown = [v for v in args.variants.split(",") if split_variant(split_cutoff(v)[0])[0] not in VARIANTS]
    unknown += [m for m in args.methods.split(",") if m not in CONFIGS]
    if unknown:
        ap.error(f"unknown method(s) or variant(s) {unknown}")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    rows = []

    def keep(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)

    for name, head, k, parallel in (CONFIGS[m] for m in args.methods.split(",")):
        if head is not None and head not in heads:
            continue
        spec = None if head is None else {"method": "eagle3", "model": heads[head], "num_speculative_tokens": k,
                                          "parallel_drafting": parallel}
        for variant in args.variants.split(","):
            # each off without its modifier: engine options "+fused-merge" (the paged attention's KV splits merged
            # inside its kernel), "+mixed-tiles" and "+admit-ahead" (async scheduling launches a step that admits
            # prompts before the answer in flight); module switches "+coarse-buckets" (general graphs padded to
            # powers of two, as before run 14), "+pdl" and "+gemv-wide"
            rest, cutoff = split_cutoff(variant)
            base, mods = split_variant(rest)
            switches = engine_switches(mods)
            if cutoff is not None and head is not None:  # a cutoff cuts drafts: the speculative methods only
                switches["draft_confidence_cutoff"] = cutoff
            cuda_graph.TOKEN_BUCKET_STEPS = 1 if "coarse-buckets" in mods else TOKEN_BUCKET_STEPS
            if pdl is not None:
                pdl.ENABLED = "pdl" in mods
            elif "pdl" in mods:
                raise SystemExit(f"{variant}: this tree has no programmatic dependent launch (peagle.kernels.pdl)")
            if gemv_module is not None:
                gemv_module.SHORT_K_TILING = WIDE_TILING if "gemv-wide" in mods else SHORT_K_TILING
            elif "gemv-wide" in mods:
                raise SystemExit(f"{variant}: this tree's GEMV has no tiling choice (peagle.kernels.gemv.choose_tiling)")
            synthetic = None if head is None or not args.synthetic_acceptance else rates
            llm = LLM(model=args.target, speculative_config=spec, dtype="bfloat16", max_model_len=args.max_model_len,
                      max_num_seqs=64, load_format=args.load_format, synthetic_acceptance=synthetic, **VARIANTS[base],
                      **switches)
            if args.ttft_prompts:
                keep({"method": name, "variant": variant, "k": k, **measure_ttft(llm, prompts, args.ttft_prompts)})
            for b in map(int, filter(None, args.batches.split(","))):
                tag = "" if variant == "sync" else "-" + variant.replace("+", "_").replace("=", "")
                path = f"{args.profile}/profile-{name}-k{k}-b{b}{tag}.txt" if args.profile else None
                row = {"method": name, "variant": variant, **measure(llm, prompts, b, k, profile_path=path)}
                keep(row)
            if args.stall:
                keep({"method": name, "variant": variant, "k": k, **measure_stall(llm, prompts, args.stall)})
            if args.arrivals:
                keep({"method": name, "variant": variant, "k": k, **measure_arrivals(llm, prompts)})
            for c, t in loops:
                path = (f"{args.profile_loop}/loop-{name}-k{k}-{variant.replace('+', '_')}-c{c}-t{t}.txt"
                        if args.profile_loop else None)
                keep({"method": name, "variant": variant, "k": k, "loop_dataset": args.loop_dataset,
                      **measure_closed_loop(llm, loop_prompts, c, t, args.loop_jitter, profile_path=path)})
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print_table(rows)
    return 0


def print_table(rows) -> None:
    cols = ("method", "variant", "batch", "k", "round_ms", "gpu_round_ms", "target_ms", "host_build_ms", "other_ms",
            "other_share", "ahead_share", "output_tokens_per_s")
    print(" | ".join(cols))
    for row in (r for r in rows if "round_ms" in r):
        print(" | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols))
    for key, cols in (("ttft_p50_ms", ("method", "variant", "ttft_prompts", "ttft_prompt_tokens_p50", "ttft_p50_ms",
                                       "ttft_p90_ms", "ttft_cold_p50_ms")),
                      ("stall_max_ms", ("method", "variant", "stall_prompt_tokens", "stall_decode_ms", "stall_max_ms",
                                        "stall_ratio", "stall_steps", "stall_ttft_ms", "stall_cold_max_ms")),
                      ("itl_p99_ms", ("method", "variant", "batch", "itl_p50_ms", "itl_p99_ms", "itl_cold_p99_ms")),
                      ("loop_batch", ("method", "variant", "loop_batch", "loop_max_tokens", "output_tokens_per_s",
                                      "steps", "admit_steps", "admit_step_ms_p50", "pure_step_ms_p50",
                                      "admit_time_share"))):
        selected = [r for r in rows if key in r]
        if selected:
            print(" | ".join(cols))
            for row in selected:
                print(" | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols))


if __name__ == "__main__":
    sys.exit(main())
