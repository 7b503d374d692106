"""The benchmark sweep: methods x K x temperatures x datasets x concurrency, in process or against a server.

In process, one LLM is built per row ((method, K), "none" has no K, or an adaptive policy) and measured at every
temperature, dataset and concurrency before the next is built; against a server (`url`), the server's own method
and K are measured and the labels given here only name them in the results. Every point runs at least `min_waves`
waves of its concurrency and at least `min_seconds`; when a row is done, its points that look wrong next to their
neighbours (peagle.bench.hygiene) are re-measured once with the same engine. With `calibrate`, the fixed-K rows
decide each head's adaptive policy (peagle.bench.calibration), which is written beside the head and measured as a
row of its own. With `vllm_baselines`, vLLM's LLM then measures each fixed-K row again on the same prompt token ids, a
child process a row (peagle.bench.vllm_baseline). Hugging Face baselines run last, greedy, on the same prompts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence

from tqdm import tqdm

from peagle.bench.calibration import RULE, derive_policy, write_policy
from peagle.datasets import Prompt, load_prompts
from peagle.bench.hf_baseline import HF_METHODS
from peagle.bench.hygiene import HygieneRules, settle
from peagle.bench.measurement import Measurement
from peagle.bench.report import ENGINE_METHODS, ResultsWriter, make_point, markdown
from peagle.bench.vllm_baseline import run_vllm_baselines, vllm_version
from peagle.drafters.policy import POLICY_FILE, policy_path, policy_text, read_policy

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepConfig:
    model: str | None = None  # target checkpoint directory (in process; also the HF baselines' model)
    url: str | None = None  # an OpenAI-compatible server instead of the in-process engine
    draft_eagle3: str | None = None
    draft_peagle: str | None = None
    methods: tuple[str, ...] = ENGINE_METHODS
    ks: tuple[int, ...] = (3, 5, 7, 11)
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    datasets: tuple[str, ...] = ("mtbench", "humaneval")
    num_prompts: int = 80
    min_waves: int = 1  # at least this many waves of `concurrency` requests per point
    min_seconds: float = 0.0  # and at least this long: further waves of the same prompts until it has passed
    temperatures: tuple[float, ...] = (0.0,)  # 0 = greedy; each other one is a sampled table of its own
    max_tokens: int = 256
    ignore_eos: bool = False
    cache_dir: str | None = None  # testbed cache holding ShareGPT (for the sharegpt dataset)
    # A base model's prompts: each one text continued as it is (HumanEval as its code alone), no chat template.
    completions: bool = False
    # In-process engine options, passed to LLM(...); `llm_options` carries any further keyword (extension point).
    dtype: str = "bfloat16"
    device: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    llm_options: dict[str, Any] = field(default_factory=dict)
    # Server options.
    served_model: str | None = None
    api_key: str | None = None
    # Client processes sharing each point's concurrency (peagle.bench.http_runner): "auto" or a number.
    client_processes: int | str = "auto"
    # Hugging Face transformers baselines on the first `hf_num_prompts` prompts (at least `batch` of them).
    hf_baselines: bool = False
    hf_num_prompts: int = 8
    hf_batch_sizes: tuple[int, ...] = (1, 16, 64)
    # which of them (peagle.bench.hf_baseline.HF_METHODS): eager (at hf_batch_sizes), prompt_lookup, static_compile
    hf_methods: tuple[str, ...] = HF_METHODS
    # vLLM's LLM on the same rows and prompts (peagle.bench.vllm_baseline), a child process a row: run by
    # `vllm_python` (default: this interpreter) with `vllm_path` first on its PYTHONPATH; `vllm_options`: further
    # LLM(...) keywords.
    vllm_baselines: bool = False
    vllm_python: str | None = None
    vllm_path: tuple[str, ...] = ()
    vllm_options: dict[str, Any] = field(default_factory=dict)
    # Shown above the results table and kept in results.json (e.g. "smoke scale: not a benchmark").
    note: str | None = None
    # Real-size runs without weights: random weights from config.json, prompts tokenized with another tokenizer,
    # and (benchmarking only) drafts accepted with fixed per-position rates instead of by the target.
    tokenizer: str | None = None
    load_format: str = "auto"
    synthetic_acceptance: tuple[float, ...] | None = None
    # Adaptive rows, one per speculative method: this policy ((running-request bound, K), ...) and K above the last
    # bound; `adaptive_head`: the adaptive.json of each head that has one; `calibrate`: for these methods, derive
    # the head's policy from the fixed-K rows (no speculation as K = 0), write it beside the head and measure it.
    adaptive: tuple[tuple[int, int], ...] = ()
    adaptive_above: int | None = None
    adaptive_head: bool = False
    calibrate: tuple[str, ...] = ()
    # Draft confidence cutoffs: each speculative method and K is also measured with each cutoff (a row whose policy
    # is that K and that cutoff at every load); --calibrate then picks K and cutoff per concurrency.
    cutoffs: tuple[float, ...] = ()
    # Hygiene: a point far off its neighbours, or stalled, is re-measured once (remeasure=False: only flagged).
    hygiene: HygieneRules = field(default_factory=HygieneRules)
    remeasure: bool = True

    def __post_init__(self):
        from peagle.engine.config import AdaptivePolicy

        AdaptivePolicy(thresholds=self.adaptive, above=self.adaptive_above)  # raises on a bad policy
        unknown = sorted(set(self.methods) - set(ENGINE_METHODS))
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown}; --methods takes a comma list of {ENGINE_METHODS}")
        if not self.model and not self.url:
            raise ValueError("give --model DIR (in-process engine) or --url URL (a running server)")
        if self.client_processes != "auto" and (not isinstance(self.client_processes, int)
                                                or self.client_processes < 1):
            raise ValueError(f"client_processes must be 'auto' or an integer >= 1, got {self.client_processes!r}")
        for name in ("ks", "concurrency", "hf_batch_sizes"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty list of positive integers, got {values}")
        if self.num_prompts < 1 or self.max_tokens < 1 or self.hf_num_prompts < 1 or self.min_waves < 1:
            raise ValueError("num_prompts, min_waves, max_tokens and hf_num_prompts must be >= 1")
        if self.min_seconds < 0 or not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError("min_seconds must be >= 0 and temperatures a non-empty list of numbers >= 0")
        if (self.has_policy or self.adaptive_head or self.calibrate) and self.url:
            raise ValueError("adaptive rows and --calibrate run in process: the server fixes its own policy")
        if self.calibrate and ("none" not in self.methods or not set(self.calibrate) <= set(self.methods)
                               or "none" in self.calibrate):
            raise ValueError("--calibrate compares K against no speculation: give --methods none and the "
                             f"eagle3/peagle methods to calibrate (got methods {self.methods}, calibrate "
                             f"{self.calibrate})")
        for method in self.calibrate:
            if not Path(str(self.draft(method))).is_dir():
                raise ValueError(f"--calibrate writes {POLICY_FILE} beside the {method} head: "
                                 f"{self.draft(method)} is not a directory")
        if any(not 0.0 < c <= 1.0 for c in self.cutoffs):
            raise ValueError(f"--draft-confidence-cutoff takes cutoffs in (0, 1] (the fixed-K rows are cutoff 0), got "
                             f"{self.cutoffs}")
        if self.cutoffs and self.url:
            raise ValueError("--draft-confidence-cutoff rows run in process: against --url the server fixes its own "
                             "(peagle serve --draft-confidence-cutoff)")
        if self.calibrate and self.adaptive_head:
            raise ValueError("--calibrate already measures the policy it writes beside the head: drop --adaptive head")
        if self.synthetic_acceptance is not None:
            if self.load_format != "dummy":
                raise ValueError("--synthetic-acceptance is for random-weight benchmarks only: add --load-format dummy")
            if len(self.synthetic_acceptance) < max(self.ks):
                raise ValueError(f"--synthetic-acceptance needs a rate for each of the {max(self.ks)} draft positions")
        hf_unknown = sorted(set(self.hf_methods) - set(HF_METHODS))
        if hf_unknown or not self.hf_methods:
            raise ValueError(f"unknown HF baseline(s) {hf_unknown}; --hf-methods takes a comma list of "
                             f"{', '.join(HF_METHODS)}")
        if self.load_format == "dummy" and self.hf_baselines:
            raise ValueError("the Hugging Face baselines need real weights: drop --hf-baselines with --load-format dummy")
        if not self.datasets:
            raise ValueError("give at least one dataset")
        if self.vllm_baselines:
            self._check_vllm()
        if self.url:
            if self.completions:
                raise ValueError("--completions runs in process (the HTTP runner sends chat requests): give --model")
            speculative = [m for m in self.methods if m != "none"]
            if len(self.methods) != 1 or (len(self.ks) > 1 and speculative):
                raise ValueError("against --url the server fixes method and K: give one --methods label "
                                 "(and one --k for eagle3/peagle) describing how the server was started")
            if self.hf_baselines and not self.model:
                raise ValueError("--hf-baselines needs --model DIR (the checkpoint the server runs)")
            return
        for method, draft in (("eagle3", self.draft_eagle3), ("peagle", self.draft_peagle)):
            if method in self.methods and not draft:
                raise ValueError(f"method {method} needs --draft-{method} DIR (a drafter checkpoint)")

    def _check_vllm(self) -> None:
        """The settings the vLLM rows cannot reproduce, refused by name (peagle.bench.vllm_baseline)."""
        from peagle.bench.vllm_baseline import check_options

        if self.url:
            raise ValueError("--vllm-baselines runs vLLM beside the in-process engine, on the same GPU: drop --url")
        for method in self.speculative_methods:
            if self.draft(method) == "dummy":
                raise ValueError(f"--vllm-baselines: vLLM loads its heads from directories; --draft-{method} dummy "
                                 "has none")
        rates = self.synthetic_acceptance or ()
        if any(b > a for a, b in zip(rates, rates[1:])):
            raise ValueError("--vllm-baselines: vLLM's synthetic rejection sampler takes non-increasing per-position "
                             f"rates; --synthetic-acceptance {','.join(f'{r:g}' for r in rates)} rises")
        check_options(self.vllm_options)

    @property
    def has_policy(self) -> bool:
        return bool(self.adaptive) or self.adaptive_above is not None

    @property
    def speculative_methods(self) -> list[str]:
        return [m for m in self.methods if m != "none"]

    def draft(self, method: str) -> str | None:
        return self.draft_peagle if method == "peagle" else self.draft_eagle3

    def groups(self) -> list[tuple[str, int | None, dict | None]]:
        """(method, K, adaptive policy) rows, one engine each: the fixed-K rows (K None for no speculation), then
        the adaptive rows known before the run (the calibrated ones come after the fixed rows are measured)."""
        rows: list[tuple[str, int | None, dict | None]] = [
            (m, None, None) if m == "none" else (m, k, None)
            for m in self.methods for k in (self.ks if m != "none" else [None])]
        rows += [(m, k, cutoff_policy(k, c)) for m in self.speculative_methods for k in self.ks for c in self.cutoffs]
        if self.has_policy:
            policy = {"thresholds": [list(t) for t in self.adaptive], "above": self.adaptive_above}
            rows += [(m, self.policy_k(policy), policy) for m in self.speculative_methods]
        if self.adaptive_head:
            paths = {m: policy_path(self.draft(m)) for m in self.speculative_methods}
            if not any(path.is_file() for path in paths.values()):
                raise ValueError(f"--adaptive head: none of {sorted(map(str, paths.values()))} exists (write one "
                                 "with peagle bench --calibrate)")
            for m, path in paths.items():
                if path.is_file():
                    policy = read_policy(path)
                    rows.append((m, self.policy_k(policy), policy))
        return rows

    def policy_k(self, policy: dict) -> int:
        """The engine K of an adaptive row: the largest K its policy verifies (the largest swept K for 'above:max')."""
        ks = [k for _, k in policy["thresholds"]] + [max(self.ks) if policy["above"] is None else policy["above"]]
        return max(ks) or max(self.ks)

    def speculative_config(self, method: str, k: int | None, policy: dict | None = None) -> dict[str, Any] | None:
        if method == "none":
            return None
        # EAGLE-3 is asked for explicitly (parallel_drafting False) so that a P-EAGLE head is never upgraded, and a
        # fixed-K row gives an empty policy so that a head's calibrated default (adaptive.json) stays out of it.
        return {"method": "eagle3", "model": self.draft(method), "num_speculative_tokens": k,
                "parallel_drafting": method == "peagle", "adaptive": policy or {}}

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["api_key"]:
            d["api_key"] = "(set)"  # never write a secret into a results file
        return d


class Runner(Protocol):
    def measure(self, prompts: Sequence[Prompt], concurrency: int, *, temperature: float = 0.0,
                min_seconds: float = 0.0) -> Measurement: ...


class Sink(Protocol):
    """Where points go as they are measured (ResultsWriter): `add` a new one, `flush` after points changed."""

    def add(self, point: dict) -> None: ...

    def flush(self) -> None: ...


OpenRunner = Callable[[str, int | None, dict | None], ContextManager[Runner]]  # row -> a runner, released on exit
OnPolicy = Callable[[str, dict, list[dict]], None]  # (method, calibrated policy, per-concurrency table)


def cutoff_policy(k: int, cutoff: float) -> dict:
    """A `--draft-confidence-cutoff` row's policy: K drafts and the cutoff at every load."""
    return {"thresholds": [], "above": k, "cutoffs": [], "cutoff_above": cutoff}


