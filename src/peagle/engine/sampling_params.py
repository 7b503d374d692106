"""SamplingParams: how one request samples and when it stops, validated when built (vLLM's fields and meanings)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_LOGPROBS = 20  # vLLM's default max_logprobs

# generation_config.json's sampling keys that vLLM takes as defaults (--generation-config auto), by our field name;
# a value equal to transformers' own default is no recommendation and is skipped, as vLLM skips it.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def model_sampling_defaults(generation_config: str, model_dir: str | Path) -> dict[str, Any]:
    """The sampling defaults that requests which leave a field out get, as vLLM's `--generation-config` sets them:
    "auto" reads the model directory's generation_config.json (what its creator recommends), "vllm" none, any other
    value is a directory with a generation_config.json. Checked by building SamplingParams from them."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_dir) if generation_config == "auto" else Path(generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config == "auto":
            return {}
        raise ValueError(f"--generation-config {generation_config}: no generation_config.json there")
    config = json.loads(path.read_text())
    defaults = {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items()
                if config.get(theirs) is not None and config[theirs] != _TRANSFORMERS_DEFAULTS.get(theirs)}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: its sampling defaults are not valid: {e}") from None
    return defaults


@dataclass(frozen=True, kw_only=True, slots=True)
class StructuredOutputsParams:
    """vLLM's structured output: exactly one of a JSON schema (dict or JSON text), any JSON object, a regex, a choice
    among strings, or a Lark grammar. (`GuidedDecodingParams` is vLLM's older name for the same.)"""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams":
        """From a dict or any object with these attributes (vLLM's own params objects included)."""
        if isinstance(value, cls):
            return value
        names = ("json", "json_object", "regex", "choice", "grammar")
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ValueError(f"structured_outputs does not support {unknown} (supported: {list(names)})")
            return cls(**{k: v for k, v in value.items() if v is not None})
        return cls(**{n: getattr(value, n) for n in names if getattr(value, n, None) is not None})


GuidedDecodingParams = StructuredOutputsParams


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """Per-request sampling, in vLLM's terms.

    After validation `stop` and `stop_token_ids` are always lists (None and a lone string are normalised),
    `logit_bias` is a dict of int ids (or None) and `top_k` is -1 when off (0 is accepted as "off" too). Stop strings
    are matched by the engine's detokenizer; `stop_token_ids` end a request even with `ignore_eos`, which only
    ignores the model's EOS ids. `min_tokens` keeps EOS (unless `ignore_eos`) and `stop_token_ids` out of the first
    outputs and holds stop strings back until then. Penalties follow vLLM: presence and frequency over the output
    tokens, repetition (divide positive logits, multiply negative ones) over prompt and output.

    Fields vLLM has and peagle does not implement exist only to refuse a non-default value with a ValueError that
    names them (logits_processors, spaces_between_special_tokens=False, detokenize=False, best_of > n).
    `prompt_logprobs` (0..20, vLLM's): the target's log-probability of every prompt token after the first, with that
    many top alternatives (RequestOutput.prompt_logprobs). `bad_words` (vLLM's): words the output never completes (each word's last token is banned where
    the tokens before it end the output so far; tokenised with and without a leading space, as vLLM does). `truncate_prompt_tokens` (vLLM's) keeps a prompt's last k tokens (-1: its last
    max_model_len), cut when the engine takes the request.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None  # vLLM's older name for structured_outputs
    compiled_grammar: object | None = field(default=None, repr=False)  # set by the engine for its tokenizer
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)  # set by the engine (tokenizer)
    prompt_logprobs: int | None = None
    # vLLM fields peagle refuses unless left at their defaults:
    logits_processors: list | None = None
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self):
        self._refuse_unimplemented()
        self._check_numbers()
        self._check_penalties()
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self._normalise_structured_outputs()
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words) or None
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an int >= 1 (keep the prompt's last k tokens), -1 (its "
                             f"last max_model_len) or None, got {k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _normalise_structured_outputs(self):
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("structured_outputs and guided_decoding are one setting: give one of them")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)

    def _refuse_unimplemented(self):
        unset = {"logits_processors": None,
                 "spaces_between_special_tokens": True, "detokenize": True}
        for name, default in unset.items():
            value = getattr(self, name)
            if value != default and not (name == "logits_processors" and value == []):
                raise ValueError(f"{name}={value!r} is not supported by peagle (only {default!r})")

    def _check_numbers(self):
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of != self.n):
            raise ValueError(f"best_of must equal n ({self.n}) or be None: best_of > n is not supported, "
                             f"got {self.best_of!r}")
        if not _is_number(self.temperature):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {value!r}")

    def _check_penalties(self):
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")

    @staticmethod
    def _normalise_stop(stop) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else list(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}")
        return stops

    @staticmethod
    def _normalise_logit_bias(bias) -> dict[int, float] | None:
        if not bias:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        out = {}
        for key, value in bias.items():
            try:
                token_id = int(key)  # JSON object keys are strings
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if token_id < 0 or not _is_number(value):
                raise ValueError(f"logit_bias must map token ids >= 0 to numbers, got {key!r}: {value!r}")
            out[token_id] = max(-100.0, min(100.0, float(value)))  # OpenAI's range; vLLM clamps alike
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_logits_processing(self) -> bool:
        """Whether the target's logits change before sampling beyond temperature / top-k / top-p."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None or self.min_tokens
                    or self.structured_outputs is not None or self.bad_words is not None)

    def parallel_children(self) -> list["SamplingParams"]:
        """n > 1 runs n independent sequences; seeded ones get seed + index, as vLLM's parallel sampling does."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, best_of=None, seed=None if self.seed is None else self.seed + i,
                                    prompt_logprobs=self.prompt_logprobs if i == 0 else None)  # a prompt's, once
                for i in range(self.n)]

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _token_ids(name: str, ids) -> list[int]:
    if ids is None:
        return []
    ids = list(ids)
    for i in ids:
        if not _is_int(i) or i < 0:
            raise ValueError(f"{name} must be a list of token ids >= 0, got {i!r}")
    return ids


def with_bad_words(params: SamplingParams, tokenizer, vocab_size: int) -> SamplingParams:
    """`params` with its bad words as token-id sequences for this tokenizer (itself without bad words). As vLLM:
    each word as written (leading space stripped) and with one leading space, the second kept only when it starts
    with another token and has as many tokens (a word inside text is usually one token with its space)."""
    if params.bad_words is None or params.bad_words_token_ids is not None:
        return params
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer, and this model has none")
    sequences: list[list[int]] = []
    for word in params.bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (plain, spaced):
            if ids is spaced and (not spaced or spaced[0] == plain[0] or len(spaced) != len(plain)):
                continue
            if ids and ids not in sequences:
                sequences.append(ids)
    outside = sorted({t for ids in sequences for t in ids if not 0 <= t < vocab_size})
    if outside:
        raise ValueError(f"bad_words: token ids {outside} are outside the vocabulary [0, {vocab_size})")
    return dataclasses.replace(params, bad_words_token_ids=sequences)


def truncate_prompt(prompt_token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens (left truncation): the prompt's last `keep` tokens, -1 its last max_model_len;
    the same list when nothing is cut (None, or a prompt no longer than that)."""
    if keep is None:
        return prompt_token_ids
    keep = max_model_len if keep == -1 else keep
    return list(prompt_token_ids)[-keep:] if len(prompt_token_ids) > keep else prompt_token_ids
