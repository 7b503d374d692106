"""The Gemma 3 text family against transformers (fp32, tiny random configs, well past the sliding window), its config
spellings and refusals, and the text decoder of a multimodal Gemma3ForConditionalGeneration checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from model_helpers import ATOL, check_against_transformers, logits_and_aux
from safetensors.torch import load_file, save_file

from peagle.models.config import ModelConfig, UnsupportedModelError
from peagle.models.loader import load_model
from peagle.models.weights import to_hf_state_dict


@pytest.mark.parametrize("tie", [False, True])
def test_logits_and_aux_match_transformers_past_the_window(tiny_hf_checkpoint, tie):
    path = tiny_hf_checkpoint("gemma3", num_layers=6, tie_word_embeddings=tie)
    model = load_model(path, dtype="fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    aux_ids = (0, 3, 5)  # the embeddings (scaled), a sliding layer's input, the global layer's input
    # lengths 1, 5 and 29: 29 tokens run well past the 6-token window
    logits = check_against_transformers(model, hf, aux_ids)
    assert logits.abs().max() < 2.0  # the final soft-cap (2.0) bit


def test_config_is_read(tiny_hf_checkpoint):
    cfg = ModelConfig.from_dir(tiny_hf_checkpoint("gemma3", num_layers=6))
    assert (cfg.family, cfg.architecture, cfg.qk_norm) == ("gemma3", "Gemma3ForCausalLM", True)
    assert [cfg.layer_window(i) for i in range(6)] == [6, 6, 6, 6, 6, 0]
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 2.0})
    assert (cfg.sliding_rope_theta, cfg.query_pre_attn_scalar, cfg.final_logit_softcapping) == (1e4, 24, 2.0)


_HUB_STYLE = {  # the spellings of transformers 4 configs: one RoPE base per kind of layer, no layer_types
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear",
                                                                                     "factor": 8.0},
    "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 16,
}


def test_older_spellings_and_multimodal_configs_are_read():
    cfg = ModelConfig.from_hf_dict(_HUB_STYLE)
    assert [cfg.layer_window(i) for i in range(7)] == [512] * 5 + [0, 512]
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.sliding_rope_theta) == (1e6, 8.0, 1e4)
    # The hub's multimodal configs name only what differs from Gemma3TextConfig's defaults (gemma-3-4b-it's).
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}}
    cfg = ModelConfig.from_hf_dict(hub)
    assert (cfg.family, cfg.architecture, cfg.vocab_size, cfg.head_dim, cfg.num_key_value_heads) == (
        "gemma3", "Gemma3ForCausalLM", 262_208, 256, 4)
    assert (cfg.eos_token_ids, cfg.tie_word_embeddings, cfg.sliding_rope_theta, cfg.rope_theta) == ([1, 106], True,
                                                                                                  1e4, 1e6)
    assert [cfg.layer_window(i) for i in (0, 4, 5, 33)] == [1024, 1024, 0, 1024]


@pytest.mark.parametrize("change,message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "sliding layers"),
])
def test_what_is_not_implemented_is_refused_by_name(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict({**_HUB_STYLE, **change})


def test_config_round_trips_through_to_hf_dict(tiny_hf_checkpoint):
    cfg = ModelConfig.from_dir(tiny_hf_checkpoint("gemma3", num_layers=6))
    d = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(d) == cfg
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == 1e4 and hf.query_pre_attn_scalar == 24


def test_state_dict_is_in_transformers_convention(tiny_hf_checkpoint):
    """Norm weights are held as 1 + w (q_norm's times the query scale) and given back as transformers' w."""
    path = tiny_hf_checkpoint("gemma3", num_layers=6)
    model = load_model(path, dtype="fp32")
    assert torch.allclose(model.layers[0].input_layernorm.weight,
                          1 + load_file(str(path / "model.safetensors"))["model.layers.0.input_layernorm.weight"])
    saved = load_file(str(path / "model.safetensors"))
    for name, tensor in to_hf_state_dict(model.state_dict(), model.config).items():
        torch.testing.assert_close(tensor, saved[name], atol=1e-6, rtol=1e-6)


def _multimodal_checkpoint(out, seed=0):
    text = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=6,
                                         query_pre_attn_scalar=16, max_position_embeddings=128,
                                         layer_types=["sliding_attention"] * 3 + ["full_attention"])
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms start at zero, the rest may be small: move everything
    model.save_pretrained(out)
    return model


def test_multimodal_checkpoint_serves_its_text_decoder(tmp_path):
    hf = _multimodal_checkpoint(tmp_path)
    names = load_file(str(tmp_path / "model.safetensors"))
    assert any(n.startswith("language_model.model.layers.") for n in names)  # what transformers 5 writes
    ids = torch.randint(0, 297, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids[None]).logits[0]
    model = load_model(tmp_path, dtype="fp32")
    assert model.config.family == "gemma3" and model.config.tie_word_embeddings
    torch.testing.assert_close(logits_and_aux(model, ids, ())[0], ref, atol=ATOL, rtol=1e-4)
    # The same decoder under the names the model holds in memory (model.language_model.*) loads alike.
    renamed = {n.replace("language_model.model.", "model.language_model."): t for n, t in names.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    torch.testing.assert_close(logits_and_aux(load_model(tmp_path, dtype="fp32"), ids, ())[0], ref, atol=ATOL,
                               rtol=1e-4)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]


# Gemma 4: every variant past the 6-token window, on 8 layers of which the last of each kind may share KV states.
_GEMMA4_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                 "full_attention", "sliding_attention", "full_attention"]
GEMMA4_VARIANTS = {
    "global_heads_keys_as_values": dict(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                                        hidden_size_per_layer_input=0),
    "per_layer_inputs_kv_sharing": dict(global_head_dim=32, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                                        use_double_wide_mlp=True),
    "experts": dict(global_head_dim=16, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
                    top_k_experts=2, moe_intermediate_size=24),
}


def _gemma4_checkpoint(out, seed=0, **variant):
    config = transformers.Gemma4TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=8, layer_types=_GEMMA4_TYPES,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6, max_position_embeddings=128,
        vocab_size_per_layer_input=300, final_logit_softcapping=5.0, **variant)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # norms and scales start at one: move them
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.8 + 0.05 * i)
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("variant", GEMMA4_VARIANTS)
def test_gemma4_logits_and_aux_match_transformers(tmp_path, variant):
    hf = _gemma4_checkpoint(tmp_path, **GEMMA4_VARIANTS[variant])
    model = load_model(tmp_path, dtype="fp32")
    check_against_transformers(model, hf, (1, 4, 7), lengths=(1, 29), vocab_size=300)


def test_gemma4_config_is_read(tmp_path):
    _gemma4_checkpoint(tmp_path, **GEMMA4_VARIANTS["per_layer_inputs_kv_sharing"])
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.family, cfg.architecture, cfg.rope_theta, cfg.sliding_rope_theta) == ("gemma4", "Gemma4ForCausalLM",
                                                                                      1e6, 1e4)
    assert [cfg.layer_window(i) for i in (0, 2, 7)] == [6, 0, 0] and cfg.final_logit_softcapping == 5.0
    from peagle.models.gemma4 import Gemma4Layout

    layout = Gemma4Layout.of(cfg)
    assert layout.head_dims == (16, 16, 32, 16, 16, 32, 16, 32) and layout.kv_sources == (0, 1, 2, 3, 4, 5, 4, 5)
    assert layout.mlp_sizes[5:] == (96, 192, 192) and layout.per_layer_input_size == 8