def is_cutoff_policy(policy: dict) -> bool:
    """Whether an adaptive row's policy is a `cutoff_policy` (one K, one cutoff): measured beside the fixed-K rows,
    and a calibration candidate."""
    return not policy.get("thresholds") and not policy.get("cutoffs") and policy.get("cutoff_above") is not None


def dataset_label(name: str) -> str:
    return Path(name).stem if name.endswith(".jsonl") else name


def load_datasets(config: SweepConfig) -> dict[str, list[Prompt]]:
    cache = Path(config.cache_dir) if config.cache_dir else None
    limit = max(points_prompts(config.num_prompts, c, config.min_waves) for c in config.concurrency)
    return {dataset_label(name): load_prompts(name, limit=limit, cache_dir=cache, completions=config.completions)
            for name in config.datasets}


def prompt_encoder(tokenizer, completions: bool = False) -> Callable[[Prompt], list[int]]:
    """A prompt's token ids: its chat through the chat template, or (completions, a base model) its text as plain
    text, with the tokenizer's BOS."""
    if completions:
        return lambda p: tokenizer.encode(p.text, add_special_tokens=True)
    return lambda p: tokenizer.encode_chat(list(p.messages))


def points_prompts(num_prompts: int, concurrency: int, min_waves: int = 1) -> int:
    """How many requests a point runs: `num_prompts`, at least `min_waves` waves of `concurrency`, rounded up to a
    multiple of the concurrency, so that a point at concurrency c really has c requests in flight and ends in a full
    wave, not a tail of a few requests that would measure a lower concurrency."""
    wanted = max(num_prompts, min_waves * concurrency)
    return -(-wanted // concurrency) * concurrency


def point_prompts(prompts: Sequence[Prompt], num_prompts: int, concurrency: int, min_waves: int = 1) -> list[Prompt]:
    """The requests of one point (`points_prompts` of them): distinct prompts while the dataset has them, then the
    same ones again in order."""
    n = points_prompts(num_prompts, concurrency, min_waves)
    distinct = list(prompts[:n])
    return [distinct[i % len(distinct)] for i in range(n)] if distinct else []


def run_sweep(config: SweepConfig, open_runner: OpenRunner, sink: Sink,
              prompts: dict[str, list[Prompt]] | None = None, on_policy: OnPolicy | None = None) -> list[dict]:
    """Measures every row x temperature x dataset x concurrency point into `sink`; returns the points.

    For each method in `config.calibrate`, the policy is derived from the fixed-K rows once they are
    measured, handed to `on_policy` (which writes it) and measured as a row of its own."""
    prompts = load_datasets(config) if prompts is None else prompts
    rows = config.groups()
    per_row = len(config.temperatures) * len(prompts) * len(config.concurrency)
    calibrated = len(config.calibrate)
    bar = tqdm(total=(len(rows) + calibrated) * per_row, desc="bench", unit="point", disable=None)
    points: list[dict] = []
    fixed = [r for r in rows if r[2] is None or is_cutoff_policy(r[2])]
    for row in fixed:
        points += measure_row(config, open_runner, row, prompts, sink, bar)
    adaptive = [r for r in rows if r[2] is not None and not is_cutoff_policy(r[2])]
    for method in config.calibrate:
        policy, table = derive_policy(points, method)
        logger.info("calibrated %s policy: %s", method, policy_text(policy))
        if on_policy is not None:
            on_policy(method, policy, table)
        adaptive.append((method, config.policy_k(policy), policy))
    for row in adaptive:
        points += measure_row(config, open_runner, row, prompts, sink, bar)
    bar.close()
    return points


def measure_row(config: SweepConfig, open_runner: OpenRunner, row: tuple[str, int | None, dict | None],
                prompts: dict[str, list[Prompt]], sink: Sink, bar) -> list[dict]:
    """One engine's points, then the re-measurement of those that look wrong (while the engine is still up); the
    vLLM rows' child processes measure theirs with it too (peagle.bench.vllm_baseline)."""
    method, k, policy = row
    points: list[dict] = []
    with open_runner(method, k, policy) as runner:
        def measure(dataset: str, temperature: float, c: int) -> dict:
            bar.set_postfix_str(f"{method} K={k}{' adaptive' if policy else ''} {dataset} t={temperature:g} c={c}")
            measured = runner.measure(point_prompts(prompts[dataset], config.num_prompts, c, config.min_waves), c,
                                      temperature=temperature, min_seconds=config.min_seconds)
            point = make_point(dataset, method, k, c, measured, temperature=temperature, adaptive=policy)
            client = "" if measured.client_cpu_per_s is None else f", client CPU {measured.client_cpu_per_s:.2f} s/s"
            if (measured.client_processes or 1) > 1:
                client += (f" over {measured.client_processes} processes (busiest "
                           f"{measured.client_cpu_per_process_max:.2f})")
            logger.info("%s K=%s%s %s t=%g c=%d: %.1f tok/s, AL %s%s", method, k, " adaptive" if policy else "",
                        dataset, temperature, c, point["tokens_per_s"], point["acceptance_length"], client)
            return point

        for temperature in config.temperatures:
            for dataset in prompts:
                for c in config.concurrency:
                    point = measure(dataset, temperature, c)
                    points.append(point)
                    sink.add(point)
                    bar.update()
        again = (lambda p: measure(p["dataset"], p["temperature"], p["concurrency"])) if config.remeasure \
            else (lambda p: p)
        redone = settle(points, again, config.hygiene) if config.remeasure else _flag_only(points, config.hygiene)
        for i in redone:
            logger.info("re-measured %s K=%s %s c=%d: %.1f -> %.1f tok/s", method, k, points[i]["dataset"],
                        points[i]["concurrency"], points[i]["remeasured"]["tokens_per_s"], points[i]["tokens_per_s"])
    sink.flush()
    return points


def _flag_only(points: list[dict], rules: HygieneRules) -> list[int]:
    from peagle.bench.hygiene import flag_points

    standing = flag_points(points, rules)
    for i, p in enumerate(points):
        p["flags"] = standing.get(i, [])
    return []


@contextlib.contextmanager
def open_engine_runner(config: SweepConfig, method: str, k: int | None,
                       policy: dict | None = None) -> Iterator[Runner]:
    """An in-process engine for a row (method, K, adaptive policy), freed (GPU memory included) when the block exits."""
    from peagle import LLM, SamplingParams
    from peagle.bench.engine_runner import EngineRunner
    from peagle.models.loader import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer or config.model)
    synthetic = None
    if config.synthetic_acceptance is not None and method != "none":
        synthetic = config.synthetic_acceptance[:k]
    llm = LLM(model=config.model, speculative_config=config.speculative_config(method, k, policy),
              dtype=config.dtype, device=config.device, max_model_len=config.max_model_len,
              max_num_seqs=max(config.concurrency), gpu_memory_utilization=config.gpu_memory_utilization,
              enforce_eager=config.enforce_eager, load_format=config.load_format, synthetic_acceptance=synthetic,
              **config.llm_options)

    def params(temperature: float, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=config.ignore_eos)

    runner = EngineRunner(llm.engine, prompt_encoder(tokenizer, config.completions), params, config.max_tokens)
    del llm
    # The engine's objects out of the cyclic collector's walks while it serves, as `peagle serve`'s engine process
    # has them, so that in-process and served rows pay the same; thawed before the engine is freed.
    gc.collect()
    gc.freeze()
    try:
        yield runner
    finally:
        runner.close()
        gc.unfreeze()
        free_accelerator_memory()


