"""Mixture-of-experts feed-forward: each token through its top-k experts, weighted and summed, in Triton.

Layout (nn.Linear's, out x in): `w13[e]` is expert e's [2I, H] gate projection (rows 0..I-1) stacked on its up
projection (rows I..2I-1), `w2[e]` its [H, I] down projection, `b13` and `b2` their optional biases (GPT-OSS). A token
t and one of its k choices make a pair p = t * k + j, routed to expert `topk_ids[t, j]` with weight
`topk_weights[t, j]`; the output row t is `sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`, where
`expert_e(x) = w2[e] @ act(w13[e] @ x + b13[e]) + b2[e]` and act is silu(gate) * up (Qwen3-MoE), GPT-OSS's clamped
SwiGLU (`activation="swiglu_limit"`) or Gemma 4's GeGLU, gelu_tanh(gate) * up (`activation="gelu_tanh"`).

Algorithm (Triton, as vLLM's fused_moe). Align: the T*k pairs are sorted by expert and each expert's group is padded
to a multiple of BLOCK_M with a sentinel pair (T*k), so every M-block of the sorted list belongs to one expert.
Everything is computed on the device with shapes that depend only on T, k, E and BLOCK_M (the padded length is at most
T*k + min(E, T*k) * (BLOCK_M - 1)), so the whole call is capturable in a CUDA graph; the GEMMs' grids cover that
bound and their programs past the actual padded length (a device scalar) return at once. Then two grouped GEMMs over
the M-blocks, each reading its expert's weight tiles once for up to BLOCK_M pairs: the first gathers x's rows of its
pairs and computes the gate and up tiles of the same columns together, so the activation is its epilogue
([T*k, I] intermediate); the second multiplies the intermediate by w2[e]^T, adds b2 and scales by the pair's routing
weight ([T*k, H]); the k rows of a token are then summed in pair order (deterministic, no atomics).

`fused_moe_ref`, a loop over the experts in use, is the reference, the CPU path and the autograd path. The routing
itself (softmax, top-k, renormalisation) is one kernel too, `route_topk`, beside its reference `route_topk_ref`.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from peagle.kernels import triton_module, use_triton

ACTIVATIONS = ("silu", "swiglu_limit", "gelu_tanh")  # the GEMM kernel's ACTIVATION is the index
ONE_PROGRAM_ALIGN_MAX = 256  # pairs that one program aligns alone (one launch); more: a count kernel first


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {', '.join(ACTIVATIONS)}")


def fused_moe(
    x: torch.Tensor,  # [T, H] bf16/fp16/fp32
    w13: torch.Tensor,  # [E, 2I, H] gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32/int64
    *,
    b13: torch.Tensor | None = None,  # [E, 2I]
    b2: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",  # "silu": silu(gate) * up; "swiglu_limit": GPT-OSS's clamped SwiGLU; "gelu_tanh": GeGLU
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:  # [T, H] in x's dtype
    """The Triton kernels where `use_triton(x.device)` and no gradient is wanted, else the reference."""
    tensors = (x, w13, w2, topk_weights, b13, b2)
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    fn = (triton_module("moe", x.device)._fused_moe_triton if use_triton(x.device) and not wants_grad
          else fused_moe_ref)
    return fn(x, w13, w2, topk_weights, topk_ids, b13=b13, b2=b2, activation=activation, alpha=alpha, limit=limit)


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k]
    *,
    b13: torch.Tensor | None = None,  # [E, 2I]
    b2: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:  # [T, H] in x's dtype
    """PyTorch: one pass per expert in use over the pairs routed to it, as Hugging Face's experts compute it."""
    _check_activation(activation)
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)  # a token that picks e twice appears twice
        gate, up = F.linear(x[token], w13[e], None if b13 is None else b13[e]).chunk(2, dim=-1)
        if activation == "silu":
            h = F.silu(gate) * up
        elif activation == "gelu_tanh":
            h = F.gelu(gate, approximate="tanh") * up
        else:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(gate * alpha)
        y = F.linear(h, w2[e], None if b2 is None else b2[e]) * topk_weights[token, slot, None]
        out = out.index_add(0, token, y.to(x.dtype))
    return out


def experts_touched(topk_ids: torch.Tensor) -> int:  # topk_ids [T, k]
    """How many distinct experts a batch reads (host sync: for reports, not for the serving path)."""
    return int(torch.unique(topk_ids).numel())


