"""`LLM`: offline generation in the spirit of vLLM's Python API."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm import tqdm

from peagle.engine.config import DTYPE_ALIASES, EngineConfig, SpeculativeConfig
from peagle.engine.llm_engine import LLMEngine
from peagle.engine.outputs import RequestMetrics, RequestOutput
from peagle.engine.sampling_params import SamplingParams


class LLM:
    """Generate with a target model, optionally speculating with an EAGLE-3 or P-EAGLE head.

    >>> llm = LLM(model="ckpt", speculative_config={"method": "eagle3", "model": "head",
    ...           "num_speculative_tokens": 7, "parallel_drafting": True})
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))[0].text

    `load_format="dummy"` builds the model from config.json with random weights (no weights or tokenizer needed;
    prompts as token ids); a speculative `model` of "dummy" then makes a random head of the default depth.
    `synthetic_acceptance` (benchmarking only, needs load_format="dummy") accepts draft position i with the given
    per-position rate instead of asking the target, so speculation's speed at real size can be measured without
    trained weights.
    """

    def __init__(self, model: str, speculative_config: dict[str, Any] | str | None = None, *,
                 dtype: str = "bfloat16", device: str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int | None = None,
                 gpu_memory_utilization: float = 0.9, block_size: int = 16, num_kv_blocks: int | None = None,
                 enforce_eager: bool = False, seed: int = 0, load_format: str = "auto",
                 synthetic_acceptance: Sequence[float] | None = None):
        import torch

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        config = EngineConfig(
            model=str(model), dtype=DTYPE_ALIASES.get(dtype, dtype), device=device, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization, block_size=block_size, num_kv_blocks=num_kv_blocks,
            enforce_eager=enforce_eager, seed=seed, speculative=SpeculativeConfig.from_dict(speculative_config),
            load_format=load_format,
            synthetic_acceptance=tuple(synthetic_acceptance) if synthetic_acceptance is not None else None,
        )
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        requests = {}
        for prompt, p in zip(prompts, params):
            ids = self._encode(prompt)
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, p)
            requests[rid] = (prompt if isinstance(prompt, str) else None, ids, p)
        return self._run(requests, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer, so chat() cannot apply a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate([self.tokenizer.encode(p) for p in prompts], sampling_params, use_tqdm)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass prompts as token-id lists")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]

    def _run(self, requests: dict, use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        bar = tqdm(total=len(requests), desc="generating", disable=not use_tqdm, leave=False)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    prompt, ids, p = requests[out.request_id]
                    text = _cut_at_stop(self.engine.text_of(tokens[out.request_id]), p.stop)
                    done[out.request_id] = RequestOutput(
                        out.request_id, prompt, ids, text, tokens[out.request_id], out.finish_reason,
                        out.metrics or RequestMetrics(), out.error)
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in requests]


def _cut_at_stop(text: str, stops: list[str] | None) -> str:
    cut = min((i for i in (text.find(s) for s in stops or []) if i >= 0), default=-1)
    return text[:cut] if cut >= 0 else text
