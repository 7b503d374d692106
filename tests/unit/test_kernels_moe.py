"""The fused mixture-of-experts: the reference equals a per-token loop and Hugging Face's Qwen3-MoE and GPT-OSS blocks,
and the Triton kernels, run by Triton's interpreter, equal the reference (fp32 to 1e-5) for any routing: experts with
no pair, a token picking one expert twice, pair counts off the block size, biases, both activations."""

from __future__ import annotations

import json

import pytest
import torch
from test_kernels_triton import interpreted, triton_kernels  # noqa: F401 (a fixture, and the interpreted module)

import peagle.kernels as kernels
from peagle.kernels import moe

# bf16: four ulps, relative and absolute; the interpreter rounds fp32 to bf16 by truncation (the GPU to nearest even).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2**-6}


def make_case(seed, num_tokens, num_experts, top_k, hidden, inter, *, activation="silu", bias=False,
              repeats=False, experts_used=None, dtype=torch.float32, device="cpu"):
    """fused_moe's arguments: random experts scaled so the pre-activations reach past GPT-OSS's limit of 7 now and
    then, and a routing of distinct experts per token (repeats: drawn with replacement) among `experts_used`."""
    gen = torch.Generator(device).manual_seed(seed)
    used = torch.arange(num_experts, device=device) if experts_used is None else torch.tensor(experts_used,
                                                                                             device=device)
    if repeats:
        pick = torch.randint(len(used), (num_tokens, top_k), generator=gen, device=device)
    else:
        pick = torch.rand(num_tokens, len(used), generator=gen, device=device).argsort(dim=-1)[:, :top_k]
    args = dict(
        x=torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype),
        w13=(3 * torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5).to(dtype),
        w2=(torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter**0.5).to(dtype),
        topk_weights=torch.randn(num_tokens, top_k, generator=gen, device=device).softmax(dim=-1),
        topk_ids=used[pick].to(torch.int32),
        activation=activation,
    )
    if bias:
        args["b13"] = torch.randn(num_experts, 2 * inter, generator=gen, device=device).to(dtype)
        args["b2"] = torch.randn(num_experts, hidden, generator=gen, device=device).to(dtype)
    return args


