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
    assert hf_tensor_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.2.post_ffw_norm.weight", "gemma3") == "model.layers.2.post_feedforward_layernorm.weight"


GEMMA_TEXTS = [*TEXTS, "  leading spaces and   runs\n\ttabs", "<start_of_turn>user\nhi<end_of_turn>\n"]


def test_gemma3_gguf_logits_and_tokenizer_match_transformers_gguf_loading(tiny_gguf, tmp_path):
    src = tiny_gguf("gemma3_gguf", quantize=True, tie_word_embeddings=True)
    out = convert_gguf(src, tmp_path / "ckpt", dtype="fp32")
    model = load_model(out, dtype="fp32")
    assert model.config.family == "gemma3" and [model.config.layer_window(i) for i in (0, 5, 7)] == [6, 0, 6]
    ids = torch.randint(0, model.config.vocab_size, (29,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # 29 tokens: past the 6-token window
        expected = _hf_from_gguf(src)(ids[None]).logits[0]
        converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids[None]).logits[0]
    torch.testing.assert_close(_logits(model, ids), expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(converted, expected, atol=0, rtol=0)  # same weights, same implementation

    ours = load_tokenizer(out)
    from_gguf = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    for text in GEMMA_TEXTS:
        assert ours.encode(text, add_special_tokens=True) == from_gguf.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.encode("hi", add_special_tokens=True)[0] == ours.bos_token_id == 2
    prompt = ours.apply_chat_template(CONVERSATION)
    assert prompt == from_gguf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<bos><start_of_turn>user\n")
    assert ours.eos_token_ids == [1, 5]  # <eos>, and <end_of_turn>, which ends a chat turn


def test_gemma3_tokenizer_is_built_here_as_transformers_builds_it(tiny_gguf, tmp_path, monkeypatch):
    """Gemma's tokenizer is rebuilt here, not by transformers (5.17's GGUF code builds another one from the same
    file): the backend transformers' GGUF tokenizer code builds, to the byte, and a conversion that runs with
    transformers' GGUF modules unimportable."""
    import json
    import sys

    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    from peagle.models.gguf_convert import TOKENIZER_KEYS, GGUFFile, _gemma_backend

    src = tiny_gguf("gemma3_gguf", quantize=True, tie_word_embeddings=True)
    gguf = GGUFFile(src)
    meta = {key: gguf.get(key, None) for key in TOKENIZER_KEYS}
    names = GGUF_TOKENIZER_MAPPING["tokenizer"]
    fields = {names[k.removeprefix("tokenizer.")]: v for k, v in meta.items()
              if k.removeprefix("tokenizer.") in names and v is not None}
    ours = json.loads(_gemma_backend(meta).to_str())
    theirs = json.loads(convert_gguf_tokenizer("gemma3", fields)[0].to_str())
    # but the post-processor (set after, for BOS) and the <mask> transformers invents past the vocabulary's 400 rows
    assert [t["content"] for t in theirs["added_tokens"] if t["id"] >= len(meta["tokenizer.ggml.tokens"])] == ["<mask>"]
    theirs["added_tokens"] = [t for t in theirs["added_tokens"] if t["id"] < len(meta["tokenizer.ggml.tokens"])]
    assert {**ours, "post_processor": None} == {**theirs, "post_processor": None}

    with_transformers = convert_gguf(src, tmp_path / "a", dtype="fp32")
    for name in ("transformers.integrations.gguf", "transformers.integrations.gguf.gguf_tokenizer_mapping",
                 "transformers.integrations.ggml"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    without = convert_gguf(src, tmp_path / "b", dtype="fp32")
    assert (without / "tokenizer.json").read_bytes() == (with_transformers / "tokenizer.json").read_bytes()


def test_f32_gemma3_gguf_restores_the_original_checkpoint(tiny_gguf, tiny_hf_checkpoint, tmp_path):
    original = tiny_hf_checkpoint("gemma3_gguf", tie_word_embeddings=True)
    out = convert_gguf(tiny_gguf("gemma3_gguf", quantize=False, tie_word_embeddings=True), tmp_path / "ckpt",
                       dtype="fp32")
    a, b = SafetensorsCheckpoint(original), SafetensorsCheckpoint(out)
    assert set(a.file_of) == set(b.file_of)
    for name in a.file_of:  # norms went through 1 + w and back
        torch.testing.assert_close(a.get(name), b.get(name), atol=1e-7, rtol=0, msg=name)
    ours, theirs = load_model(out, dtype="fp32"), load_model(original, dtype="fp32")
    for field in ("family", "layer_types", "sliding_window", "rope_theta", "rope_scaling", "sliding_rope_theta",
                  "query_pre_attn_scalar", "final_logit_softcapping", "rms_norm_eps", "head_dim", "qk_norm",
                  "tie_word_embeddings"):
        assert getattr(ours.config, field) == getattr(theirs.config, field), field
    ids = torch.randint(0, ours.config.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(ours, ids), _logits(theirs, ids), atol=1e-5, rtol=1e-5)


def _gemma3_metadata_gguf(path, **keys):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "gemma3")
    for name, value in {"embedding_length": 64, "feed_forward_length": 96, "block_count": 62,
                        "attention.head_count": 4, "attention.key_length": 256, "attention.sliding_window": 512,
                        "rope.freq_base": 1e6, **keys}.items():
        add = w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32
        add(f"gemma3.{name}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gemma3_gguf_config_follows_llama_cpp(tmp_path):
    from peagle.models.config import UnsupportedModelError
    from peagle.models.gguf_convert import GGUFFile

    cfg = GGUFFile(_gemma3_metadata_gguf(tmp_path / "a.gguf", **{"rope.scaling.type": "linear",
                                                                 "rope.scaling.factor": 8.0})).model_config(torch.float32)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0} and cfg.sliding_rope_theta == 1e4
    assert cfg.query_pre_attn_scalar == 64 // 4  # the 27B's depth: hidden / heads, as llama.cpp
    assert [cfg.layer_window(i) for i in range(6)] == [512] * 5 + [0]
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        GGUFFile(_gemma3_metadata_gguf(tmp_path / "b.gguf", attn_logit_softcapping=50.0)).model_config(torch.float32)


def test_check_gemma_gguf_script_compares_tokenizers_and_logits(repo_script, tiny_gguf, tmp_path):
    script = repo_script("check_gemma_gguf")
    src = tiny_gguf("gemma3_gguf", quantize=True, tie_word_embeddings=True)
    out = convert_gguf(src, tmp_path / "ckpt", dtype="fp32")
    theirs = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    assert all(r["equal"] and r["round_trip"] for r in script.check_tokenizer(load_tokenizer(out), theirs))
    rows = script.check_logits(load_model(out, dtype="fp32"), _hf_from_gguf(src),
                               [theirs.encode(text) for text in script.PROMPTS])
    assert [r["tokens"] for r in rows] == [len(theirs.encode(text)) for text in script.PROMPTS]
    assert all(r["max_abs_diff"] < 1e-4 and r["argmax_agree"] == 1.0 for r in rows)
