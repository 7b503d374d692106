"""A stand-in for vLLM in the unit tests of peagle.bench.vllm_baseline: just enough of `LLM`, `SamplingParams` and
`get_metrics` for a bench row to run on the CPU in a child process, with no model.

Each step gives every running request one token and, with a speculative config, the drafts its round accepts:
min(K, FAKE_VLLM_ACCEPT) of them (default K - 1), counted in vLLM's spec-decode counters as vLLM counts them (a
round per request and step, K drafted, the accepted ones by position). A head directory without config.json is
refused, as vLLM refuses a head it cannot read. With FAKE_VLLM_LOG set, the LLM's keywords and each request's prompt
and sampling parameters are appended to that JSONL file; with FAKE_VLLM_REFUSE_STATS set, an LLM with its statistics
on is refused. `LLM.generate` runs prompts to their end, as vLLM's does.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.25.0+fake"
__all__ = ["LLM", "SamplingParams"]
STEP_S = 0.001  # a step's time, so that rates are finite
TOKEN = 7


def _log(record: dict) -> None:
    if os.environ.get("FAKE_VLLM_LOG"):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps(record) + "\n")


@dataclass
class Counter:
    name: str
    labels: dict
    value: int


@dataclass
class Vector:
    name: str
    labels: dict
    values: list[int]


@dataclass
class CompletionOutput:
    token_ids: list[int]


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class _Request:
    params: SamplingParams
    left: int
    sent: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, k: int, accept: int):
        self.k, self.accept = k, accept
        self.running: dict[str, _Request] = {}
        self.counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.per_position = [0] * k

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> None:
        _log({"request": request_id, "prompt_token_ids": prompt["prompt_token_ids"], "temperature": params.temperature,
              "max_tokens": params.max_tokens, "ignore_eos": params.ignore_eos,
              "output_kind": params.output_kind.name})
        self.running[request_id] = _Request(params, params.max_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_S)
        outputs = []
        for request_id, r in list(self.running.items()):
            accepted = min(self.accept, r.left - 1) if r.sent and self.k else 0  # the first step is the prefill
            if r.sent and self.k:
                self.counts["num_drafts"] += 1
                self.counts["num_draft_tokens"] += self.k
                self.counts["num_accepted_tokens"] += accepted
                for i in range(accepted):
                    self.per_position[i] += 1
            new = [TOKEN] * (1 + accepted)
            r.sent += new
            r.left -= len(new)
            if not r.left:
                del self.running[request_id]
            outputs.append(RequestOutput(request_id, [CompletionOutput(new)], not r.left))
        return outputs


class LLM:
    def __init__(self, model: str, speculative_config: dict | None = None, **kwargs):
        _log({"llm": {"model": model, "speculative_config": speculative_config, **kwargs}})
        k = 0
        if speculative_config:
            head = Path(speculative_config["model"])
            if not (head / "config.json").is_file():
                raise ValueError(f"fake vLLM: cannot read a draft model config from {head}")
            k = speculative_config["num_speculative_tokens"]
        accept = int(os.environ.get("FAKE_VLLM_ACCEPT", max(k - 1, 0)))
        self.llm_engine = LLMEngine(k, min(accept, k))
        self.log_stats = not kwargs.get("disable_log_stats", True)
        if self.log_stats and os.environ.get("FAKE_VLLM_REFUSE_STATS"):
            raise RuntimeError("fake vLLM: statistics refused")

    def generate(self, prompts: list, params: SamplingParams, use_tqdm: bool = True) -> list[RequestOutput]:
        engine = self.llm_engine
        self.generated = getattr(self, "generated", 0) + len(prompts)
        ids = [f"generate-{self.generated - len(prompts) + i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, prompt, params)
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.outputs[0].token_ids
        return [RequestOutput(request_id, [CompletionOutput(tokens[request_id])], True) for request_id in ids]

    def get_metrics(self) -> list:
        assert self.log_stats, "Stat logging disabled"
        engine = self.llm_engine
        labels = {"engine": "0"}
        metrics = [Counter(f"vllm:spec_decode_{name}", labels, value) for name, value in engine.counts.items()]
        if engine.k:
            metrics.append(Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, list(engine.per_position)))
        return metrics

