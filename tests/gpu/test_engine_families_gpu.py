"""The other families on the GPU under CUDA graphs, random weights in fp32: Qwen3-MoE, GPT-OSS (sinks, windows, YaRN),
Gemma 3 (windows, two RoPE bases) and Gemma 4 as released (wider global heads, KV shared across layers, GeGLU
experts). Greedy output with EAGLE-3 and P-EAGLE drafting equals plain greedy output, token for token, and graphs
equal eager steps. The configs (data/tiny_families.json) are the unit tests' tiny ones as transformers writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peagle import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIGS = json.loads((Path(__file__).parent / "data" / "tiny_families.json").read_text())
# Past every family's window (6 tokens), and more prompts than max_num_seqs.
PROMPTS = [[5 + (7 * i) % 400 for i in range(n)] for n in (3, 17, 40, 9, 130, 1)]
SPECS = {"none": None,
         "eagle3": {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3},
         "peagle": {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 5, "parallel_drafting": True}}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    (d / "config.json").write_text(json.dumps(CONFIGS[request.param]))
    return str(d)


def generate(model_dir, method, **kw):
    llm = LLM(model=model_dir, load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=4,
              speculative_config=SPECS[method], **kw)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(family_dir):
    return generate(family_dir, "none")


def test_graphs_equal_eager_steps(family_dir, plain):
    assert generate(family_dir, "none", enforce_eager=True) == plain


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculative_greedy_equals_plain_greedy(family_dir, plain, method, async_scheduling):
    assert generate(family_dir, method, async_scheduling=async_scheduling) == plain
