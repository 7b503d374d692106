"""The fused element-wise kernels on CUDA at SmolLM2-135M and Llama-3.1-8B sizes: equal to their references (rotary
and the residual sum bit for bit) and replayable from a CUDA graph. Their timing against the PyTorch ops they
replace is a benchmark, not a test: scripts/device/kernel_timing.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import peagle.kernels as kernels
from peagle.kernels import fused

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The case builders and tolerances are the unit tests' own, so both tiers check the same way.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_kernels_fused import assert_matches, qkv_views, rope_tables  # noqa: E402

CUDA = torch.device("cuda")
MODELS = {
    # name: (hidden, heads, kv_heads, head_dim, intermediate)
    "smollm2-135m": (576, 9, 3, 64, 1536),
    "llama-3.1-8b": (4096, 32, 8, 128, 14336),
}
NUM_TOKENS = [1, 8, 64, 512]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def layer_inputs(model, num_tokens, dtype, seed=0):
    """One decoder layer's element-wise inputs on CUDA, q and k as strided views of a fused projection."""
    hidden, heads, kv_heads, head_dim, inter = MODELS[model]
    gen = torch.Generator().manual_seed(seed)
    q, k = qkv_views(gen, num_tokens, heads, kv_heads, head_dim, dtype)
    cos, sin = rope_tables(head_dim, max_positions=4096)
    inputs = dict(
        x=torch.randn(num_tokens, hidden, generator=gen).to(dtype),
        residual=torch.randn(num_tokens, hidden, generator=gen).to(dtype),
        weight=(1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype),
        positions=torch.randint(0, 4096, (num_tokens,), generator=gen),
        cos=cos, sin=sin,
        gate_up=torch.randn(num_tokens, 2 * inter, generator=gen).to(dtype),
    )
    moved = {name: t.to(CUDA) for name, t in inputs.items()}
    qkv = q._base.to(CUDA)  # the projection output both views share; .to() on a view would copy it contiguous
    moved["q"], moved["k"] = (qkv.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (q, k))
    return moved


def run_fused(inp):
    normed, summed = fused.fused_add_rms_norm(inp["x"], inp["residual"], inp["weight"], 1e-5)
    q_out, k_out = fused.rotary(inp["positions"], inp["q"], inp["k"], inp["cos"], inp["sin"])
    return (fused.rms_norm(inp["x"], inp["weight"], 1e-5), normed, summed, q_out, k_out,
            fused.silu_and_mul(inp["gate_up"]))


def run_reference(inp):
    normed, summed = kernels.fused_add_rms_norm_ref(inp["x"], inp["residual"], inp["weight"], 1e-5)
    q_out, k_out = kernels.rotary_ref(inp["positions"], inp["q"], inp["k"], inp["cos"], inp["sin"])
    return (kernels.rms_norm_ref(inp["x"], inp["weight"], 1e-5), normed, summed, q_out, k_out,
            kernels.silu_and_mul_ref(inp["gate_up"]))


