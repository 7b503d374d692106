"""The stand-in's SamplingParams: the fields the bench's vLLM rows set (vllm/__init__.py says what the stand-in is)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
