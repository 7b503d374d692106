"""The benchmark sweep: methods x K x datasets x concurrency, measured in process or against a server.

In process, one LLM is built per (method, K) ("none" has no K) and measured at every dataset and concurrency
before the next is built; against a server (`url`), the server's own method and K are measured and the labels
given here only name them in the results. Hugging Face baselines run last, on the same prompts.
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

from peagle.bench.datasets import Prompt, load_prompts
from peagle.bench.measurement import WARMUP_MAX_TOKENS, Measurement
from peagle.bench.report import ENGINE_METHODS, ResultsWriter, make_point, markdown

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepConfig:
    model: str | None = None  # target checkpoint directory (in process; also the HF baselines' model)
    url: str | None = None  # an OpenAI-compatible server instead of the in-process engine
    draft_eagle3: str | None = None
    draft_peagle: str | None = None
    methods: tuple[str, ...] = ENGINE_METHODS
    ks: tuple[int, ...] = (3, 5, 7)
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    datasets: tuple[str, ...] = ("mtbench", "humaneval")
    num_prompts: int = 80
    min_waves: int = 1  # at least this many waves of `concurrency` requests per point
    max_tokens: int = 256
    ignore_eos: bool = False
    cache_dir: str | None = None  # testbed cache holding ShareGPT (for the sharegpt dataset)
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
    # Hugging Face transformers baselines on the first `hf_num_prompts` prompts (at least `batch` of them).
    hf_baselines: bool = False
    hf_num_prompts: int = 8
    hf_batch_sizes: tuple[int, ...] = (1, 16, 64)
    # Shown above the results table and kept in results.json (e.g. "smoke scale: not a benchmark").
    note: str | None = None
    # Real-size runs without weights: random weights from config.json, prompts tokenized with another tokenizer,
    # and (benchmarking only) drafts accepted with fixed per-position rates instead of by the target.
    tokenizer: str | None = None
    load_format: str = "auto"
    synthetic_acceptance: tuple[float, ...] | None = None
    # Adaptive speculation for eagle3/peagle points: ((running-request bound, K), ...) and K above the last bound.
    adaptive: tuple[tuple[int, int], ...] = ()
    adaptive_above: int | None = None

    def __post_init__(self):
        from peagle.engine.config import AdaptivePolicy

        AdaptivePolicy(thresholds=self.adaptive, above=self.adaptive_above)  # raises on a bad policy
        unknown = sorted(set(self.methods) - set(ENGINE_METHODS))
        if unknown or not self.methods:
            raise ValueError(f"unknown method(s) {unknown}; --methods takes a comma list of {ENGINE_METHODS}")
        if not self.model and not self.url:
            raise ValueError("give --model DIR (in-process engine) or --url URL (a running server)")
        for name in ("ks", "concurrency", "hf_batch_sizes"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty list of positive integers, got {values}")
        if self.num_prompts < 1 or self.max_tokens < 1 or self.hf_num_prompts < 1 or self.min_waves < 1:
            raise ValueError("num_prompts, min_waves, max_tokens and hf_num_prompts must be >= 1")
        if self.synthetic_acceptance is not None:
            if self.load_format != "dummy":
                raise ValueError("--synthetic-acceptance is for random-weight benchmarks only: add --load-format dummy")
            if len(self.synthetic_acceptance) < max(self.ks):
                raise ValueError(f"--synthetic-acceptance needs a rate for each of the {max(self.ks)} draft positions")
        if self.load_format == "dummy" and self.hf_baselines:
            raise ValueError("the Hugging Face baselines need real weights: drop --hf-baselines with --load-format dummy")
        if not self.datasets:
            raise ValueError("give at least one dataset")
        if self.url:
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

    def groups(self) -> list[tuple[str, int | None]]:
        """(method, K) pairs, one engine each; K is None for no speculation."""
        return [(m, None) if m == "none" else (m, k)
                for m in self.methods for k in (self.ks if m != "none" else [None])]

    def speculative_config(self, method: str, k: int | None) -> dict[str, Any] | None:
        if method == "none":
            return None
        # EAGLE-3 is asked for explicitly (parallel_drafting False) so that a P-EAGLE head is never upgraded.
        draft = self.draft_peagle if method == "peagle" else self.draft_eagle3
        spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": k,
                "parallel_drafting": method == "peagle"}
        if self.adaptive or self.adaptive_above is not None:
            spec["adaptive"] = {"thresholds": [list(t) for t in self.adaptive], "above": self.adaptive_above}
        return spec

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["api_key"]:
            d["api_key"] = "(set)"  # never write a secret into a results file
        return d


class Runner(Protocol):
    def measure(self, prompts: Sequence[Prompt], concurrency: int) -> Measurement: ...


OpenRunner = Callable[[str, int | None], ContextManager[Runner]]  # (method, K) -> a runner, released on exit


def dataset_label(name: str) -> str:
    return Path(name).stem if name.endswith(".jsonl") else name


def load_datasets(config: SweepConfig) -> dict[str, list[Prompt]]:
    cache = Path(config.cache_dir) if config.cache_dir else None
    limit = max(points_prompts(config.num_prompts, c, config.min_waves) for c in config.concurrency)
    return {dataset_label(name): load_prompts(name, limit=limit, cache_dir=cache) for name in config.datasets}


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


def run_sweep(config: SweepConfig, open_runner: OpenRunner, on_point: Callable[[dict], None],
              prompts: dict[str, list[Prompt]] | None = None) -> list[dict]:
    """Measures every (method, K) x dataset x concurrency point; `on_point` sees each point as it is measured."""
    prompts = load_datasets(config) if prompts is None else prompts
    points = []
    bar = tqdm(total=len(config.groups()) * len(prompts) * len(config.concurrency), desc="bench", unit="point")
    for method, k in config.groups():
        with open_runner(method, k) as runner:
            for dataset, dataset_prompts in prompts.items():
                for c in config.concurrency:
                    bar.set_postfix_str(f"{method} K={k} {dataset} c={c}")
                    measured = runner.measure(point_prompts(dataset_prompts, config.num_prompts, c,
                                                            config.min_waves), c)
                    point = make_point(dataset, method, k, c, measured)
                    logger.info("%s K=%s %s c=%d: %.1f tok/s, AL %s", method, k, dataset, c, point["tokens_per_s"],
                                point["acceptance_length"])
                    points.append(point)
                    on_point(point)
                    bar.update()
    bar.close()
    return points


@contextlib.contextmanager
def open_engine_runner(config: SweepConfig, method: str, k: int | None) -> Iterator[Runner]:
    """An in-process engine for (method, K), freed (GPU memory included) when the block exits."""
    from peagle import LLM, SamplingParams
    from peagle.bench.engine_runner import EngineRunner
    from peagle.models.loader import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer or config.model)
    synthetic = None
    if config.synthetic_acceptance is not None and method != "none":
        synthetic = config.synthetic_acceptance[:k]
    llm = LLM(model=config.model, speculative_config=config.speculative_config(method, k), dtype=config.dtype,
              device=config.device, max_model_len=config.max_model_len, max_num_seqs=max(config.concurrency),
              gpu_memory_utilization=config.gpu_memory_utilization, enforce_eager=config.enforce_eager,
              load_format=config.load_format, synthetic_acceptance=synthetic, **config.llm_options)
    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens, ignore_eos=config.ignore_eos)
    warmup = SamplingParams(temperature=0.0, max_tokens=min(WARMUP_MAX_TOKENS, config.max_tokens))
    runner = EngineRunner(llm.engine, lambda p: tokenizer.encode_chat(list(p.messages)), params, warmup)
    del llm
    try:
        yield runner
    finally:
        runner.close()
        free_accelerator_memory()


@contextlib.contextmanager
def open_http_runner(config: SweepConfig, method: str, k: int | None) -> Iterator[Runner]:
    from peagle.bench.http_runner import HttpRunner

    yield HttpRunner(config.url, config.max_tokens, model=config.served_model, api_key=config.api_key,
                     ignore_eos=config.ignore_eos)


def free_accelerator_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_hf_baselines(config: SweepConfig, prompts: dict[str, list[Prompt]], on_point: Callable[[dict], None]) -> None:
    """The transformers `generate` baselines of peagle.bench.hf_baseline, on the same prompts as the sweep."""
    from peagle.bench.hf_baseline import HfBaseline
    from peagle.models.loader import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    baseline = HfBaseline(config.model, dtype=config.dtype, device=config.device, max_tokens=config.max_tokens,
                          ignore_eos=config.ignore_eos)
    try:
        for dataset, dataset_prompts in prompts.items():
            token_ids = [tokenizer.encode_chat(list(p.messages)) for p in dataset_prompts]
            for method, batch, m in baseline.run_all(token_ids, config.hf_num_prompts, config.hf_batch_sizes):
                point = make_point(dataset, method, None, batch, m)
                logger.info("%s batch %d on %s: %.1f tok/s", method, batch, dataset, point["tokens_per_s"])
                on_point(point)
    finally:
        baseline.close()
        free_accelerator_memory()


def run_benchmark(config: SweepConfig, out_dir: Path, command: str,
                  open_runner: OpenRunner | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole run: sweep, HF baselines, then results.json, results.md and the plots in out_dir.

    Returns (results, files) where files maps "results", "markdown" and "plots" to the paths written.
    """
    writer = ResultsWriter(Path(out_dir), command, config.to_json())
    prompts = load_datasets(config)
    if open_runner is None:
        open_runner = functools.partial(open_http_runner if config.url else open_engine_runner, config)
    run_sweep(config, open_runner, writer.add, prompts)
    if config.hf_baselines:
        run_hf_baselines(config, prompts, writer.add)
    return writer.results, write_summaries(writer.results, Path(out_dir), writer.path)


def write_summaries(results: dict[str, Any], out_dir: Path, results_path: Path) -> dict[str, Any]:
    """results.md and the PNG plots of a results dict, beside its results.json."""
    from peagle.bench.plots import plot_all

    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "results.md"
    md.write_text(markdown(results) + "\n")
    return {"results": results_path, "markdown": md, "plots": plot_all(results, out_dir)}
