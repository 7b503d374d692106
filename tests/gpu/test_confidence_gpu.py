"""Draft confidence on the GPU (issue 52): greedy output with a cutoff equals the output without one, token for
token in fp32, under CUDA graphs (the decode graphs with the cutoff read from their buffer, general graphs of
compact steps) with synchronous and async scheduling, for EAGLE-3 and P-EAGLE. The random heads' probabilities are
replaced by a function of the draft (as in tests/unit/test_engine_confidence.py) so that cutoffs cut every depth."""

from __future__ import annotations

import pytest
import torch

from peagle import LLM, SamplingParams
from peagle.engine.spec import proposer as proposer_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5 + i % 50 for i in range(n)] for n in (3, 17, 40, 9, 130, 300, 1, 64)]
SPECS = {"eagle3": {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3},
         "peagle": {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 5, "parallel_drafting": True}}


def pseudo_probability(logits: torch.Tensor) -> torch.Tensor:
    return ((logits.argmax(-1) * 2654435761) % 1009).float() / 1009 * 0.98 + 0.02


def generate(model_dir, method, cutoff, **kw):
    llm = LLM(model=model_dir, load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=4,
              speculative_config=SPECS[method], draft_confidence_cutoff=cutoff, **kw)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    general = llm.engine.runner.general_graphs
    assert not general.failed, general.failed
    del llm
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("cutoff", [0.3, 0.9])
@pytest.mark.parametrize("method", sorted(SPECS))
def test_cutoff_keeps_greedy_output_under_cuda_graphs(model_dir, method, cutoff, async_scheduling, monkeypatch):
    monkeypatch.setattr(proposer_module, "draft_probability", pseudo_probability)
    ref = generate(model_dir, method, 0.0, async_scheduling=False)
    outs = generate(model_dir, method, cutoff, async_scheduling=async_scheduling)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    verified = sum(o.metrics.num_verified_tokens for o in outs)
    assert verified < sum(o.metrics.num_draft_tokens for o in outs)
    assert sum(o.metrics.num_accepted_tokens for o in outs) <= verified
