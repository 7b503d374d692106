"""`LLM`: offline generation with vLLM's Python API (`from peagle import LLM, SamplingParams`)."""

from __future__ import annotations

import itertools
import logging
from typing import Any, Sequence

from tqdm import tqdm

from peagle.engine.config import DTYPE_ALIASES, EngineConfig, SpeculativeConfig
from peagle.engine.llm_engine import LLMEngine
from peagle.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from peagle.engine.sampling_params import SamplingParams, model_sampling_defaults
from peagle.models.tokenizer import load_chat_template

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int] | dict


class LLM:
    """Generate with a target model, optionally speculating with an EAGLE-3 or P-EAGLE head.

    >>> llm = LLM(model="ckpt", speculative_config={"method": "eagle3", "model": "head",
    ...           "num_speculative_tokens": 7, "parallel_drafting": True})
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0].text

    `dtype="auto"` (the default) is bfloat16 on a GPU and float32 on the CPU, where bfloat16 matmuls are slow.
    `tokenizer` loads the tokenizer from another directory. `tensor_parallel_size` must be 1 (one device);
    `enable_prefix_caching=True` lets prompts start from the cached KV blocks of earlier prompts with the same first
    tokens (off by default, None as False; `RequestOutput.num_cached_tokens` says how many tokens came from it);
    `trust_remote_code` is accepted and changes nothing, since peagle runs only its own model code.
    `generation_config` ("auto", the default, as vLLM's): calls without sampling_params sample as the model's
    generation_config.json recommends (`get_default_sampling_params()`); "vllm" ignores it; or a directory's file.
    `load_format="dummy"` builds the model from config.json with random weights (no weights or tokenizer needed;
    prompts as token ids); a speculative `model` of "dummy" then makes a random head of the default depth.
    `synthetic_acceptance` (benchmarking only, needs load_format="dummy") accepts draft position i with the given
    per-position rate instead of asking the target, so speculation's speed at real size can be measured without
    trained weights.
    `admit_ahead`, `fused_merge`, `mixed_tiles` and `propose_verified_only` (on by default) are the engine's switches
    of those names (EngineConfig), for timing them off.
    `draft_confidence_cutoff` (a number in [0, 1]): each request verifies only its drafts whose confidence, the
    drafter's probability of the chain up to them, reaches it (0: every draft; None, the default: the adaptive
    policy's cutoffs per load, from the head's adaptive.json when the speculative config gives no policy, else none).
    """

    def __init__(self, model: str, speculative_config: dict[str, Any] | str | None = None, *,
                 tokenizer: str | None = None, trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 enable_prefix_caching: bool | None = None, dtype: str = "auto", device: str | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int | None = None,
                 gpu_memory_utilization: float = 0.9, block_size: int = 16, num_kv_blocks: int | None = None,
                 enforce_eager: bool = False, seed: int = 0, load_format: str = "auto",
                 synthetic_acceptance: Sequence[float] | None = None, async_scheduling: bool = True,
                 decode_gemv: bool = False, enable_chunked_prefill: bool = False,
                 prefill_cuda_graphs: bool = True, generation_config: str = "auto", admit_ahead: bool = True,
                 fused_merge: bool = True, mixed_tiles: bool = True, propose_verified_only: bool = True,
                 draft_confidence_cutoff: float | None = None):
        import torch

        _check_unimplemented(tensor_parallel_size, trust_remote_code)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        config = EngineConfig(
            model=str(model), dtype=resolve_dtype(dtype, device), device=device, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            gpu_memory_utilization=gpu_memory_utilization, block_size=block_size, num_kv_blocks=num_kv_blocks,
            enforce_eager=enforce_eager, seed=seed, speculative=SpeculativeConfig.from_dict(speculative_config),
            load_format=load_format,
            synthetic_acceptance=tuple(synthetic_acceptance) if synthetic_acceptance is not None else None,
            async_scheduling=async_scheduling, decode_gemv=decode_gemv, enable_chunked_prefill=enable_chunked_prefill,
            prefill_cuda_graphs=prefill_cuda_graphs, enable_prefix_caching=bool(enable_prefix_caching),
            admit_ahead=admit_ahead, fused_merge=fused_merge, mixed_tiles=mixed_tiles,
            propose_verified_only=propose_verified_only, draft_confidence_cutoff=draft_confidence_cutoff,
        )
        check_max_model_len(config)
        self.sampling_defaults = model_sampling_defaults(generation_config, model)  # before the model loads
        if self.sampling_defaults:
            logger.info("default sampling parameters from the model's generation_config.json: %s (generation_config="
                        "'vllm' ignores them)", self.sampling_defaults)
        self.engine = LLMEngine(config)
        if tokenizer is not None:
            from peagle.models.loader import load_tokenizer

            self.engine.use_tokenizer(load_tokenizer(tokenizer))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    # ---- generation --------------------------------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, token ids, {"prompt": str} or {"prompt_token_ids": [...]}, or a list of them."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # Every prompt is checked before any is queued, so a bad one leaves nothing behind in the engine.
        encoded = [self._encode(prompt, p) for prompt, p in zip(prompts, params)]
        requests = {}
        prompt_logprobs = {}
        for (text, ids), p in zip(encoded, params):
            rid = str(next(self._ids))
            for index, child in enumerate(p.parallel_children()):
                seq = self.engine.add_request(f"{rid}-{index}" if p.n > 1 else rid, ids, child)
                if index == 0 and seq.prompt_logprobs is not None:
                    prompt_logprobs[rid] = [None] + [self._logprob_dict(e, p.prompt_logprobs)
                                                     for e in seq.prompt_logprobs]
            requests[rid] = (text, ids, p)
        outputs = self._run(requests, use_tqdm)
        for out in outputs:
            out.prompt_logprobs = prompt_logprobs.get(out.request_id)
        return outputs

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: the model's generation_config.json
        recommendations (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM's LLM does
        with generation_config="auto" (the default; "vllm": none of them)."""
        return SamplingParams(**self.sampling_defaults)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list | None = None,
             chat_template: str | None = None) -> list[RequestOutput]:
        """`tools` (OpenAI's function definitions) are rendered by the chat template, as vLLM's chat() does; the
        output is text (parse calls with peagle.server.tool_calls.parse_tool_calls). `chat_template`: a template (or
        a file's path) for this call instead of the model's, as vLLM's chat() takes it. `continue_final_message` (with
        add_generation_prompt=False) leaves the last message open for the model to continue."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer, so chat() cannot apply a chat template")
        tokenizer = self.tokenizer
        if chat_template is not None:
            tokenizer = tokenizer.with_chat_template(load_chat_template(chat_template))
        if tools and "tools" not in (tokenizer.chat_template or ""):
            raise ValueError("tools: this model's chat template does not render tools")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": tokenizer.encode_chat(c, add_generation_prompt=add_generation_prompt,
                                                              continue_final_message=continue_final_message,
                                                              tools=tools or None)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    # ---- prompts -----------------------------------------------------------------------------------------------

    def _encode(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and the token ids the model reads (after truncate_prompt_tokens:
        RequestOutput.prompt_token_ids)."""
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if unknown or len(prompt) != 1:
                raise ValueError(f"a prompt dict holds exactly one of 'prompt' or 'prompt_token_ids', got keys "
                                 f"{sorted(prompt)}")
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass prompts as token-id lists")
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a prompt dict, got {prompt!r:.80}")
        ids = self.engine.truncated_prompt(ids, params)
        self._check_prompt(ids)
        return text, ids

    def _check_prompt(self, ids: list[int]):
        limit, vocab = self.engine.max_model_len, self.engine.model_config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= limit:
            raise ValueError(f"the prompt (length {len(ids)}) is longer than the maximum model length minus one "
                             f"output token ({limit - 1}); raise max_model_len or shorten the prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    # ---- outputs -----------------------------------------------------------------------------------------------

    def _run(self, requests: dict, use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, list] = {rid: [None] * p.n for rid, (_, _, p) in requests.items()}
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list] = {}
        bar = tqdm(total=len(requests), desc="generating", disable=None if use_tqdm else True, leave=False)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.logprobs is not None:
                    logprobs.setdefault(out.request_id, []).extend(out.logprobs)
                if not out.finished:
                    continue
                rid, index = _parent(out.request_id)
                _, _, p = requests[rid]
                done[rid][index] = (self._completion(index, tokens.pop(out.request_id, []), logprobs.pop(
                    out.request_id, None), out.finish_reason, p), out)
                if all(d is not None for d in done[rid]):
                    bar.update(1)
        bar.close()
        return [self._request_output(rid, requests[rid], done[rid]) for rid in requests]

    def _completion(self, index: int, token_ids: list[int], logprobs: list | None, finish_reason: str | None,
                    p: SamplingParams) -> CompletionOutput:
        text, stop_reason = self._text(token_ids, finish_reason, p)
        entries = cumulative = None
        if p.logprobs is not None:
            entries = [self._logprob_dict(e, p.logprobs) for e in logprobs or []]
            cumulative = sum(e[1] for e in logprobs or [])
        return CompletionOutput(index, text, token_ids, cumulative, entries, finish_reason, stop_reason)

    def _text(self, token_ids: list[int], finish_reason: str | None, p: SamplingParams) -> tuple[str, Any]:
        """The output text and vLLM's stop_reason (the stop string or stop token id that ended it)."""
        if self.tokenizer is None:
            return "", None
        ids, stop_reason = token_ids, None
        ended_by_token = finish_reason == "stop" and ids and (
            ids[-1] in p.stop_token_ids or (not p.ignore_eos and ids[-1] in self.engine.eos_token_ids))
        if ended_by_token:
            stop_reason = ids[-1] if ids[-1] in p.stop_token_ids else None
            if not p.include_stop_str_in_output:  # vLLM leaves the stopping token's text out
                ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        if finish_reason == "stop" and not ended_by_token:
            hits = [(i, s) for s in p.stop for i in [text.find(s)] if i >= 0]
            if hits:
                i, s = min(hits)
                text, stop_reason = text[:i + len(s) if p.include_stop_str_in_output else i], s
        return text, stop_reason

    def _logprob_dict(self, entry, num_top: int) -> dict[int, Logprob]:
        token_id, logprob, rank, top = entry
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else (
            lambda t: None)
        out = {token_id: Logprob(logprob, rank, decode(token_id))}
        for i, (t, lp) in enumerate(top[:num_top]):
            out.setdefault(t, Logprob(lp, i + 1, decode(t)))
        return out

    def _request_output(self, rid: str, request, children: list) -> RequestOutput:
        text, ids, _ = request
        outputs = [c for c, _ in children]
        steps = [s for _, s in children]
        error = next((s.error for s in steps if s.error), None)
        metrics = _combine([s.metrics or RequestMetrics() for s in steps])
        return RequestOutput(rid, text, ids, outputs, metrics, error=error, num_cached_tokens=metrics.num_cached_tokens)


def resolve_dtype(dtype: str, device: str) -> str:
    """vLLM's "auto", here: bfloat16 on a GPU, float32 on the CPU (logged), where bfloat16 is slow and less exact."""
    if dtype == "auto":
        if str(device).startswith("cpu"):
            logger.info("dtype auto on the CPU: using float32 (pass dtype='bfloat16' to override)")
            return "float32"
        return "bfloat16"
    return DTYPE_ALIASES.get(dtype, dtype)


def check_max_model_len(config: EngineConfig):
    """max_model_len above the model's max_position_embeddings is refused, as vLLM refuses it."""
    from peagle.models.config import ModelConfig

    if config.max_model_len is None:
        return
    limit = ModelConfig.from_dir(config.model).max_position_embeddings
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} is above the model's max_position_embeddings "
                         f"({limit}); use at most {limit}")


def _check_unimplemented(tensor_parallel_size, trust_remote_code):
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r} is not supported: peagle runs on one "
                         f"device (tensor_parallel_size=1)")
    if not isinstance(trust_remote_code, bool):
        raise ValueError(f"trust_remote_code must be a bool, got {trust_remote_code!r}")


def _parent(request_id: str) -> tuple[str, int]:
    rid, _, index = request_id.partition("-")
    return rid, int(index) if index else 0


def _combine(metrics: list[RequestMetrics]) -> RequestMetrics:
    if len(metrics) == 1:
        return metrics[0]
    width = max(len(m.accepted_per_position) for m in metrics)
    per_pos = [sum(m.accepted_per_position[i] for m in metrics if i < len(m.accepted_per_position))
               for i in range(width)]
    first = metrics[0]
    return RequestMetrics(sum(m.num_drafting_rounds for m in metrics), sum(m.num_draft_tokens for m in metrics),
                          sum(m.num_accepted_tokens for m in metrics), per_pos,
                          sum(m.num_output_tokens for m in metrics), first.ttft_s, first.itl_s,
                          max((m.e2e_s or 0.0) for m in metrics), first.num_cached_tokens,
                          sum(m.num_verified_tokens for m in metrics))
