"""Hugging Face transformers `generate` baselines on the benchmark's prompts (the same token ids as the engine's).

Methods (reported in the bench schema with `concurrency` = batch size, `k` null, no latencies):
- hf_eager: the default dynamic cache, batch 1 and batched (left padding);
- hf_static_compile: static cache, whose forward transformers compiles with torch.compile on its own (CUDA only;
  the cache is sized once for the longest prompt so that no call recompiles), batch 1;
- hf_prompt_lookup: prompt-lookup decoding (`prompt_lookup_num_tokens=10`), batch 1.
Greedy. Before each method and batch size a warm-up call on the longest prompt runs untimed (for the compiled
variant this is the compilation, about a minute on a GPU). A measurement repeats whole passes over its prompts until
it has run `min_seconds` (one pass at least), so a fast baseline on a few prompts still measures a rate.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterator, Sequence

from tqdm import tqdm

from peagle.bench.measurement import Measurement, RequestTrace, summarize

logger = logging.getLogger(__name__)

PROMPT_LOOKUP_TOKENS = 10
HF_METHODS = ("eager", "prompt_lookup", "static_compile")  # what `run_all` measures, in order (`methods`)


class HfBaseline:
    def __init__(self, model_dir: str, *, dtype: str = "bfloat16", device: str | None = None, max_tokens: int = 256,
                 ignore_eos: bool = False, min_seconds: float = 0.0):
        import torch
        from transformers import AutoModelForCausalLM

        from peagle.models.loader import parse_dtype

        self.torch = torch
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=parse_dtype(dtype)).to(self.device).eval()
        self.max_tokens = max_tokens
        self.min_seconds = min_seconds
        self.ignore_eos = ignore_eos
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else min(self.eos_ids, default=0)

    def close(self) -> None:
        self.model = None

    def run_all(self, token_ids: Sequence[list[int]], num_prompts: int, batch_sizes: Sequence[int],
                methods: Sequence[str] = HF_METHODS) -> Iterator[tuple[str, int, Measurement]]:
        """(method, batch size, measurement) for each baseline of `methods` (names of HF_METHODS); batch b uses
        max(num_prompts, b) prompts."""
        unknown = sorted(set(methods) - set(HF_METHODS))
        if unknown:
            raise ValueError(f"unknown HF baseline(s) {unknown}; choose from {HF_METHODS}")
        if "eager" in methods:
            for batch in batch_sizes:
                yield "hf_eager", batch, self.measure(token_ids[:max(num_prompts, batch)], batch)
        if "prompt_lookup" in methods:
            yield "hf_prompt_lookup", 1, self.measure(token_ids[:num_prompts], 1,
                                                      prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
        if "static_compile" not in methods:
            return
        if self.device.type == "cuda":
            longest = max(len(t) for t in token_ids[:num_prompts])
            yield "hf_static_compile", 1, self.measure(token_ids[:num_prompts], 1, cache_implementation="static",
                                                       max_cache_len=longest + self.max_tokens)
        else:
            logger.warning("skipping hf_static_compile: transformers compiles the static-cache forward on CUDA only")

    def measure(self, token_ids: Sequence[list[int]], batch: int, **generate_kwargs: Any) -> Measurement:
        batches = [list(token_ids[i:i + batch]) for i in range(0, len(token_ids), batch)]
        longest = max(batches, key=lambda b: max(map(len, b)))
        self._generate(longest, **generate_kwargs)  # warm-up, untimed
        traces = []
        self._sync()
        start = time.perf_counter()
        with tqdm(desc=f"HF generate, batch {batch}", unit="batch", leave=False, disable=None) as bar:
            while not traces or time.perf_counter() - start < self.min_seconds:  # whole passes, one at least
                for rows in batches:
                    traces += self._timed_batch(rows, **generate_kwargs)
                    bar.update()
        m = summarize(traces, time.perf_counter() - start, None)
        # generate() reports no per-token times: its single chunk per request would pass for a TTFT, so drop it.
        return dataclasses.replace(m, ttft_p50_ms=None, ttft_p99_ms=None)

    def _timed_batch(self, rows: list[list[int]], **generate_kwargs: Any) -> list[RequestTrace]:
        submitted = time.perf_counter()
        new_tokens = self._generate(rows, **generate_kwargs)
        self._sync()
        done = time.perf_counter()
        traces = []
        for generated in new_tokens:
            trace = RequestTrace(submitted=submitted)
            trace.add_chunk(done, self._count_output(generated))
            traces.append(trace)
        return traces

    def _generate(self, rows: list[list[int]], **generate_kwargs: Any) -> list[list[int]]:
        torch = self.torch
        width = max(map(len, rows))
        # Left padding: every row's last prompt token sits in the last column, where generation continues.
        input_ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        if self.ignore_eos:
            generate_kwargs["min_new_tokens"] = self.max_tokens
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=self.max_tokens,
                                      do_sample=False, pad_token_id=self.pad_id, **generate_kwargs)
        return out[:, width:].tolist()

    def _count_output(self, generated: list[int]) -> int:
        """Tokens up to and including the first EOS; what follows is padding of a finished row."""
        for i, token in enumerate(generated):
            if token in self.eos_ids:
                return i + 1
        return len(generated)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
