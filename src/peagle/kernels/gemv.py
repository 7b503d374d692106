"""Small-batch linear layers (decode): y = x @ W^T + b for a few rows, as a split-K GEMV in Triton.

At batch 1..8 a decoder layer's four projections are matrix-vector products that read the whole weight once, and
cuBLAS's GEMM kernels for them are latency-bound (3.7-3.9 us each at SmolLM2-135M's sizes on an H200, for a few MB
read). Here one program computes a [BLOCK_M, BLOCK_N] tile of y over a 1/SPLIT_K slice of the reduction, so even a
narrow layer spreads over enough programs to keep the memory system busy. With SPLIT_K > 1 the programs write fp32
partial sums and a second kernel adds them (and the bias) in order; SPLIT_K = 1 writes y directly. Rows are padded
to BLOCK_M = 16 inside the kernel (the smallest tile tl.dot takes), so any M works, but the kernel only pays for
M <= 8, where the engine uses it (`GemvLinear`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from peagle.kernels import pdl

MAX_GEMV_ROWS = 8  # GemvLinear's rows at most; more go to cuBLAS
MIN_SPLIT_BLOCKS = 8  # split-K only for a reduction of at least this many BLOCK_K


def linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    return F.linear(x, weight, bias)


def silu_and_mul_gemv(
    x: torch.Tensor,  # [M, 2K]: gate then up
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N]
    """Triton: `gemv(silu_and_mul(x), weight, bias)` in one kernel (two with split-K), bit for bit."""
    return gemv(x, weight, bias, silu_and_mul=True)


@triton.jit
def _norm_input(x_ptr, res_ptr, nw_ptr, m, k, M, K, stride_xm, stride_rm, inv_rms, ADD: tl.constexpr):
    """The GEMV's input tile [BLOCK_M, BLOCK_K] of rms_norm(x (+ residual)), rounded as fused.rms_norm rounds it."""
    ok = (m[:, None] < M) & (k[None, :] < K)
    x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=ok, other=0.0)
    s = x.to(tl.float32)
    if ADD:
        r = tl.load(res_ptr + m[:, None] * stride_rm + k[None, :], mask=ok, other=0.0).to(tl.float32)
        s = (s + r).to(x.dtype).to(tl.float32)
    normed = (s * inv_rms[:, None]).to(x.dtype).to(tl.float32)
    weight = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    return (weight[None, :] * normed).to(x.dtype), s


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
    res_ptr, nw_ptr, sum_ptr, stride_rm, eps,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr, SILU_AND_MUL: tl.constexpr,
    NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr, ONE_TILE: tl.constexpr,
):
    # NORM: 0, x as it is; 1, rms_norm(x) with weight nw; 2, the same of x + residual, whose sum (x's dtype) the
    # programs of the first column of N tiles write to sum_ptr, each its slice of the reduction.
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # The weight tiles are read one ahead of their use; the first before waiting for the kernel before (weights are
    # never written while the model runs), so under programmatic dependent launch it loads while that one finishes.
    # ONE_TILE: the slice is one tile (k_per_split == BLOCK_K): all of this program's weights load before the wait.
    w_rows = w_ptr + n[:, None] * stride_wn
    w = tl.load(w_rows + (k_lo + kk)[None, :], mask=(n[:, None] < N) & ((k_lo + kk)[None, :] < k_hi), other=0.0)
    if USE_PDL:  # programmatic dependent launch (kernels/pdl.py): nothing else is touched before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM > 0:  # every program reads its rows whole for their mean square (a few KB at decode sizes), in tiles of
        # NORM_BLOCK: at the testbed's K = 576 one load instead of one per BLOCK_K, each a round trip to memory
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            k = k0 + tl.arange(0, NORM_BLOCK)
            ok = (m[:, None] < M) & (k[None, :] < K)
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=ok, other=0.0)
            s = x.to(tl.float32)
            if NORM == 2:
                r = tl.load(res_ptr + m[:, None] * stride_rm + k[None, :], mask=ok, other=0.0).to(tl.float32)
                s = (s + r).to(x.dtype).to(tl.float32)
            squares += tl.sum(s * s, axis=1)
        inv_rms = tl.rsqrt(squares / K + eps)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k = k0 + kk
        x_ok = (m[:, None] < M) & (k[None, :] < K)
        if NORM > 0:
            x, s = _norm_input(x_ptr, res_ptr, nw_ptr, m, k, M, K, stride_xm, stride_rm, inv_rms, NORM == 2)
            if NORM == 2:
                if pid_n == 0:
                    tl.store(sum_ptr + m[:, None] * K + k[None, :], s.to(x.dtype), mask=x_ok)
        else:
            x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=x_ok, other=0.0)
        if SILU_AND_MUL:  # x's rows are [gate | up], K wide each: the input is silu(gate) * up, rounded as
            # fused.silu_and_mul rounds it (silu's output, then the product, to x's dtype)
            up = tl.load(x_ptr + m[:, None] * stride_xm + K + k[None, :], mask=x_ok, other=0.0).to(tl.float32)
            gate = x.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(x.dtype).to(tl.float32)
            x = (act * up).to(x.dtype)
        w_now = w
        if not ONE_TILE:
            k_next = k + BLOCK_K  # the next tile of this slice, if any
            w = tl.load(w_rows + k_next[None, :], mask=(n[:, None] < N) & (k_next[None, :] < k_hi), other=0.0)
        if IEEE:  # fp32 inputs, or bf16 under the CPU interpreter (whose bf16 dot is wrong): exact fp32 products
            # [BLOCK_M, BLOCK_N]
            acc += tl.dot(x.to(tl.float32), tl.trans(w_now.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w_now))
    ok = (m[:, None] < M) & (n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + (pid_k * M + m[:, None]) * N + n[None, :], acc, mask=ok)