@contextlib.contextmanager
def open_http_runner(config: SweepConfig, method: str, k: int | None,
                     policy: dict | None = None) -> Iterator[Runner]:
    from peagle.bench.http_runner import HttpRunner

    yield HttpRunner(config.url, config.max_tokens, model=config.served_model, api_key=config.api_key,
                     ignore_eos=config.ignore_eos, client_processes=config.client_processes)


def free_accelerator_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def encode_prompts(config: SweepConfig, prompts: dict[str, list[Prompt]]) -> dict[str, list[int]]:
    """Prompt id -> the token ids the in-process engine is given (prompt_encoder with the engine's tokenizer)."""
    from peagle.models.loader import load_tokenizer

    encode = prompt_encoder(load_tokenizer(config.tokenizer or config.model), config.completions)
    return {p.id: encode(p) for ps in prompts.values() for p in ps}


def run_hf_baselines(config: SweepConfig, prompts: dict[str, list[Prompt]], sink: Sink) -> None:
    """The transformers `generate` baselines of peagle.bench.hf_baseline (greedy), on the same prompts as the sweep."""
    from peagle.bench.hf_baseline import HfBaseline
    from peagle.models.loader import load_tokenizer

    encode = prompt_encoder(load_tokenizer(config.model), config.completions)
    baseline = HfBaseline(config.model, dtype=config.dtype, device=config.device, max_tokens=config.max_tokens,
                          ignore_eos=config.ignore_eos, min_seconds=config.min_seconds)
    try:
        for dataset, dataset_prompts in prompts.items():
            token_ids = [encode(p) for p in dataset_prompts]
            for method, batch, m in baseline.run_all(token_ids, config.hf_num_prompts, config.hf_batch_sizes,
                                                     config.hf_methods):
                point = make_point(dataset, method, None, batch, m)
                logger.info("%s batch %d on %s: %.1f tok/s", method, batch, dataset, point["tokens_per_s"])
                sink.add(point)
    finally:
        baseline.close()
        free_accelerator_memory()


