"""vLLM request options on the GPU (CUDA graphs, async scheduling, speculation): prompt logprobs equal the logprob
the paged engine reports for the same token when it is the one token allowed after the same prefix, and a prompt cut
by truncate_prompt_tokens decodes as its tail sent alone (fp32, random weights)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from peagle import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_rng = random.Random(5)
PROMPT = [_rng.randrange(1, 4096) for _ in range(300)]
SPECS = {"none": None,
         "peagle": {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 7, "parallel_drafting": True}}



@pytest.fixture(scope="module", params=sorted(SPECS))
def llm(request, model_dir):
    return LLM(model=model_dir, load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=4,
               speculative_config=SPECS[request.param])


def test_prompt_logprobs_match_the_paged_engine(llm):
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
                       use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    for j in (1, 17, 150, 299):
        forced = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=[PROMPT[j]], logprobs=0)
        step = llm.generate({"prompt_token_ids": PROMPT[:j]}, forced, use_tqdm=False)[0].outputs[0]
        assert step.token_ids == [PROMPT[j]]
        mine = out.prompt_logprobs[j][PROMPT[j]]
        assert math.isclose(mine.logprob, step.logprobs[0][PROMPT[j]].logprob, abs_tol=2e-3), j
        assert mine.rank == step.logprobs[0][PROMPT[j]].rank


def test_truncated_prompt_decodes_as_its_tail(llm):
    greedy = {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
    cut = llm.generate({"prompt_token_ids": PROMPT * 2}, SamplingParams(truncate_prompt_tokens=100, **greedy),
                       use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": (PROMPT * 2)[-100:]}, SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == tail.prompt_token_ids and cut.outputs[0].token_ids == tail.outputs[0].token_ids