class MoeConfig(NamedTuple):
    """The grouped GEMMs' tiling: BLOCK_M pairs of one expert by BLOCK_N outputs, BLOCK_K of the reduction at a time;
    GROUP_M M-blocks share each column of N tiles in launch order (their weight tiles stay in L2). A NamedTuple, not
    a dataclass: the interpreter's private copy of this module (triton_module) is not in sys.modules, which
    dataclasses need."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


CONFIG_DIR = Path(__file__).with_name("moe_configs")  # tuned tilings, written by scripts/device/moe_timing.py


def choose_config(num_tokens: int, num_experts: int, top_k: int, *, hidden: int | None = None,
                  inter: int | None = None, device_name: str | None = None) -> MoeConfig:
    """The tiling tuned for this expert shape on this GPU (CONFIG_DIR's table, its nearest token count) where one
    exists, else by rule: BLOCK_M from the pairs an expert gets on average, 16 (the smallest MMA tile) while they are
    few (decode, and verify over many experts), where a taller tile would be mostly sentinel rows; 64 for prefill."""
    if hidden is not None and inter is not None and device_name is not None:
        table = tuned_configs(num_experts, inter, hidden, device_name)
        if table:
            nearest = min(table, key=lambda t: (abs(t - num_tokens), t))
            return table[nearest]
    per_expert = num_tokens * top_k / num_experts
    if num_tokens <= 16 or per_expert <= 16:
        return MoeConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return MoeConfig(block_m=32, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=4)
    return MoeConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)


def config_file(num_experts: int, inter: int, hidden: int, device_name: str) -> Path:
    """Where the tuned table of an expert shape on a GPU lives: E{experts}-I{inter}-H{hidden}-{GPU name}.json."""
    return CONFIG_DIR / f"E{num_experts}-I{inter}-H{hidden}-{re.sub(r'[^A-Za-z0-9]+', '_', device_name)}.json"


@functools.cache
def tuned_configs(num_experts: int, inter: int, hidden: int, device_name: str) -> dict[int, MoeConfig] | None:
    """{token count: MoeConfig} from the shape's table ({"1": [block_m, block_n, block_k, group_m, num_warps,
    num_stages], ...}); None where none was tuned."""
    path = config_file(num_experts, inter, hidden, device_name)
    if not path.is_file():
        return None
    try:
        return {int(t): MoeConfig(*map(int, c)) for t, c in json.loads(path.read_text()).items()}
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: expected {{\"TOKENS\": [block_m, block_n, block_k, group_m, num_warps, "
                         f"num_stages], ...}} ({e})") from None


@functools.cache
def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


# Routing: softmax over the router's logits, the top k, renormalised; one program a token

def route_topk(
    logits: torch.Tensor,  # [T, E] the router's output, any float dtype
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, k] fp32, expert ids [T, k] int64)
    """The Triton kernel where `use_triton(logits.device)` and no gradient is wanted, else the reference: on the GPU
    one launch in place of the upcast, softmax, top-k, sum and division (five or more a layer at decode)."""
    wants_grad = torch.is_grad_enabled() and logits.requires_grad
    if use_triton(logits.device) and not wants_grad:
        return triton_module("moe", logits.device)._route_topk_triton(logits, top_k, renormalize)
    return route_topk_ref(logits, top_k, renormalize)


def route_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch: softmax in fp32, the top k (ties in torch.topk's order), their weights renormalised to sum to one."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, stride, NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr,
                       TOP_K: tl.constexpr, K: tl.constexpr, RENORMALIZE: tl.constexpr):
    # The k largest probabilities by k passes of a max; among equal ones the lowest expert first.
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EXPERTS)
    x = tl.load(logits_ptr + row * stride + e, mask=e < NUM_EXPERTS, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < NUM_EXPERTS, p, -1.0)
    j = tl.arange(0, K)
    weights = tl.zeros([K], dtype=tl.float32)
    ids = tl.zeros([K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, e, EXPERTS), axis=0)
        weights = tl.where(j == i, best, weights)
        ids = tl.where(j == i, pick, ids)
        p = tl.where(e == pick, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(j < TOP_K, weights, 0.0), axis=0)
    tl.store(weights_ptr + row * TOP_K + j, weights, mask=j < TOP_K)
    tl.store(ids_ptr + row * TOP_K + j, ids.to(tl.int64), mask=j < TOP_K)


def _route_topk_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: expected 1..{num_experts} (the experts)")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens:
        _route_topk_kernel[(num_tokens,)](logits, weights, ids, logits.stride(0), NUM_EXPERTS=num_experts,
                                          EXPERTS=triton.next_power_of_2(num_experts), TOP_K=top_k,
                                          K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize)
    return weights, ids


# Align: pairs sorted by expert, each expert's group padded to a multiple of BLOCK_M

@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, ranks_ptr, num_pairs, BLOCK: tl.constexpr):
    # Each pair's rank among its expert's pairs is the count before its own increment (arrival order: any order of
    # an expert's pairs gives the same results, each output row depending on its own input row only).
    pair = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = pair < num_pairs
    expert = tl.load(ids_ptr + pair, mask=ok, other=0)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=ok, sem="relaxed")
    tl.store(ranks_ptr + pair, rank, mask=ok)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_kernel(ids_ptr, counts_ptr, ranks_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_pairs,
                  NUM_EXPERTS: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                  ONE_PROGRAM: tl.constexpr):
    # Program p places pairs p*BLOCK.. and writes the expert of M-blocks p*BLOCK.. (there are at most num_pairs
    # blocks). ONE_PROGRAM: all pairs are this program's, so it counts and ranks them itself (no count kernel).
    pid = tl.program_id(0)
    e = tl.arange(0, EXPERTS)  # EXPERTS: NUM_EXPERTS to a power of two
    pair = pid * BLOCK + tl.arange(0, BLOCK)
    pair_ok = pair < num_pairs
    expert = tl.load(ids_ptr + pair, mask=pair_ok, other=EXPERTS)  # out of range: in no expert's column
    hit = (expert[:, None] == e[None, :]).to(tl.int32)  # [BLOCK, EXPERTS] one-hot
    if ONE_PROGRAM:
        counts = tl.sum(hit, axis=0)
        rank = tl.sum(hit * (tl.cumsum(hit, axis=0) - 1), axis=1)
    else:
        counts = tl.load(counts_ptr + e, mask=e < NUM_EXPERTS, other=0)
        rank = tl.load(ranks_ptr + pair, mask=pair_ok, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)  # [EXPERTS] each expert's group ends here in the sorted list
    start = end - padded
    tl.store(sorted_ids_ptr + tl.sum(hit * start[None, :], axis=1) + rank, pair, mask=pair_ok)
    total = tl.sum(padded, axis=0)
    block = pid * BLOCK + tl.arange(0, BLOCK)
    owner = tl.sum((end[None, :] <= block[:, None] * BLOCK_M).to(tl.int32), axis=1)  # groups wholly before it
    tl.store(expert_ids_ptr + block, owner, mask=block * BLOCK_M < total)
    if pid == 0:
        tl.store(num_padded_ptr, total)
        # Each expert's padding (fewer than BLOCK_M slots after its pairs) holds the sentinel num_pairs.
        slot = (start + counts)[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [EXPERTS, BLOCK_M]
        tl.store(sorted_ids_ptr + slot, tl.zeros_like(slot) + num_pairs, mask=slot < end[:, None])


def align_pairs(
    topk_ids: torch.Tensor,  # [T, k]
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids [max_blocks * block_m] int32: pair ids grouped by expert, each group padded with the sentinel T*k;
    expert_ids [max_blocks] int32: the expert of each M-block; num_padded [1] int32: the padded length). Entries past
    num_padded are unspecified. max_blocks bounds the blocks for any routing of these shapes, without a host sync."""
    num_pairs = topk_ids.numel()
    max_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    ids = topk_ids.reshape(-1)
    experts = triton.next_power_of_2(num_experts)
    if num_pairs <= ONE_PROGRAM_ALIGN_MAX:
        block = max(16, triton.next_power_of_2(num_pairs))
        _align_kernel[(1,)](ids, ids, ids, sorted_ids, expert_ids, num_padded, num_pairs, NUM_EXPERTS=num_experts,
                            EXPERTS=experts, BLOCK_M=block_m, BLOCK=block, ONE_PROGRAM=True)
    else:
        block = 128
        counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
        ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
        grid = (triton.cdiv(num_pairs, block),)
        _count_kernel[grid](ids, counts, ranks, num_pairs, BLOCK=block)
        _align_kernel[grid](ids, counts, ranks, sorted_ids, expert_ids, num_padded, num_pairs,
                            NUM_EXPERTS=num_experts, EXPERTS=experts, BLOCK_M=block_m, BLOCK=block,
                            ONE_PROGRAM=False)
    return sorted_ids, expert_ids, num_padded


