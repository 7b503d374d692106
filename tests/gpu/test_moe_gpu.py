"""The fused MoE kernels on CUDA at Qwen3-30B-A3B's and GPT-OSS-20B's expert shapes: equal to the reference and
replayable from a CUDA graph (no host sync, static shapes) with a new routing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from peagle.kernels import moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The case builder and tolerances are the unit tests' own, so both tiers check the same way.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
import test_kernels_moe as unit_cases  # noqa: E402

CUDA = torch.device("cuda")
MODELS = {
    # name: (hidden, expert intermediate, experts, top k, make_case's options)
    "qwen3-30b-a3b": (2048, 768, 128, 8, {}),
    "gpt-oss-20b": (2880, 2880, 32, 4, {"activation": "swiglu_limit", "bias": True}),
}


def model_case(model, num_tokens, seed=0):
    hidden, inter, experts, top_k, options = MODELS[model]
    return unit_cases.make_case(seed, num_tokens, experts, top_k, hidden, inter, dtype=torch.bfloat16, device=CUDA,
                                **options)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,kwargs,config", unit_cases.FUSED_MOE_CASES)
def test_unit_cases(num_tokens, num_experts, top_k, hidden, inter, kwargs, config):
    case = unit_cases.make_case(num_tokens * num_experts + top_k, num_tokens, num_experts, top_k, hidden, inter,
                                device=CUDA, **kwargs)
    got = moe._fused_moe_triton(**case, config=None if config is None else moe.MoeConfig(*config))
    unit_cases.assert_close(got, moe.fused_moe_ref(**unit_cases.upcast(case)))


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_model_shapes(model, num_tokens):
    case = model_case(model, num_tokens)
    with torch.no_grad():
        got = moe.fused_moe(**case)  # the dispatch: Triton for CUDA tensors
    unit_cases.assert_close(got, moe.fused_moe_ref(**unit_cases.upcast(case)))


@pytest.mark.parametrize("num_tokens", [1, 64])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_cuda_graph_replay_follows_new_routing(model, num_tokens):
    case = model_case(model, num_tokens)
    with torch.no_grad():
        moe.fused_moe(**case)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe.fused_moe(**case)
        new = model_case(model, num_tokens, seed=1)
        for name in ("x", "topk_weights", "topk_ids"):
            case[name].copy_(new[name])
        graph.replay()
        torch.cuda.synchronize()
    unit_cases.assert_close(out, moe.fused_moe_ref(**unit_cases.upcast(case)))


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("num_tokens", [1, 8, 512])
def test_route_topk_at_model_shapes(model, num_tokens):
    # fp32 logits, so no two experts tie (the unit tests hold the order of ties)
    _, _, experts, top_k, _ = MODELS[model]
    gen = torch.Generator(device=CUDA).manual_seed(num_tokens)
    logits = torch.randn(num_tokens, experts, generator=gen, device=CUDA)
    weights, ids = moe._route_topk_triton(logits, top_k, True)
    want_weights, want_ids = moe.route_topk_ref(logits, top_k, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