def policy_writer(config: SweepConfig, writer: ResultsWriter) -> OnPolicy:
    """Writes a calibrated policy beside its head (HEAD/adaptive.json) and a copy into the run's directory."""

    def write(method: str, policy: dict, table: list[dict]) -> None:
        record = {"method": method, "model": config.model, "head": config.draft(method),
                  "gpu": writer.results["environment"].get("gpu"), "created_utc": writer.results["created_utc"],
                  "command": writer.results["command"], "datasets": list(config.datasets),
                  "temperatures": list(config.temperatures), "max_tokens": config.max_tokens,
                  "rule": RULE,
                  "table": table}
        path = write_policy(policy_path(config.draft(method)), policy, record)
        write_policy(writer.out_dir / f"adaptive-{method}.json", policy, record)
        logger.info("wrote %s: %s", path, policy_text(policy))
        writer.policies[method] = path

    return write


def run_benchmark(config: SweepConfig, out_dir: Path, command: str,
                  open_runner: OpenRunner | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole run: sweep, vLLM's rows, HF baselines, then results.json, results.md and the plots in out_dir.

    Returns (results, files) where files maps "results", "markdown" and "plots" to the paths written (and
    "policies", method -> adaptive.json, after --calibrate).
    """
    vllm = vllm_version(config) if config.vllm_baselines else None  # refused before anything is measured
    writer = ResultsWriter(Path(out_dir), command, config.to_json())
    prompts = load_datasets(config)
    if open_runner is None:
        open_runner = functools.partial(open_http_runner if config.url else open_engine_runner, config)
    run_sweep(config, open_runner, writer, prompts, policy_writer(config, writer))
    if vllm is not None:
        run_vllm_baselines(config, prompts, encode_prompts(config, prompts), writer, vllm)
    if config.hf_baselines:
        run_hf_baselines(config, prompts, writer)
    files = write_summaries(writer.results, Path(out_dir), writer.path)
    if writer.policies:
        files["policies"] = dict(writer.policies)
    return writer.results, files


def write_summaries(results: dict[str, Any], out_dir: Path, results_path: Path) -> dict[str, Any]:
    """results.md and the PNG plots of a results dict, beside its results.json."""
    from peagle.bench.plots import plot_all

    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "results.md"
    md.write_text(markdown(results) + "\n")
    return {"results": results_path, "markdown": md, "plots": plot_all(results, out_dir)}