@triton.jit(do_not_specialize=["M"])
def _split_sum_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch (kernels/pdl.py): nothing is touched before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # in split order: the same sum on every run
        acc += tl.load(part_ptr + s * M * N + idx, mask=ok, other=0.0)
    m, n = idx // N, idx % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=ok)


NORM_TILE_MAX = 1024  # the norm's tile of a row at most ([16, 1024] fp32 in registers: 128 a thread at 4 warps)


def norm_block(k: int) -> int:
    """The tile in which a GEMV with the norm inside reads its rows for their mean square: the whole row up to
    NORM_TILE_MAX (one load at decode sizes, where each load is a round trip), else tiles of that size."""
    return min(triton.next_power_of_2(k), NORM_TILE_MAX)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_split_k(n: int, k: int, device: torch.device, block_n: int = 32, block_k: int = 128) -> int:
    """Enough K slices that the programs cover the SMs about twice, each slice at least two BLOCK_K wide; none
    below MIN_SPLIT_BLOCKS * BLOCK_K of reduction, where the second kernel costs more than the spread gains (timed
    on an H200 at the testbed's shapes: docs/DECISIONS.md)."""
    if k < MIN_SPLIT_BLOCKS * block_k:
        return 1
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    programs = triton.cdiv(n, block_n)
    want = triton.cdiv(2 * sms, programs)
    return max(1, min(want, k // (2 * block_k), 16))


SHORT_K_TILING = (16, 256)  # (BLOCK_N, BLOCK_K) for a reduction too short to split (K < MIN_SPLIT_BLOCKS * 128)
WARPS4_TILE_MAX = 16 * 256  # weight tiles of more elements run on 8 warps (fewer registers a thread)


def choose_tiling(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, split-K) for a weight of [n, k]. Every program reads its weight tiles one after another,
    and with the weights out of the L2 cache (as a model's layers meet them) each read is a round trip to memory,
    so a short reduction wants few, wide tiles (16 x 256 at the testbed's K = 576). A longer one keeps 32 x 128 tiles
    and choose_split_k's slices (at K = 1536 the best of a tiling sweep: docs/DECISIONS.md)."""
    if k < MIN_SPLIT_BLOCKS * 128:
        return (*SHORT_K_TILING, 1)
    return 32, 128, choose_split_k(n, k, device)


def gemv(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    split_k: int | None = None,  # None: choose_tiling's (with block_n and block_k given: choose_split_k's)
    block_n: int | None = None,  # None: choose_tiling's
    block_k: int | None = None,  # None: choose_tiling's
    silu_and_mul: bool = False,  # x is [M, 2K], gate then up: y = silu(gate) * up @ W^T + b, one kernel fewer
    norm: tuple[torch.Tensor, float] | None = None,  # (weight [K], eps): y = rms_norm(x) @ W^T + b
    residual: torch.Tensor | None = None,  # [M, K], with norm: y = rms_norm(x + residual) @ W^T + b
    summed: torch.Tensor | None = None,  # [M, K], with residual: receives x + residual in x's dtype
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    if silu_and_mul:
        assert k % 2 == 0 and norm is None, x.shape
        k //= 2
    n = weight.shape[0]
    assert weight.shape[1] == k and x.dtype == weight.dtype, (x.shape, x.dtype, weight.shape, weight.dtype)
    assert (residual is None) == (summed is None) and (norm is not None or residual is None)
    if residual is not None:
        assert residual.shape == summed.shape == x.shape and residual.dtype == summed.dtype == x.dtype
        assert residual.stride(1) == 1 and summed.is_contiguous(), (residual.stride(), summed.stride())
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if block_n is None or block_k is None:
        tiled_n, tiled_k, tiled_split = choose_tiling(n, k, x.device)
        block_n, block_k = block_n or tiled_n, block_k or tiled_k
        split = split_k or (tiled_split if (block_n, block_k) == (tiled_n, tiled_k) else None)
    else:
        split = split_k
    split = split or choose_split_k(n, k, x.device, block_n, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty slices
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.device.type != "cuda")
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    b = bias if bias is not None else y
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, 16))
    norm_weight, eps = norm if norm is not None else (y, 0.0)
    assert norm is None or norm_weight.shape == (k,), (norm_weight.shape, k)
    res, out_sum = (residual, summed) if residual is not None else (y, y)
    _gemv_kernel[grid](x, weight, b, y, part, m, n, k, x.stride(0), weight.stride(0), y.stride(0), k_per_split,
                       res, norm_weight.contiguous(), out_sum, res.stride(0), eps,
                       HAS_BIAS=bias is not None, SPLIT_K=split, IEEE=ieee, SILU_AND_MUL=silu_and_mul,
                       NORM=0 if norm is None else 1 if residual is None else 2,
                       BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, NORM_BLOCK=norm_block(k),
                       ONE_TILE=k_per_split == block_k, num_warps=4 if block_n * block_k <= WARPS4_TILE_MAX else 8,
                       **pdl.options(x.device))
    if split > 1:
        block = 256
        _split_sum_kernel[(triton.cdiv(m * n, block),)](part, b, y, m, n, y.stride(0), HAS_BIAS=bias is not None,
                                                         SPLIT_K=split, BLOCK=block, **pdl.options(x.device))
    return y


def rms_norm_gemv(
    x: torch.Tensor,  # [M, K]
    residual: torch.Tensor | None,  # [M, K] or None
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # y [M, N], x + residual [M, K] (None without residual)
    """Triton: `gemv(rms_norm(x (+ residual)), weight, bias)` in one kernel (two with split-K), and the sum, as
    `fused.fused_add_rms_norm` then `gemv` give them (the same roundings; the mean square summed in another
    order, so the normed input may differ from the two-kernel path's in its last bit)."""
    summed = None if residual is None else torch.empty_like(x)
    y = gemv(x, weight, bias, norm=(norm_weight, eps), residual=residual, summed=summed)
    return y, summed


class GemvLinear(nn.Linear):
    """nn.Linear whose inference calls with at most MAX_GEMV_ROWS rows go to `peagle.kernels.linear` (the GEMV
    kernel on Triton's path, cuBLAS otherwise); training, and larger batches, run nn.Linear's own forward.
    `takes(x)` says which; the MLP then hands its down projection the gate and up halves whole
    (`peagle.kernels.silu_and_mul_linear`)."""

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        return not torch.is_grad_enabled() and x.dim() == 2 and x.shape[0] <= MAX_GEMV_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.takes(x):
            return super().forward(x)
        from peagle import kernels

        return kernels.linear(x, self.weight, self.bias)


def use_gemv_linears(model: nn.Module) -> int:
    """Turn every nn.Linear inside `model` into a GemvLinear in place (same parameters); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = GemvLinear
            count += 1
    return count