# The grouped GEMMs

@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Triton's interpreter multiplies bf16 operands as raw 16-bit integers; there (UPCAST), multiply their exact fp32
    # values instead, which is what the GPU's bf16 MMA with fp32 accumulation computes.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, bias_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, num_blocks, N, K,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_be, stride_om,
    alpha, limit,
    PAIRS_PER_ROW: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # out[p, n] for the pairs p of one M-block and BLOCK_N columns: a's row p // PAIRS_PER_ROW (x: k pairs a row;
    # the intermediate: one) times w[expert]^T. GATED: w's rows n and N + n are gate and up, out = act(gate, up).
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = pid // group * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_size
    pid_n = (pid % group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    pair_ok = pair < num_pairs  # the sentinel pads
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // PAIRS_PER_ROW)[:, None] * stride_am + kk[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = kk < K - k0
        a = tl.load(a_ptrs, mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += _dot(a, w, DOT_PRECISION, DOT_UPCAST)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up += _dot(a, w_up, DOT_PRECISION, DOT_UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        bias_ptrs = bias_ptr + expert * stride_be + n
        acc += tl.load(bias_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptrs + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACTIVATION == 1:  # swiglu_limit, GPT-OSS's: gate clamped above, up both ways, and up shifted by one
            gate = tl.minimum(acc, limit)
            acc = (tl.minimum(tl.maximum(acc_up, -limit), limit) + 1.0) * gate * tl.sigmoid(gate * alpha)
        elif ACTIVATION == 2:  # gelu_tanh, Gemma's GeGLU: 0.5 x (1 + tanh(y)) = x sigmoid(2y)
            acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)) * acc_up
        else:
            acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + pair, mask=pair_ok, other=0.0)[:, None]
    tl.store(out_ptr + pair[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=pair_ok[:, None] & n_ok[None, :])


def moe_gemm(
    a: torch.Tensor,  # [rows, K]: x (rows T, k pairs a row) or the intermediate (rows T*k)
    w: torch.Tensor,  # [E, N, K], or [E, 2N, K] gate then up when gated
    bias: torch.Tensor | None,  # [E, N] or [E, 2N]
    out: torch.Tensor,  # [>= T*k, N], row p receives pair p; rows of no pair are not written
    weights: torch.Tensor | None,  # [T*k] fp32: scale row p by weights[p]
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # align_pairs' answer
    num_pairs: int,
    config: MoeConfig,
    *,
    pairs_per_row: int,  # pairs that read one row of a: k for x, 1 for the intermediate
    gated: bool,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> None:
    """One grouped GEMM of the fused MoE over the aligned pairs (both of `_fused_moe_triton`'s steps)."""
    sorted_ids, expert_ids, num_padded = aligned
    n, k = out.shape[1], a.shape[1]
    num_blocks = expert_ids.numel()
    grid = (num_blocks * triton.cdiv(n, config.block_n),)
    _moe_gemm_kernel[grid](
        a, w, bias if bias is not None else w, out, weights if weights is not None else w,
        sorted_ids, expert_ids, num_padded, num_pairs, num_blocks, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0, out.stride(0), alpha, limit,
        PAIRS_PER_ROW=pairs_per_row, GATED=gated,
        ACTIVATION=ACTIVATIONS.index(activation), HAS_BIAS=bias is not None, MUL_WEIGHTS=weights is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", DOT_UPCAST=a.device.type != "cuda",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def _fused_moe_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k]
    *,
    b13: torch.Tensor | None = None,  # [E, 2I]
    b2: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    config: MoeConfig | None = None,  # None: choose_config's
) -> torch.Tensor:  # [T, H] in x's dtype
    """Triton: align, gate/up GEMM with the activation, down GEMM with the routing weights, sum over k."""
    _check_activation(activation)
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"the experts' weights ({w13.dtype}, {w2.dtype}) must have x's dtype ({x.dtype})")
    (num_tokens, hidden), (num_experts, inter2, _), top_k = x.shape, w13.shape, topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    config = config or choose_config(num_tokens, num_experts, top_k, hidden=hidden, inter=inter2 // 2,
                                     device_name=gpu_name(x.device))
    aligned = align_pairs(topk_ids, num_experts, config.block_m)
    act = torch.empty(num_pairs, inter2 // 2, dtype=x.dtype, device=x.device)  # [T*k, I]
    moe_gemm(x, w13, b13, act, None, aligned, num_pairs, config, pairs_per_row=top_k, gated=True,
             activation=activation, alpha=alpha, limit=limit)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T*k, H], row p: pair p's weighted output
    moe_gemm(act, w2, b2, out, topk_weights.reshape(-1).float(), aligned, num_pairs, config, pairs_per_row=1,
             gated=False)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