def assert_all_match(got, want):
    rms, normed, summed, q_out, k_out, act = got
    rms_ref, normed_ref, summed_ref, q_ref, k_ref, act_ref = want
    # Sums and rotations are single correctly rounded operations on both sides: exact.
    assert torch.equal(summed, summed_ref)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    for out, ref in ((rms, rms_ref), (normed, normed_ref), (act, act_ref)):
        assert_matches(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_kernels_equal_references(model, num_tokens, dtype):
    inp = layer_inputs(model, num_tokens, dtype)
    assert inp["q"].untyped_storage().data_ptr() == inp["k"].untyped_storage().data_ptr()  # views of one qkv
    assert_all_match(run_fused(inp), run_reference(inp))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_rotary_store_kv_equals_rotary_then_store(model, num_tokens, dtype):
    from peagle.kernels import kv_cache

    _, heads, kv_heads, head_dim, _ = MODELS[model]
    gen = torch.Generator().manual_seed(num_tokens)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype).to(CUDA)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    cos, sin = (t.to(CUDA) for t in rope_tables(head_dim, max_positions=4096))
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(CUDA)
    num_blocks = (num_tokens + 15) // 16 + 1
    slots = torch.randperm(num_blocks * 16, generator=gen)[:num_tokens]
    slots[::3] = -1  # rejected and padding rows write nothing
    slots = slots.to(CUDA)
    caches = [torch.randn(num_blocks, 16, kv_heads, head_dim, generator=gen).to(dtype).to(CUDA) for _ in range(2)]
    k_one, v_one = (c.clone() for c in caches)
    q_one = fused.rotary_store_kv(positions, q, k, v, cos, sin, k_one, v_one, slots)
    q_two, k_rot = fused.rotary(positions, q, k, cos, sin)
    k_two, v_two = (c.clone() for c in caches)
    kv_cache.store_kv(k_rot, v, k_two, v_two, slots)
    assert torch.equal(q_one, q_two) and torch.equal(k_one, k_two) and torch.equal(v_one, v_two)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rotary_store_kv_with_qk_norm_equals_norms_then_rotary_then_store(num_tokens, dtype):
    # Qwen3-30B-A3B's attention: 32 q heads, 4 KV heads, head_dim 128, q/k norms fused into the RoPE + store kernel.
    from peagle.kernels import kv_cache

    heads, kv_heads, head_dim = 32, 4, 128
    gen = torch.Generator().manual_seed(num_tokens + 1)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = (3 * torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen)).to(dtype).to(CUDA)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    norm = tuple((1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(CUDA) for _ in range(2)) + (1e-6,)
    cos, sin = (t.to(CUDA) for t in rope_tables(head_dim, max_positions=4096))
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(CUDA)
    num_blocks = (num_tokens + 15) // 16 + 1
    slots = torch.randperm(num_blocks * 16, generator=gen)[:num_tokens]
    slots[::3] = -1
    slots = slots.to(CUDA)
    caches = [torch.randn(num_blocks, 16, kv_heads, head_dim, generator=gen).to(dtype).to(CUDA) for _ in range(2)]
    k_one, v_one = (c.clone() for c in caches)
    q_one = fused.rotary_store_kv(positions, q, k, v, cos, sin, k_one, v_one, slots, qk_norm=norm)
    q_two, k_rot = fused.rotary(positions, fused.rms_norm(q, norm[0], 1e-6), fused.rms_norm(k, norm[1], 1e-6), cos,
                                sin)
    k_two, v_two = (c.clone() for c in caches)
    kv_cache.store_kv(k_rot, v, k_two, v_two, slots)
    assert torch.equal(v_one, v_two)
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps  # the norms' sums run in another order
    for got, want in ((q_one, q_two), (k_one, k_two)):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


def test_per_head_rms_norm():
    inp = layer_inputs("smollm2-135m", 64, torch.bfloat16)
    weight = inp["weight"][:64]
    assert_matches(fused.rms_norm(inp["q"], weight, 1e-6), kernels.rms_norm_ref(inp["q"], weight, 1e-6))


def test_empty_batch():
    out = run_fused(layer_inputs("smollm2-135m", 0, torch.bfloat16))
    assert [t.shape[0] for t in out] == [0] * len(out)


def test_cuda_graph_replay_follows_new_inputs():
    inp = layer_inputs("smollm2-135m", 8, torch.bfloat16)
    run_fused(inp)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_fused(inp)
    new = layer_inputs("smollm2-135m", 8, torch.bfloat16, seed=1)
    for name in ("x", "residual", "weight", "positions", "gate_up"):
        inp[name].copy_(new[name])
    inp["q"].copy_(new["q"])
    inp["k"].copy_(new["k"])
    graph.replay()
    torch.cuda.synchronize()
    assert_all_match(out, run_reference(inp))


def single_ops(inp):
    """(name, fused launch, the reference ops it replaces) for each kernel."""
    x, residual, weight = inp["x"], inp["residual"], inp["weight"]
    rope = (inp["positions"], inp["q"], inp["k"], inp["cos"], inp["sin"])
    return [
        ("rms_norm", lambda: fused.rms_norm(x, weight, 1e-5), lambda: kernels.rms_norm_ref(x, weight, 1e-5)),
        ("add_rms_norm", lambda: fused.fused_add_rms_norm(x, residual, weight, 1e-5),
         lambda: kernels.fused_add_rms_norm_ref(x, residual, weight, 1e-5)),
        ("rotary", lambda: fused.rotary(*rope), lambda: kernels.rotary_ref(*rope)),
        ("silu_and_mul", lambda: fused.silu_and_mul(inp["gate_up"]),
         lambda: kernels.silu_and_mul_ref(inp["gate_up"])),
    ]
