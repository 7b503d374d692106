"""The mixture-of-experts and sliding-window families against transformers (fp32, tiny random configs), and the
quantised checkpoint layouts they ship in."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from model_helpers import check_against_transformers
from safetensors.torch import load_file, save_file

from peagle.models.config import ModelConfig
from peagle.models.loader import load_model
from peagle.models.quantized import dequantize_fp8_blocks, dequantize_mxfp4


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mistral_swa"])
def test_logits_and_aux_match_transformers_past_the_window(tiny_hf_checkpoint, family):
    path = tiny_hf_checkpoint(family, num_layers=4)
    model = load_model(path, dtype="fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # lengths 1, 5 and 29: 29 tokens run well past the 6-token window
    check_against_transformers(model, hf, model.config.default_aux_layer_ids)


def test_family_configs_are_read(tiny_hf_checkpoint):
    moe = ModelConfig.from_dir(tiny_hf_checkpoint("qwen3_moe", num_layers=4))
    assert (moe.family, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == ("qwen3_moe", 8, 2, 32)
    assert moe.norm_topk_prob and moe.qk_norm and moe.dense_layers == (1,)
    assert [moe.is_moe_layer(i) for i in range(4)] == [True, False, True, True]
    assert moe.rope_scaling["rope_type"] == "yarn" and moe.layer_window(0) == 0
    oss = ModelConfig.from_dir(tiny_hf_checkpoint("gpt_oss", num_layers=4))
    assert oss.attention_sinks and oss.qkv_bias and oss.o_bias and oss.swiglu_limit == 0.5
    assert [oss.layer_window(i) for i in range(4)] == [6, 0, 6, 0]
    swa = ModelConfig.from_dir(tiny_hf_checkpoint("mistral_swa", num_layers=4))
    assert [swa.layer_window(i) for i in range(4)] == [6, 6, 6, 6]


def test_window_and_expert_configs_are_validated():
    base = dict(family="gpt_oss", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="layer_types names 1 layers"):
        ModelConfig(**base, layer_types=("full_attention",))
    with pytest.raises(ValueError, match="sliding_window is not positive"):
        ModelConfig(**base, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="unsupported layer type"):
        ModelConfig(**base, layer_types=("chunked_attention", "full_attention"), sliding_window=4)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig(**base, num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig(**base, num_experts=4, num_experts_per_tok=2)


def test_qwen2_slides_only_from_max_window_layers():
    d = dict(architectures=["Qwen2ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
             use_sliding_window=True, max_window_layers=2)
    assert [ModelConfig.from_hf_dict(d).layer_window(i) for i in range(4)] == [0, 0, 16, 16]
    assert ModelConfig.from_hf_dict({**d, "use_sliding_window": False}).layer_types == ()


def _mxfp4(gen, lead, rows, cols):
    blocks = torch.randint(0, 256, (*lead, rows, cols // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 130, (*lead, rows, cols // 32), dtype=torch.uint8, generator=gen)
    return blocks, scales


def test_mxfp4_dequantisation_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _mxfp4(torch.Generator().manual_seed(0), (3,), 64, 96)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (3, 96, 64)
    assert torch.equal(got, want)


def _check_loads_as_its_twin(src, tmp_path, tensors, quantised, quantization_config):
    """Copies of checkpoint `src` holding `tensors` (plain) and `quantised` (under `quantization_config`) load to
    equal weights; returns the plain one's model."""
    plain, packed = tmp_path / "plain", tmp_path / "quantised"
    shutil.copytree(src, plain)
    shutil.copytree(src, packed)
    save_file(tensors, plain / "model.safetensors")
    save_file(quantised, packed / "model.safetensors")
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (packed / "config.json").write_text(json.dumps(config))
    a, b = load_model(plain, dtype="fp32"), load_model(packed, dtype="fp32")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    return a


def test_gpt_oss_mxfp4_checkpoint_loads_as_its_dequantised_twin(tiny_hf_checkpoint, tmp_path):
    """The released GPT-OSS checkpoints store experts as MXFP4 blocks and scales: they load as the bf16 layout."""
    src = tiny_hf_checkpoint("gpt_oss", num_layers=2)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    quantised = dict(tensors)
    for layer in range(2):
        for proj, rows, cols in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            blocks, scales = _mxfp4(gen, (8,), rows, cols)
            del quantised[name]
            quantised[name + "_blocks"], quantised[name + "_scales"] = blocks, scales
            tensors[name] = dequantize_mxfp4(blocks, scales, torch.float32)
    _check_loads_as_its_twin(src, tmp_path, tensors, quantised,
                             {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})


def test_fp8_block_checkpoint_loads_dequantised(tiny_hf_checkpoint, tmp_path):
    """Qwen3-Coder-30B-A3B-Instruct-FP8's layout: fp8 weights with a scale per 128 x 128 block (16 x 16 here)."""
    src = tiny_hf_checkpoint("qwen3_moe", num_layers=2)
    tensors = load_file(src / "model.safetensors")
    quantised = dict(tensors)
    for name, w in tensors.items():
        if name.endswith("proj.weight"):
            scale = w.abs().amax().clamp(min=1e-6) / 448 * (1 + torch.rand(-(-w.shape[0] // 16), -(-w.shape[1] // 16)))
            q = (w / scale.repeat_interleave(16, 0)[:w.shape[0]].repeat_interleave(16, 1)[:, :w.shape[1]])
            quantised[name] = q.to(torch.float8_e4m3fn)
            quantised[name.removesuffix("weight") + "weight_scale_inv"] = scale
            tensors[name] = dequantize_fp8_blocks(quantised[name], scale, (16, 16), torch.float32)
    a = _check_loads_as_its_twin(src, tmp_path, tensors, quantised,
                                 {"quant_method": "fp8", "weight_block_size": [16, 16], "fmt": "e4m3"})
    # A weight that differs from its dequantised twin would show: the fp8 values are coarse.
    assert not torch.equal(a.layers[0].self_attn.qkv_proj.weight, load_model(src, dtype="fp32").layers[0]
                           .self_attn.qkv_proj.weight)


def test_fp8_weight_without_its_scales_is_refused(tiny_hf_checkpoint, tmp_path):
    src = tiny_hf_checkpoint("qwen3_moe", num_layers=2)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].to(
        torch.float8_e4m3fn)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match="q_proj.weight is torch.float8_e4m3fn without the block scales"):
        load_model(bad, dtype="fp32")
