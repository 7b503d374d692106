"""Engine and speculative-decoding configuration."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from peagle.drafters.policy import head_adaptive_default


@dataclass(frozen=True, kw_only=True, slots=True)
class AdaptivePolicy:
    """How many drafts to verify per request, as a function of the number of running requests.

    `thresholds` maps an upper bound on running requests to K: [(4, 7), (16, 5), (64, 3)] means up to 4 running
    requests verify 7 drafts, up to 16 verify 5, up to 64 verify 3, and more than 64 verify `above`.
    Larger batches make verification compute-bound, where rejected drafts cost real time; fewer drafts then pay.
    The drafter proposes as many drafts as the load's K verifies (EngineConfig.propose_verified_only; off: the
    engine's K, of which each step verifies the load's first K); when the load falls and K rises, the step
    verifies its drafts padded to the new K and proposes that many (engine/draft_plan.py).
    K = 0 turns speculation off in that band: plain decoding steps, the drafter not run at all (except over new
    prompts, so that it knows them). When the load falls again, drafting resumes; the drafter's cache then lacks the
    tokens decoded while it was off, which lowers its acceptance for those requests, never their output.

    `cutoffs` maps running requests to the draft confidence cutoff the same way ([(8, 0.0), (32, 0.2)] and
    `cutoff_above` 0.4: no cutoff up to 8 running requests, 0.2 up to 32, 0.4 beyond): each request then verifies
    only its drafts whose confidence (engine/spec/confidence.py) reaches the cutoff. 0 verifies every draft; no
    table at all leaves confidence off (EngineConfig.draft_confidence_cutoff overrides the table).
    """

    thresholds: tuple[tuple[int, int], ...] = ()
    above: int | None = None
    cutoffs: tuple[tuple[int, float], ...] = ()
    cutoff_above: float | None = None

    def __post_init__(self):
        _check_bands("adaptive thresholds", self.thresholds)
        for _, k in self.thresholds:
            if k < 0:
                raise ValueError(f"adaptive K must be >= 0 (0 = speculation off), got {k}")
        if self.above is not None and self.above < 0:
            raise ValueError(f"adaptive 'above' K must be >= 0 (0 = speculation off), got {self.above}")
        _check_bands("adaptive cutoffs", self.cutoffs)
        for name, c in [("cutoffs", c) for _, c in self.cutoffs] + [("cutoff_above", self.cutoff_above)]:
            if c is not None and not 0.0 <= c <= 1.0:
                raise ValueError(f"adaptive {name} must be confidence cutoffs in [0, 1] (0 = verify every draft), "
                                 f"got {c}")

    def k_for(self, num_running: int, k_max: int) -> int:
        for bound, k in self.thresholds:
            if num_running <= bound:
                return min(k, k_max)
        return min(self.above if self.above is not None else k_max, k_max)

    @property
    def has_cutoffs(self) -> bool:
        """Whether the policy sets a confidence cutoff at some load (a table, even of zeros)."""
        return bool(self.cutoffs) or self.cutoff_above is not None

    def cutoff_for(self, num_running: int) -> float:
        """The draft confidence cutoff with `num_running` requests running (0: every draft verified)."""
        for bound, c in self.cutoffs:
            if num_running <= bound:
                return c
        return self.cutoff_above if self.cutoff_above is not None else 0.0


def _check_bands(name: str, bands) -> None:
    last = 0
    for bound, _ in bands:
        if bound <= last:
            raise ValueError(f"{name} must have increasing running-request bounds")
        last = bound


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, configured as vLLM takes it.

    `{"method": "eagle3", "model": DIR, "num_speculative_tokens": 7, "parallel_drafting": true}` is P-EAGLE;
    without `parallel_drafting` it is EAGLE-3 unless the head's own config says it was trained as P-EAGLE.
    """

    method: str
    model: str
    num_speculative_tokens: int
    parallel_drafting: bool | None = None
    adaptive: AdaptivePolicy = field(default_factory=AdaptivePolicy)

    def __post_init__(self):
        if self.method not in ("eagle3", "peagle", "eagle"):
            raise ValueError(f"speculative_config.method must be 'eagle3' (or 'peagle'), got {self.method!r}")
        if not self.model:
            raise ValueError("speculative_config.model (the drafter checkpoint directory) is required")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be in 1..32, got {self.num_speculative_tokens}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any] | str | None) -> "SpeculativeConfig | None":
        if d is None or d == "" or d == {}:
            return None
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("speculative config must be a JSON object")
        if not d:  # '{}' says: no speculation (overrides a config from the environment)
            return None
        d = head_adaptive_default(d)  # no "adaptive" given: the head's calibrated adaptive.json, if it has one
        known = {"method", "model", "num_speculative_tokens", "parallel_drafting", "adaptive"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config field(s) {unknown}; known: {sorted(known)}")
        missing = [k for k in ("method", "model", "num_speculative_tokens") if k not in d]
        if missing:
            raise ValueError(f"speculative_config is missing {missing}")
        _check_field_types(d)
        adaptive = d.get("adaptive") or {}
        policy = AdaptivePolicy(
            thresholds=tuple(tuple(t) for t in adaptive.get("thresholds", ())),
            above=adaptive.get("above"),
            cutoffs=tuple((int(b), float(c)) for b, c in adaptive.get("cutoffs", ())),
            cutoff_above=None if adaptive.get("cutoff_above") is None else float(adaptive["cutoff_above"]),
        )
        return cls(
            method=d["method"],
            model=str(d["model"]),
            num_speculative_tokens=int(d["num_speculative_tokens"]),
            parallel_drafting=d.get("parallel_drafting"),
            adaptive=policy,
        )

    @classmethod
    def from_env(cls) -> "SpeculativeConfig | None":
        for var in ("PEAGLE_SPECULATIVE_CONFIG", "SM_VLLM_SPECULATIVE_CONFIG"):
            if os.environ.get(var):
                return cls.from_dict(os.environ[var])
        return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_field_types(d: dict[str, Any]) -> None:
    """Each speculative_config field's type, so that a mistake ("seven" for a number) names its field."""
    def wrong(name: str, want: str, value):
        raise ValueError(f"speculative_config.{name} must be {want}, got {value!r}")

    if not isinstance(d["method"], str):
        wrong("method", "a string", d["method"])
    if not isinstance(d["model"], (str, os.PathLike)):
        wrong("model", "a path string", d["model"])
    if not _is_int(d["num_speculative_tokens"]):
        wrong("num_speculative_tokens", "an integer", d["num_speculative_tokens"])
    if d.get("parallel_drafting") is not None and not isinstance(d["parallel_drafting"], bool):
        wrong("parallel_drafting", "true or false", d["parallel_drafting"])
    adaptive = d.get("adaptive")
    if adaptive is None:
        return
    if not isinstance(adaptive, dict):
        wrong("adaptive", 'an object like {"thresholds": [[8, 7], [32, 5]], "above": 3}', adaptive)
    known = ["above", "cutoff_above", "cutoffs", "thresholds"]
    unknown = sorted(set(adaptive) - set(known))
    if unknown:
        raise ValueError(f"unknown speculative_config.adaptive field(s) {unknown}; known: {known}")
    thresholds = adaptive.get("thresholds", [])
    if not isinstance(thresholds, (list, tuple)) or not all(
            isinstance(t, (list, tuple)) and len(t) == 2 and all(map(_is_int, t)) for t in thresholds):
        wrong("adaptive.thresholds", "a list of [running requests, K] integer pairs", thresholds)
    if adaptive.get("above") is not None and not _is_int(adaptive["above"]):
        wrong("adaptive.above", "an integer", adaptive["above"])
    cutoffs = adaptive.get("cutoffs", [])
    if not isinstance(cutoffs, (list, tuple)) or not all(
            isinstance(t, (list, tuple)) and len(t) == 2 and _is_int(t[0]) and _is_number(t[1]) for t in cutoffs):
        wrong("adaptive.cutoffs", "a list of [running requests, confidence cutoff] pairs", cutoffs)
    if adaptive.get("cutoff_above") is not None and not _is_number(adaptive["cutoff_above"]):
        wrong("adaptive.cutoff_above", "a number in [0, 1]", adaptive["cutoff_above"])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    model: str
    dtype: str = "bfloat16"
    device: str = "cuda"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    num_kv_blocks: int | None = None
    enforce_eager: bool = False
    seed: int = 0
    speculative: SpeculativeConfig | None = None
    load_format: str = "auto"
    synthetic_acceptance: tuple[float, ...] | None = None
    # vLLM's name: the host schedules and prepares step n+1 while the GPU runs step n (faster at every batch size,
    # greedy output unchanged: docs/DECISIONS.md)
    async_scheduling: bool = True
    # the target's linear layers run the split-K GEMV kernel (kernels/gemv.py) at <= 8 rows instead of cuBLAS, each
    # decoder norm and the MLP's activation inside the GEMV after it (three kernels fewer per layer); off by default:
    # slower than cuBLAS end to end at batch 1 (docs/DECISIONS.md)
    decode_gemv: bool = False
    # vLLM's name: prompts longer than a step's max_num_batched_tokens left by the decodes are prefilled in chunks
    enable_chunked_prefill: bool = False
    # vLLM's name: a prompt starts from the KV blocks an earlier prompt with the same first tokens left cached (full
    # blocks, the target's and the drafter's entries; engine/block_manager.py). Off by default (vLLM's is on):
    # benchmarks repeat their prompts, and the testbed's prefills cost little more than a step (docs/DECISIONS.md)
    enable_prefix_caching: bool = False
    # general steps (prefills, prefill chunks, prefills beside decodes) of up to 2048 tokens and 16 requests replay
    # CUDA graphs too, captured on first use (CUDA without enforce_eager only): an eager step costs ~13 ms of host
    # launches on the 30-layer testbed target; graphed, TTFT and a prompt's step fall several-fold with greedy output
    # unchanged (docs/DECISIONS.md). A shape's first use pays its capture (30-50 ms)
    prefill_cuda_graphs: bool = True
    # With async scheduling, a step that admits waiting prompts is launched before the answer in flight arrives (the
    # prompts built on the host, the decodes' rows on the device from that answer) instead of after it with the GPU
    # idle: more tokens/s and a lower ITL tail where requests finish apart (docs/DECISIONS.md; scripts/device/
    # engine_timing.py's "+admit-ahead" variant times it)
    admit_ahead: bool = True
    # The paged attention's KV splits merged by their last arrival inside the attention kernel, one launch instead of
    # two (kernels/paged_attention.py): faster decode and admitting steps (docs/DECISIONS.md; "+fused-merge")
    fused_merge: bool = True
    # A mixed step's short and long requests tiled apart in two attention launches (kernels/paged_attention.py): an
    # admitting step takes less GPU time, steps without prompts are unchanged (docs/DECISIONS.md; "+mixed-tiles")
    mixed_tiles: bool = True
    # An adaptive engine's drafter proposes only the drafts its step's K verifies (not the engine's K), a step whose
    # K rose padded to the new K's layout so that it replays graphs: faster at 64 requests of the 8B shape
    # (docs/DECISIONS.md; engine/draft_plan.py)
    propose_verified_only: bool = True
    # Each request verifies only its drafts whose confidence (the drafter's probability of the chain up to them,
    # engine/spec/confidence.py) reaches this cutoff, at every load: a float in [0, 1], 0 verifying every draft.
    # None: the speculative config's adaptive cutoffs (the head's adaptive.json by default), else off
    draft_confidence_cutoff: float | None = None

    def __post_init__(self):
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.synthetic_acceptance is not None:
            # Benchmark-only: accepted drafts are decided by dice, not by the target, so outputs are meaningless.
            if self.load_format != "dummy":
                raise ValueError("synthetic_acceptance is for benchmarking random-weight models only: it needs "
                                 "load_format='dummy'")
            if self.speculative is None:
                raise ValueError("synthetic_acceptance needs a speculative_config")
            rates = self.synthetic_acceptance
            if len(rates) != self.speculative.num_speculative_tokens:
                raise ValueError(f"synthetic_acceptance needs one rate per draft position "
                                 f"({self.speculative.num_speculative_tokens}), got {len(rates)}")
            if any(not 0.0 <= r <= 1.0 for r in rates) or any(b > a for a, b in zip(rates, rates[1:])):
                raise ValueError("synthetic_acceptance rates (accepted at position i / rounds) must lie in [0, 1] "
                                 "and never increase with the position")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError(f"gpu_memory_utilization must be in [0.05, 0.99], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size must be 8, 16, 32 or 64, got {self.block_size}")
        cutoff = self.draft_confidence_cutoff
        if cutoff is not None:
            if not _is_number(cutoff) or not 0.0 <= cutoff <= 1.0:
                raise ValueError(f"draft_confidence_cutoff must be a number in [0, 1] (0 = verify every draft, None = "
                                 f"the speculative config's adaptive cutoffs), got {cutoff!r}")
            if cutoff > 0 and self.speculative is None:
                raise ValueError("draft_confidence_cutoff needs a speculative_config: it cuts the drafts a request "
                                 "verifies")
        for name in _SWITCHES:  # a truthy non-bool (a string from a script) would turn a switch on unseen
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


_SWITCHES = ("admit_ahead", "fused_merge", "mixed_tiles", "propose_verified_only")


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                 "auto": "bfloat16"}
