"""GGUF -> HF checkpoint conversion, checked against transformers' own GGUF loading and the original checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from peagle.cli import main as cli_main
from peagle.models.attention import DenseAttention
from peagle.models.gguf_convert import convert_gguf, hf_tensor_name, unpermute_qk
from peagle.models.loader import load_model, load_tokenizer
from peagle.models.weights import SafetensorsCheckpoint

TEXTS = ["Hello world, this is a test.", "Numbers 12345 and 3.14159; {braces}\n\ttabs", "Café 你好 🙂",
         "<|im_start|>user\nhi<|im_end|>"]
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"}]


def _logits(model, ids):
    return model.compute_logits(model(ids, torch.arange(ids.numel()), DenseAttention()).hidden)


def _hf_from_gguf(gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_quantized_gguf_logits_match_transformers_gguf_loading(tiny_gguf, tmp_path, tie):
    src = tiny_gguf("llama", quantize=True, tie_word_embeddings=tie)
    out = convert_gguf(src, tmp_path / "ckpt", dtype="fp32")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tie and config["architectures"] == ["LlamaForCausalLM"]
    model = load_model(out, dtype="fp32")
    reference = _hf_from_gguf(src)
    ids = torch.randint(0, model.config.vocab_size, (19,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
        converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids[None]).logits[0]
    torch.testing.assert_close(_logits(model, ids), expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(converted, expected, atol=0, rtol=0)  # same weights, same implementation


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3"])
def test_f32_gguf_restores_the_original_weights_and_config(tiny_gguf, tiny_hf_checkpoint, tmp_path, family):
    # An unquantized GGUF must convert back to exactly the checkpoint it was made from: this pins the Q/K
    # un-permutation, the name mapping and the config (llama3: RoPE scaling rebuilt from rope_freqs).
    original = tiny_hf_checkpoint(family)
    out = convert_gguf(tiny_gguf(family, quantize=False), tmp_path / "ckpt", dtype="fp32")
    a, b = SafetensorsCheckpoint(original), SafetensorsCheckpoint(out)
    assert set(a.file_of) == set(b.file_of)
    for name in a.file_of:
        assert torch.equal(a.get(name), b.get(name)), name
    ours, theirs = load_model(out, dtype="fp32").config, load_model(original, dtype="fp32").config
    for field in ("family", "hidden_size", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
                  "rms_norm_eps", "qkv_bias", "qk_norm", "tie_word_embeddings", "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_converted_tokenizer_matches_transformers_and_the_original(tiny_gguf, tiny_hf_checkpoint, tmp_path):
    src = tiny_gguf("llama")
    out = convert_gguf(src, tmp_path / "ckpt", dtype="bf16")
    ours = load_tokenizer(out)
    from_gguf = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    original = load_tokenizer(tiny_hf_checkpoint("llama"))
    for text in TEXTS:
        assert ours.encode(text) == from_gguf.encode(text, add_special_tokens=False) == original.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    prompt = ours.apply_chat_template(CONVERSATION)
    assert prompt == from_gguf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ours.encode_chat(CONVERSATION) == original.encode_chat(CONVERSATION)
    assert ours.eos_token_ids == [2] and ours.pad_token_id == 0
    assert ours.reserved_token_ids() == original.reserved_token_ids() == [3, 4, 5]
    assert load_model(out).output_weight.dtype == torch.bfloat16


def test_cli_converts_and_refuses_then_forces_a_non_empty_output(tiny_gguf, tmp_path, capsys):
    src, out = tiny_gguf("qwen3"), tmp_path / "ckpt"
    assert cli_main(["convert", "gguf", str(src), str(out), "--dtype", "fp16"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert load_model(out, dtype="fp16").config.family == "qwen3"
    before = sorted(p.name for p in out.iterdir())
    assert cli_main(["convert", "gguf", str(src), str(out)]) == 1
    assert "not empty; pass --force" in capsys.readouterr().err
    assert cli_main(["convert", "gguf", str(src), str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == before
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or old directories left


def test_unsupported_quantization_is_a_clear_error_and_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    import gguf.quants

    def unsupported(data, qtype):
        raise NotImplementedError(f"dequantization of {qtype.name} is not implemented")

    monkeypatch.setattr(gguf.quants, "dequantize", unsupported)
    with pytest.raises(ValueError, match="uses quantization .* cannot dequantize; upgrade gguf"):
        convert_gguf(tiny_gguf("llama", quantize=True), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and list(tmp_path.iterdir()) == []


def test_convert_into_an_existing_empty_directory(tiny_gguf, tmp_path):
    (tmp_path / "ckpt").mkdir()
    convert_gguf(tiny_gguf("llama"), tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim = 3, 8
    w = torch.arange(heads * head_dim * 2, dtype=torch.float32).reshape(heads * head_dim, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, 2).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_qk(permuted, heads), w)
    bias = torch.arange(heads * head_dim, dtype=torch.float32)
    assert torch.equal(unpermute_qk(bias.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1), heads), bias)


def test_tensor_names():
    assert hf_tensor_name("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None
