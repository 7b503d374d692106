"""The fused element-wise kernels (RMSNorm, add + RMSNorm, rotary, rotary + KV-cache write, SiLU-and-mul): the
references are Hugging Face's arithmetic bit for bit, and the Triton kernels, run by Triton's interpreter, equal the
references.

The interpreter rounds fp32 to bf16 by truncation (the GPU rounds to nearest even), so bf16 is compared to within two
ulps here; fp16 and fp32 differ only by fp32 noise (reduction order, exp).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from test_kernels_triton import interpreted, triton_kernels  # noqa: F401 (a fixture, and the interpreted module)

import peagle.kernels as kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Two ulps of the dtype, relative and (for values near zero or results of cancellation) absolute.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2 * 2**-7, torch.float16: 2 * 2**-10}


def assert_matches(got, want, rounded_to=None):
    """got == want to within two ulps of `rounded_to`, the dtype of the intermediates (default: want's)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOLERANCE[rounded_to or want.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def rope_tables(head_dim, max_positions=512, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(max_positions).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    return emb.cos(), emb.sin()


def qkv_views(gen, num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """q, k as the model makes them: strided [T, H, D] views of one fused projection output."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim)


# The references are the model's arithmetic

@pytest.mark.parametrize("dtype", DTYPES)
def test_references_equal_hugging_face(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(6, 96, generator=gen).to(dtype) for _ in range(2))
    hf_norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(1 + 0.3 * torch.randn(96, generator=gen))
        assert torch.equal(kernels.rms_norm_ref(x, hf_norm.weight, 1e-5), hf_norm(x))
        normed, summed = kernels.fused_add_rms_norm_ref(x, residual, hf_norm.weight, 1e-5)
        assert torch.equal(summed, x + residual) and torch.equal(normed, hf_norm(x + residual))

    q, k = qkv_views(gen, 6, 4, 2, 32, dtype)
    cos, sin = rope_tables(32)
    positions = torch.randint(0, 512, (6,), generator=gen)
    c, s = cos[positions].to(dtype), sin[positions].to(dtype)  # [T, D]; HF's layout is [batch, heads, seq, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], c[None], s[None])
    q_out, k_out = kernels.rotary_ref(positions, q, k, cos, sin)
    assert torch.equal(q_out, hf_q[0].transpose(0, 1)) and torch.equal(k_out, hf_k[0].transpose(0, 1))

    gate_up = torch.randn(6, 2 * 40, generator=gen).to(dtype)
    assert torch.equal(kernels.silu_and_mul_ref(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:])


def test_rms_norm_reference_rounds_before_the_weight():
    # bf16 x with an fp32 weight: normalised in fp32, rounded to bf16, then multiplied in fp32 (type promotion).
    x = torch.randn(3, 64).bfloat16()
    weight = torch.full((64,), 1.0 + 2**-12)  # a product that bf16 cannot hold
    xf = x.float()
    rounded = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float()
    out = kernels.rms_norm_ref(x, weight, 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, rounded * weight)


# The Triton kernels equal the references

def check_rms_norm(dtype, weight_dtype, shape, strided):
    gen = torch.Generator().manual_seed(len(shape))
    d = shape[-1]
    full = torch.randn(*shape[:-1], d + 16 * strided, generator=gen).to(dtype)
    x = full[..., 16 * strided:]  # a row stride wider than the row when strided
    weight = (1 + 0.3 * torch.randn(d, generator=gen)).to(weight_dtype)
    out = triton_kernels("fused").rms_norm(x, weight, 1e-6)
    assert_matches(out, kernels.rms_norm_ref(x, weight, 1e-6), rounded_to=dtype)


@pytest.mark.parametrize("dtype,weight_dtype,shape,strided", [
    (torch.float32, torch.float32, (7, 576), False),
    (torch.bfloat16, torch.bfloat16, (5, 576), True),
    (torch.float16, torch.float16, (3, 100), True),  # a row narrower than its power-of-two tile
    (torch.bfloat16, torch.float32, (4, 64), False),  # weight promotes the output to fp32
    (torch.float32, torch.float32, (3, 1, 4096), False),  # Llama-3.1-8B width
])
def test_rms_norm(interpreted, dtype, weight_dtype, shape, strided):
    interpreted(check_rms_norm, dtype, weight_dtype, shape, strided)


def check_rms_norm_per_head(dtype):
    # Per-head norms (Qwen3's q_norm) on the strided q view of a fused projection.
    q, _ = qkv_views(torch.Generator().manual_seed(1), 5, 4, 2, 32, dtype)
    weight = torch.randn(32).to(dtype)
    assert_matches(triton_kernels("fused").rms_norm(q, weight, 1e-6), kernels.rms_norm_ref(q, weight, 1e-6))


def test_rms_norm_per_head(interpreted):
    interpreted(check_rms_norm_per_head, torch.bfloat16)


def check_fused_add_rms_norm(dtype, d):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(6, 2 * d, generator=gen).to(dtype)[:, :d]  # strided, as a slice of a wider output
    residual = torch.randn(6, d, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
    inputs = (x.clone(), residual.clone())
    normed, summed = triton_kernels("fused").fused_add_rms_norm(x, residual, weight, 1e-5)
    normed_ref, summed_ref = kernels.fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert_matches(summed, summed_ref)
    assert_matches(normed, normed_ref)
    assert torch.equal(x, inputs[0]) and torch.equal(residual, inputs[1])  # out of place


@pytest.mark.parametrize("dtype,d", [(torch.float32, 576), (torch.bfloat16, 576), (torch.float16, 200)])
def test_fused_add_rms_norm(interpreted, dtype, d):
    interpreted(check_fused_add_rms_norm, dtype, d)


def check_rotary(dtype, num_heads, num_kv_heads, head_dim, index_dtype):
    gen = torch.Generator().manual_seed(head_dim)
    q, k = qkv_views(gen, 6, num_heads, num_kv_heads, head_dim, dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = rope_tables(head_dim)
    positions = torch.randint(0, 512, (6,), generator=gen).to(index_dtype)
    q_out, k_out = triton_kernels("fused").rotary(positions, q, k, cos, sin)
    q_ref, k_ref = kernels.rotary_ref(positions, q, k, cos, sin)
    assert_matches(q_out, q_ref)
    assert_matches(k_out, k_ref)
    if dtype != torch.bfloat16:  # every step is one correctly rounded product or sum, as PyTorch's
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,index_dtype", [
    (torch.float32, 9, 3, 64, torch.int64),  # SmolLM2-135M
    (torch.bfloat16, 9, 3, 64, torch.int32),
    (torch.float16, 8, 2, 128, torch.int64),
    (torch.float32, 3, 1, 48, torch.int32),  # a half head that is not a power of two
])
def test_rotary(interpreted, dtype, num_heads, num_kv_heads, head_dim, index_dtype):
    interpreted(check_rotary, dtype, num_heads, num_kv_heads, head_dim, index_dtype)


def check_rotary_store_kv(dtype, num_heads, num_kv_heads, head_dim):
    # Rows with slot -1 (rejected drafts, padding) write nothing; the cache then holds what rotary + store_kv write.
    gen = torch.Generator().manual_seed(head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(7, q_size + 2 * kv_size, generator=gen).to(dtype)
    q, k, v = (t.view(7, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    cos, sin = rope_tables(head_dim)
    positions = torch.randint(0, 512, (7,), generator=gen)
    slots = torch.tensor([3, 17, -1, 40, 5, -1, 63])
    caches = [torch.randn(4, 16, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    fused = triton_kernels("fused")
    k_cache, v_cache = (c.clone() for c in caches)
    q_out = fused.rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots)
    # Against the two kernels it replaces: bit for bit.
    q_two, k_rot = fused.rotary(positions, q, k, cos, sin)
    k_two, v_two = (c.clone() for c in caches)
    triton_kernels("kv_cache").store_kv(k_rot, v, k_two, v_two, slots)
    assert torch.equal(q_out, q_two) and torch.equal(k_cache, k_two) and torch.equal(v_cache, v_two)
    # Against the reference, and untouched where no slot points.
    k_ref, v_ref = (c.clone() for c in caches)
    q_ref = kernels.rotary_store_kv_ref(positions, q, k, v, cos, sin, k_ref, v_ref, slots)
    assert_matches(q_out, q_ref)
    assert_matches(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    written = torch.zeros(4 * 16, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.equal(k_cache.view(64, -1)[~written], caches[0].view(64, -1)[~written])


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim", [
    (torch.float32, 9, 3, 64), (torch.bfloat16, 9, 3, 64), (torch.float16, 8, 2, 128), (torch.float32, 3, 1, 48),
])
def test_rotary_store_kv(interpreted, dtype, num_heads, num_kv_heads, head_dim):
    interpreted(check_rotary_store_kv, dtype, num_heads, num_kv_heads, head_dim)


def check_rotary_store_kv_qk_norm(dtype, num_heads, num_kv_heads, head_dim):
    # Qwen3's q/k norm in the same launch: what rms_norm, then rotary and store_kv, would give.
    gen = torch.Generator().manual_seed(head_dim + 1)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = (3 * torch.randn(7, q_size + 2 * kv_size, generator=gen)).to(dtype)
    q, k, v = (t.view(7, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
    weights = [(1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2)]
    norm = (weights[0], weights[1], 1e-6)
    cos, sin = rope_tables(head_dim)
    positions = torch.randint(0, 512, (7,), generator=gen)
    slots = torch.tensor([3, 17, -1, 40, 5, -1, 63])
    caches = [torch.randn(4, 16, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    k_cache, v_cache = (c.clone() for c in caches)
    q_out = triton_kernels("fused").rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots,
                                                    qk_norm=norm)
    k_ref, v_ref = (c.clone() for c in caches)
    q_ref = kernels.rotary_store_kv_ref(positions, q, k, v, cos, sin, k_ref, v_ref, slots, qk_norm=norm)
    for got, want in ((q_out, q_ref), (k_cache, k_ref)):
        if dtype == torch.float32:
            assert_matches(got, want)
        else:  # a last-bit flip of the norm's rounding (its sum runs in another order) carries through RoPE's
            # rounded products: two ulps of the largest value
            tol = 2 * torch.finfo(dtype).eps
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
    assert torch.equal(v_cache, v_ref)  # v is not normalised
    plain = kernels.rotary_store_kv_ref(positions, q, k, v, cos, sin, *(c.clone() for c in caches), slots)
    assert not torch.allclose(plain.float(), q_ref.float(), atol=1e-2)  # the norm changed q
    with pytest.raises(ValueError, match="qk_norm's weights must be contiguous"):
        triton_kernels("fused").rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots,
                                                qk_norm=(weights[0][:-1], weights[1], 1e-6))


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim", [
    (torch.float32, 4, 2, 64), (torch.float16, 8, 2, 128), (torch.float32, 3, 1, 48),
])
def test_rotary_store_kv_qk_norm(interpreted, dtype, num_heads, num_kv_heads, head_dim):
    interpreted(check_rotary_store_kv_qk_norm, dtype, num_heads, num_kv_heads, head_dim)


def check_silu_and_mul(dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    x = torch.randn(5, 2 * inter + 8, generator=gen).to(dtype)[:, 8:]  # strided rows
    assert_matches(triton_kernels("fused").silu_and_mul(x), kernels.silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype,inter", [(torch.float32, 1536), (torch.bfloat16, 1536), (torch.float16, 40),
                                         (torch.bfloat16, 2500)])  # 1536, 2500: several column tiles
def test_silu_and_mul(interpreted, dtype, inter):
    interpreted(check_silu_and_mul, dtype, inter)


def check_empty_batch():
    fused = triton_kernels("fused")
    x, weight = torch.empty(0, 64), torch.ones(64)
    assert fused.rms_norm(x, weight, 1e-6).shape == (0, 64)
    normed, summed = fused.fused_add_rms_norm(x, x, weight, 1e-6)
    assert normed.shape == summed.shape == (0, 64)
    cos, sin = rope_tables(16)
    q_out, k_out = fused.rotary(torch.empty(0, dtype=torch.long), torch.empty(0, 4, 16), torch.empty(0, 2, 16),
                                cos, sin)
    assert q_out.shape == (0, 4, 16) and k_out.shape == (0, 2, 16)
    assert fused.silu_and_mul(torch.empty(0, 96)).shape == (0, 48)


def test_empty_batch(interpreted):
    interpreted(check_empty_batch)


def check_dispatch_when_forced():
    gen = torch.Generator().manual_seed(3)
    x, residual, weight = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen), torch.randn(64)
    q, k = qkv_views(gen, 4, 4, 2, 16, torch.float32)
    cos, sin = rope_tables(16)
    positions = torch.tensor([0, 5, 2, 9])
    fused = triton_kernels("fused")
    os.environ[kernels.BACKEND_ENV] = "triton"
    try:
        assert torch.equal(kernels.rms_norm(x, weight, 1e-6), fused.rms_norm(x, weight, 1e-6))
        for got, want in zip(kernels.fused_add_rms_norm(x, residual, weight, 1e-6),
                             fused.fused_add_rms_norm(x, residual, weight, 1e-6)):
            assert torch.equal(got, want)
        for got, want in zip(kernels.rotary(positions, q, k, cos, sin), fused.rotary(positions, q, k, cos, sin)):
            assert torch.equal(got, want)
        assert torch.equal(kernels.silu_and_mul(x), fused.silu_and_mul(x))
    finally:
        del os.environ[kernels.BACKEND_ENV]


def test_dispatch_when_forced(interpreted):
    interpreted(check_dispatch_when_forced)


def test_dispatch_on_cpu_uses_the_references():
    x, weight = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), kernels.rms_norm_ref(x, weight, 1e-6))
    assert torch.equal(kernels.silu_and_mul(x), kernels.silu_and_mul_ref(x))


def test_bad_shapes_raise():
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cos, sin = rope_tables(16)
    with pytest.raises(ValueError, match="positions"):
        kernels.rotary(torch.zeros(3, dtype=torch.long), q, k, cos, sin)
    with pytest.raises(ValueError, match="even head_dim"):
        kernels.rotary(torch.zeros(2, dtype=torch.long), torch.randn(2, 4, 15), torch.randn(2, 2, 15), cos, sin)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 8).half(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="intermediate"):
        kernels.silu_and_mul(torch.randn(2, 7))
