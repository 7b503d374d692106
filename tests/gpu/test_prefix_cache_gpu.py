"""Prefix caching on the GPU: prompts that take cached blocks (target's and drafter's) under CUDA graphs, with and
without speculation and async scheduling, give the greedy output of the same engine without the cache, token for
token in fp32."""

from __future__ import annotations

import random

import pytest
import torch

from peagle import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_rng = random.Random(3)
SHARED = [_rng.randrange(1, 4096) for _ in range(150)]
# A shared system-prompt-like prefix with different questions, one prompt repeated, one sharing only a part.
PROMPTS = [SHARED + [_rng.randrange(1, 4096) for _ in range(n)] for n in (5, 30, 70, 1)] + [SHARED[:60] + [7, 8, 9]]
SPECS = {"none": None,
         "eagle3": {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3},
         "peagle": {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 7, "parallel_drafting": True}}



@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", sorted(SPECS))
def test_cached_prefixes_keep_greedy_output_under_graphs(model_dir, method, async_scheduling):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, cached = {}, []
    for caching in (False, True):
        llm = LLM(model=model_dir, load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=4,
                  speculative_config=SPECS[method], async_scheduling=async_scheduling, enable_prefix_caching=caching)
        rounds = [llm.generate(PROMPTS, params, use_tqdm=False) for _ in range(2)]
        outs[caching] = [[o.token_ids for o in r] for r in rounds]
        cached = [o.num_cached_tokens for o in rounds[1]]
    assert outs[True] == outs[False]
    assert min(cached[:4]) >= 144 and cached[4] == 48  # the second round took the shared blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", sorted(SPECS))
def test_next_turn_takes_the_answers_blocks_under_graphs(model_dir, method, async_scheduling):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs, cached = {}, None
    for caching in (False, True):
        llm = LLM(model=model_dir, load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=4,
                  speculative_config=SPECS[method], async_scheduling=async_scheduling, enable_prefix_caching=caching)
        first = llm.generate(PROMPTS, params, use_tqdm=False)
        turns = [p + o.token_ids + [5, 6, 7] for p, o in zip(PROMPTS, first)]
        second = llm.generate(turns, params, use_tqdm=False)
        outs[caching] = ([o.token_ids for o in first], [o.token_ids for o in second])
        cached = [o.num_cached_tokens for o in second]
        bs = llm.engine.scheduler.block_manager.block_size
    assert outs[True] == outs[False]
    # every full block before the first turn's last token (never fed): the answers' blocks too
    assert cached == [(len(p) + params.max_tokens - 1) // bs * bs for p in PROMPTS]