def per_token_moe(x, w13, w2, topk_weights, topk_ids, *, b13=None, b2=None, activation="silu", alpha=1.702,
                  limit=7.0):
    """The definition, one token and one choice at a time."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for j, e in enumerate(topk_ids[t].tolist()):
            h = w13[e] @ x[t] + (0 if b13 is None else b13[e])
            gate, up = h[:inter], h[inter:]
            if activation == "silu":
                a = gate * torch.sigmoid(gate) * up
            elif activation == "gelu_tanh":
                a = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
            else:
                gate, up = torch.clamp(gate, max=limit), torch.clamp(up, -limit, limit)
                a = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] += topk_weights[t, j] * (w2[e] @ a + (0 if b2 is None else b2[e]))
    return out


def upcast(case):
    """The case in fp32: bf16 results are compared with the fp32 reference of the same values (more exact than the
    bf16 reference, which rounds each step)."""
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in case.items()}


def assert_close(got, want):
    """got == want within the tolerance of got's dtype (want may be the fp32 reference of a bf16 result). In bf16 the
    absolute part scales with the largest output: the k rounded terms of a small sum may be that large."""
    assert got.shape == want.shape
    tol = TOLERANCE[got.dtype]
    scale = want.abs().max().item() if got.dtype == torch.bfloat16 else 1.0
    torch.testing.assert_close(got.double(), want.double(), atol=tol * scale, rtol=tol)


# The reference

@pytest.mark.parametrize("activation,bias,repeats", [("silu", False, False), ("swiglu_limit", True, True),
                                                    ("gelu_tanh", False, True)])
def test_reference_equals_per_token_loop(activation, bias, repeats):
    case = make_case(0, 9, 8, 3, 24, 20, activation=activation, bias=bias, repeats=repeats, experts_used=[0, 2, 5, 7])
    case = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in case.items()}
    assert_close(moe.fused_moe_ref(**case), per_token_moe(**case))


def test_reference_equals_qwen3_moe_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 11, 32)
    with torch.no_grad():
        want = block(x)[0]
        # Qwen3-MoE's routing: softmax over all experts, top k, renormalised over the k.
        probs = torch.softmax(x[0] @ block.gate.weight.T, dim=-1)
        weights, ids = torch.topk(probs, 3, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # transformers 5 stores the experts fused as [E, 2I, H] (gate rows, then up rows) and [E, H, I]: our layout.
        got = moe.fused_moe_ref(x[0], block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    assert_close(got, want)


def test_reference_equals_gpt_oss_mlp():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=4)
    torch.manual_seed(0)
    mlp = GptOssMLP(config)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=1.0)  # pre-activations well past the limit of 7
    x = torch.randn(1, 11, 32)
    experts = mlp.experts
    with torch.no_grad():
        want = mlp(x)[0][0]
        # GPT-OSS's routing: top k of the router's logits (with bias), softmax over the k.
        logits, ids = torch.topk(torch.nn.functional.linear(x[0], mlp.router.weight, mlp.router.bias), 4, dim=-1)
        weights = torch.softmax(logits, dim=-1)
        # GPT-OSS stores gate_up_proj as [E, H, 2I] with gate and up columns interleaved, down_proj as [E, I, H].
        gate_up, gate_up_bias = experts.gate_up_proj, experts.gate_up_proj_bias
        w13 = torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
        b13 = torch.cat([gate_up_bias[:, ::2], gate_up_bias[:, 1::2]], dim=-1)
        got = moe.fused_moe_ref(x[0], w13, experts.down_proj.transpose(1, 2), weights, ids, b13=b13,
                                b2=experts.down_proj_bias, activation="swiglu_limit", alpha=experts.alpha,
                                limit=experts.limit)
    assert (w13 @ x[0].T).abs().max() > 7  # the clamps were exercised
    assert_close(got, want)


def test_reference_is_differentiable():
    case = make_case(1, 4, 4, 2, 8, 6, activation="swiglu_limit", bias=True, dtype=torch.float64)
    case["topk_weights"] = case["topk_weights"].double()
    names = ("x", "w13", "w2", "topk_weights", "b13", "b2")
    inputs = tuple(case[n].requires_grad_() for n in names)
    rest = {k: v for k, v in case.items() if k not in names}
    assert torch.autograd.gradcheck(lambda *t: moe.fused_moe_ref(**dict(zip(names, t)), **rest), inputs)


def test_dispatch_takes_the_reference_under_autograd(monkeypatch):
    # PEAGLE_KERNELS=triton on CPU tensors would need the interpreter; with a gradient wanted it is never reached.
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_case(2, 3, 4, 2, 16, 8)
    case["x"].requires_grad_()
    out = moe.fused_moe(**case)
    out.sum().backward()
    assert case["x"].grad is not None
    with torch.no_grad(), pytest.raises(ValueError, match="TRITON_INTERPRET"):
        moe.fused_moe(**case)


def test_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        moe.fused_moe_ref(**{**make_case(0, 2, 4, 1, 8, 8), "activation": "gelu"})


def test_experts_touched():
    assert moe.experts_touched(torch.tensor([[3, 1], [1, 7], [3, 3]])) == 3


def test_choose_config_takes_a_tuned_table_for_its_shape_and_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(moe, "CONFIG_DIR", tmp_path)
    moe.tuned_configs.cache_clear()
    path = moe.config_file(128, 768, 2048, "NVIDIA H100 80GB HBM3")
    assert path.name == "E128-I768-H2048-NVIDIA_H100_80GB_HBM3.json"
    path.write_text(json.dumps({"1": [16, 32, 256, 1, 4, 5], "64": [16, 64, 128, 1, 4, 4], "512": [64, 128, 64, 8, 8, 3]}))
    shape = dict(hidden=2048, inter=768, device_name="NVIDIA H100 80GB HBM3")
    assert moe.choose_config(1, 128, 8, **shape) == moe.MoeConfig(16, 32, 256, 1, 4, 5)
    assert moe.choose_config(40, 128, 8, **shape) == moe.MoeConfig(16, 64, 128, 1, 4, 4)  # the nearest count
    assert moe.choose_config(4096, 128, 8, **shape) == moe.MoeConfig(64, 128, 64, 8, 8, 3)
    # another GPU or shape, or no shape given: the rule
    assert moe.choose_config(1, 128, 8, hidden=2048, inter=768, device_name="NVIDIA H200") == moe.choose_config(1, 128, 8)
    assert moe.choose_config(1, 128, 8, hidden=2880, inter=768, device_name="NVIDIA H100 80GB HBM3").block_k == 128
    moe.config_file(32, 2880, 2880, "X").write_text('{"1": [16, 32]}')
    with pytest.raises(ValueError, match="E32-I2880-H2880-X.json: expected"):
        moe.choose_config(1, 32, 4, hidden=2880, inter=2880, device_name="X")
    moe.tuned_configs.cache_clear()


def test_choose_config_block_m_follows_pairs_per_expert():
    assert moe.choose_config(1, 128, 8).block_m == 16  # decode
    assert moe.choose_config(64, 128, 8).block_m == 16  # verify over many experts: 4 pairs an expert
    assert moe.choose_config(4096, 32, 4).block_m == 64  # prefill


# The Triton kernels

def check_align(num_tokens, num_experts, top_k, block_m, experts_used):
    ids = make_case(num_tokens, num_tokens, num_experts, top_k, 8, 8, experts_used=experts_used)["topk_ids"]
    sorted_ids, expert_ids, num_padded = triton_kernels("moe").align_pairs(ids, num_experts, block_m)
    num_pairs = ids.numel()
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(num_padded) == int(padded.sum()) and len(sorted_ids) >= int(num_padded)
    placed = sorted_ids[: int(num_padded)].view(-1, block_m)  # [blocks, block_m]
    real = placed < num_pairs
    assert sorted(placed[real].tolist()) == list(range(num_pairs))  # every pair once
    assert torch.equal(placed[~real], torch.full_like(placed[~real], num_pairs))  # the rest: the sentinel
    block_experts = expert_ids[: len(placed)].long()
    assert torch.equal(block_experts, torch.arange(num_experts).repeat_interleave(padded // block_m))  # sorted
    assert torch.equal(ids.flatten()[placed[real].long()], block_experts[:, None].expand_as(placed)[real])


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m,experts_used", [
    (1, 128, 8, 16, None),  # decode at Qwen3-MoE's routing: E above the pairs
    (37, 8, 3, 16, [1, 2, 6]),  # one program; experts without pairs
    (100, 6, 4, 32, None),  # 400 pairs: counted by the count kernel first, E not a power of two
])
def test_align(interpreted, num_tokens, num_experts, top_k, block_m, experts_used):
    interpreted(check_align, num_tokens, num_experts, top_k, block_m, experts_used)


def check_fused_moe(num_tokens, num_experts, top_k, hidden, inter, kwargs, config):
    case = make_case(num_tokens * num_experts + top_k, num_tokens, num_experts, top_k, hidden, inter, **kwargs)
    config = None if config is None else moe.MoeConfig(*config)
    got = triton_kernels("moe")._fused_moe_triton(**case, config=config)
    assert got.dtype == case["x"].dtype
    assert_close(got, moe.fused_moe_ref(**upcast(case)))


FUSED_MOE_CASES = [  # (num_tokens, num_experts, top_k, hidden, inter, make_case's options, MoeConfig or None)
    (1, 4, 1, 32, 16, {}, None),
    (1, 8, 4, 48, 40, {"activation": "swiglu_limit", "bias": True}, None),
    (3, 8, 2, 32, 24, {"bias": True}, (16, 16, 16)),  # 6 pairs in tiles off H and I
    (8, 4, 4, 32, 16, {"activation": "swiglu_limit", "repeats": True}, (16, 16, 32)),
    (8, 8, 2, 32, 16, {"repeats": True, "experts_used": [0, 3]}, None),
    (37, 8, 4, 48, 40, {"activation": "swiglu_limit", "bias": True}, (32, 32, 16, 2)),
    (37, 4, 2, 32, 16, {"experts_used": [1, 3]}, None),
    (70, 8, 4, 32, 24, {"bias": True}, (32, 16, 32, 4)),  # 280 pairs: the count kernel's alignment
    (5, 4, 2, 64, 32, {"activation": "swiglu_limit", "bias": True, "dtype": torch.bfloat16}, None),
    (9, 4, 2, 32, 24, {"activation": "gelu_tanh"}, None),  # Gemma 4's GeGLU experts
    (6, 8, 3, 64, 32, {"activation": "gelu_tanh", "dtype": torch.bfloat16}, (16, 16, 32)),
]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,kwargs,config", FUSED_MOE_CASES)
def test_fused_moe(interpreted, num_tokens, num_experts, top_k, hidden, inter, kwargs, config):
    interpreted(check_fused_moe, num_tokens, num_experts, top_k, hidden, inter, kwargs, config)


def shipped_tilings() -> list[tuple[int, ...]]:
    """Every distinct tiling of the tuned tables shipped in kernels/moe_configs, each file read as choose_config
    reads it (its name gives its shape)."""
    tilings = set()
    for path in sorted(moe.CONFIG_DIR.glob("*.json")):
        experts, inter, hidden = (int(x[1:]) for x in path.stem.split("-")[:3])
        gpu = path.stem.split("-", 3)[3]
        assert moe.config_file(experts, inter, hidden, gpu).name == path.name
        moe.tuned_configs.cache_clear()
        table = moe.tuned_configs(experts, inter, hidden, gpu)
        assert table and all(t >= 1 for t in table), path
        tilings |= {tuple(c) for c in table.values()}
    moe.tuned_configs.cache_clear()
    return sorted(tilings)


def test_shipped_tilings_run(interpreted):
    tilings = shipped_tilings()
    assert tilings  # the H100 tables measured in run 35
    for tiling in tilings:  # tiles wider than the shape are masked, as at a decode step's few pairs
        interpreted(check_fused_moe, 5, 4, 2, 64, 32, {"dtype": torch.bfloat16}, tiling)


def check_strided_input_and_dispatch():
    case = make_case(3, 6, 4, 2, 32, 16, bias=True)
    wide = torch.randn(6, 48)
    wide[:, 16:] = case["x"]
    case["x"] = wide[:, 16:]  # a row stride wider than the row
    ref = moe.fused_moe_ref(**case)
    assert_close(triton_kernels("moe")._fused_moe_triton(**case), ref)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(kernels.BACKEND_ENV, "triton")
        assert_close(moe.fused_moe(**case), ref)
    empty = {**case, "x": case["x"][:0], "topk_weights": case["topk_weights"][:0], "topk_ids": case["topk_ids"][:0]}
    assert triton_kernels("moe")._fused_moe_triton(**empty).shape == (0, 32)


def test_strided_input_and_dispatch(interpreted):
    interpreted(check_strided_input_and_dispatch)


def check_padding_never_writes():
    # Rows past the pairs are where a sentinel pad would land (row T*k); they keep their NaN.
    m = triton_kernels("moe")
    case = make_case(4, 5, 4, 2, 32, 16, bias=True)
    num_pairs, config = 10, m.MoeConfig(16, 16, 16)
    aligned = m.align_pairs(case["topk_ids"], 4, config.block_m)
    act = torch.full((num_pairs + 16, 16), float("nan"))
    m.moe_gemm(case["x"], case["w13"], case["b13"], act, None, aligned, num_pairs, config, pairs_per_row=2,
               gated=True)
    assert not act[:num_pairs].isnan().any() and act[num_pairs:].isnan().all()
    out = torch.full((num_pairs + 16, 32), float("nan"))
    m.moe_gemm(act, case["w2"], case["b2"], out, case["topk_weights"].flatten(), aligned, num_pairs, config,
               pairs_per_row=1, gated=False)
    assert not out[:num_pairs].isnan().any() and out[num_pairs:].isnan().all()
    assert_close(out[:num_pairs].view(5, 2, 32).sum(1), moe.fused_moe_ref(**case))


def test_padding_never_writes(interpreted):
    interpreted(check_padding_never_writes)


# The routing kernel

def check_route_topk(num_tokens, num_experts, top_k, renormalize, dtype):
    gen = torch.Generator().manual_seed(num_tokens * num_experts + top_k)
    logits = (3 * torch.randn(num_tokens, num_experts + 3, generator=gen))[:, 3:].to(dtype)  # a wider row stride
    weights, ids = triton_kernels("moe")._route_topk_triton(logits, top_k, renormalize)
    want_weights, want_ids = moe.route_topk_ref(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (num_tokens, top_k)
    assert torch.equal(ids, want_ids)  # random logits: no ties
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize,dtype", [
    (1, 128, 8, True, torch.float32),  # Qwen3-MoE's decode
    (9, 32, 4, True, torch.bfloat16),  # GPT-OSS's routing from bf16 logits
    (5, 6, 2, False, torch.float32),  # experts not a power of two, no renormalisation
    (3, 8, 8, True, torch.float32),  # every expert chosen
])
def test_route_topk(interpreted, num_tokens, num_experts, top_k, renormalize, dtype):
    interpreted(check_route_topk, num_tokens, num_experts, top_k, renormalize, dtype)


def check_route_topk_ties_and_dispatch():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0, 5.0]])
    weights, ids = triton_kernels("moe")._route_topk_triton(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]  # equal probabilities: the lowest expert first
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match="top_k=6"):
        triton_kernels("moe")._route_topk_triton(logits, 6, True)
    assert triton_kernels("moe")._route_topk_triton(logits[:0], 2, True)[1].shape == (0, 2)
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    with pytest.MonkeyPatch.context() as env:
        env.setenv(kernels.BACKEND_ENV, "triton")
        got = moe.route_topk(logits, 4, True)
        graded = moe.route_topk(logits.clone().requires_grad_(), 4, True)  # autograd: the reference
    want = moe.route_topk_ref(logits, 4, True)
    assert torch.equal(got[1], want[1]) and torch.equal(graded[1], want[1])
    assert graded[0].requires_grad


def test_route_topk_ties_and_dispatch(interpreted):
    interpreted(check_route_topk_ties_and_dispatch)
