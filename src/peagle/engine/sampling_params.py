"""SamplingParams: how one request samples and when it stops, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """Per-request sampling, in vLLM's terms.

    After validation `stop` and `stop_token_ids` are always lists (None and a lone string are normalised) and
    `top_k` is -1 when off (0 is accepted as "off" too). Stop strings are matched by the engine's detokenizer;
    `stop_token_ids` end a request even with `ignore_eos`, which only ignores the model's EOS ids.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        self._check_numbers()
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    def _check_numbers(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.top_k == 0:
            self.top_k = -1
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")

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
    def _normalise_stop_token_ids(ids) -> list[int]:
        if ids is None:
            return []
        ids = list(ids)
        for i in ids:
            if not _is_int(i) or i < 0:
                raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {i!r}")
        return ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
