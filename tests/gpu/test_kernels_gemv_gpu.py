"""The decode-path kernels on CUDA: the small-batch GEMV at the decoder projections of SmolLM2-135M and
Llama-3.1-8B, equal to cuBLAS's output (F.linear) within rounding, with and without split-K, and replayable from a
CUDA graph, and with the MLP's activation or the layer's add + RMSNorm fused in; async scheduling's input advance equal to its reference; and the engine's greedy output with the GEMV
and async scheduling each on and off (CUDA graphs on). Timing against cuBLAS: scripts/device/gemv_timing.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import peagle.kernels as kernels
from peagle.kernels import gemv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
# (N, K) of qkv_proj, o_proj, gate_up_proj, down_proj
SHAPES = {
    "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
    "llama-3.1-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def operands(n, k, m, dtype, bias=False, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=CUDA).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=CUDA) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=CUDA).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_silu_and_mul_gemv_equals_the_two_kernels(model):
    """The MLP's activation inside the down projection's GEMV: bit for bit the activation kernel, then the GEMV."""
    from peagle.kernels import fused

    n, k = SHAPES[model][3]
    for m in (1, 8):
        gate_up, w, _ = operands(n, 2 * k, m, torch.bfloat16, seed=m)
        w = w[:, :k].contiguous()
        for split_k in (None, 1):
            want = gemv.gemv(fused.silu_and_mul(gate_up), w, split_k=split_k)
            assert torch.equal(gemv.gemv(gate_up, w, split_k=split_k, silu_and_mul=True), want), (model, m, split_k)


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_rms_norm_gemv_equals_the_two_kernels(model):
    """The decoder layer's add + RMSNorm inside the next projection's GEMV (qkv and gate_up): the stream bit for
    bit the add's, the output within rounding of the norm kernel then the GEMV."""
    from peagle.kernels import fused

    for n, k in (SHAPES[model][0], SHAPES[model][2]):
        for m in (1, 8):
            x, w, _ = operands(n, k, m, torch.bfloat16, seed=m)
            res, nw, _ = operands(k, k, m, torch.bfloat16, seed=m + 1)
            nw = 1 + nw[0] / 8
            h, want_sum = fused.fused_add_rms_norm(x, res, nw, 1e-5)
            for split_k in (None, 1):
                want = gemv.gemv(h, w, split_k=split_k)
                summed = torch.empty_like(x)
                got = gemv.gemv(x, w, split_k=split_k, norm=(nw, 1e-5), residual=res, summed=summed)
                assert torch.equal(summed, want_sum), (model, n, k, m, split_k)
                torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_gemv_equals_cublas(model, dtype):
    tol = TOLERANCE[dtype]
    for i, (n, k) in enumerate(SHAPES[model]):
        x_all, w, b = operands(n, k, 64, dtype, bias=i == 0, seed=i)
        for m in (1, 3, 8, 64):
            x = x_all[:m]
            want = F.linear(x, w, b)  # cuBLAS
            exact = F.linear(x.double(), w.double(), None if b is None else b.double())
            for split_k in (None, 1):
                got = gemv.gemv(x, w, b, split_k=split_k)
                torch.testing.assert_close(got.double(), exact, atol=tol, rtol=tol)
                # No worse than cuBLAS's own rounding, up to what fp32 accumulation along K may add: the kernel sums
                # its K-blocks one after another, whose rounding grows like sqrt(K) fp32 ulps of the output (at the
                # 8B shape in fp32, ~15x cuBLAS's split reduction and still ~15x below TF32's error), and one
                # output ulp of the half types.
                err, ref_err = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
                slack = max(tol / 10, k ** 0.5 * torch.finfo(torch.float32).eps * exact.abs().max().item())
                assert err <= 2 * ref_err + slack, (model, n, k, m, split_k, err.item(), ref_err.item(), slack)


def test_gemv_replays_from_a_cuda_graph():
    x, w, b = operands(960, 576, 4, torch.bfloat16, bias=True)
    want = gemv.gemv(x, w, b)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv.gemv(x, w, b)
        with torch.cuda.graph(graph, stream=stream):
            out = gemv.gemv(x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, gemv.gemv(x, w, b))
    assert not torch.equal(out, want)


def test_engine_with_decode_gemv_keeps_greedy_output(tmp_path):
    import json

    from peagle import LLM, SamplingParams

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 256,
           "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "eos_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [40] * 20]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = {"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3, "parallel_drafting": True}
    tokens = {}
    for gemv_on in (False, True):
        for async_on in (False, True):
            llm = LLM(model=str(tmp_path), load_format="dummy", dtype="float32", max_model_len=256, max_num_seqs=4,
                      speculative_config=spec, decode_gemv=gemv_on, async_scheduling=async_on)
            assert isinstance(llm.engine.target.layers[0].self_attn.qkv_proj, kernels.GemvLinear) == gemv_on
            tokens[gemv_on, async_on] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            del llm
    assert len(set(map(str, tokens.values()))) == 1, tokens


@pytest.mark.parametrize("k_prev,k", [(0, 0), (7, 7), (7, 3)])
def test_advance_decode_inputs_equals_reference(k_prev, k):
    from peagle.kernels import decode_inputs

    gen = torch.Generator().manual_seed(k)
    b_prev, b, bs, width, scratch = 64, 48, 16, 40, 500
    packed = torch.randint(0, 50_000, (b_prev, (k_prev + 1) + 1 + 7), generator=gen)
    packed[:, k_prev + 1] = torch.randint(0, k_prev + 1, (b_prev,), generator=gen)
    src = torch.randperm(b_prev, generator=gen)[:b]
    src[40:] = -1
    base = torch.randint(0, 400, (b,), generator=gen)
    tables = torch.randint(0, scratch, (b, width), generator=gen).to(torch.int32)
    outs = []
    for fn in (decode_inputs.advance_decode_inputs, kernels.advance_decode_inputs_ref):
        out = {name: torch.full((b * (k + 1),), -7, dtype=torch.long, device=CUDA)
               for name in ("input_ids", "positions", "slot_mapping")}
        out["drafts"] = torch.full((b, k), -7, dtype=torch.long, device=CUDA)
        out["num_drafts"] = torch.zeros(b, dtype=torch.long, device=CUDA)
        fn(packed.to(CUDA), src.to(CUDA), base.to(CUDA), tables.to(CUDA), k_prev, k, bs, scratch, out)
        outs.append(out)
    for name in outs[0]:
        assert torch.equal(outs[0][name], outs[1][name]), name
