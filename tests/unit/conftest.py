"""Shared fixtures: tiny random Hugging Face checkpoints written the way real ones are, and GGUF files made from them.

`tiny_hf_checkpoint(family="llama", ...)` returns a directory holding config.json, safetensors weights (written by
transformers' `save_pretrained`), generation_config.json, tokenizer.json and a hub-style tokenizer_config.json with a
ChatML chat template and a few reserved special tokens. `tiny_gguf(family="llama", ...)` writes the same model as a
GGUF file the way llama.cpp's converter does (Q/K rows permuted for llama, tokenizer metadata, optional Q8_0/F16).
Both are built once per session and cached by their arguments: treat them as read-only (copy before damaging).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

# Where the user's machine keeps what `peagle quickstart` and `peagle testbed` fetch. A unit test must never read
# them (a cached ShareGPT file changed which prompts count as held out): each test gets its own, empty, in pytest's
# temporary directory.
_USER_PATHS = ("PEAGLE_CACHE", "HOME", "XDG_CACHE_HOME", "HF_HOME")
# `peagle train` sets these for CUDA's core dumps when they are unset; a test that runs it in process gets them back.
_GPU_CORE_ENV = ("CUDA_ENABLE_COREDUMP_ON_EXCEPTION", "CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION",
                 "CUDA_ENABLE_LIGHTWEIGHT_COREDUMP", "CUDA_COREDUMP_FILE")


@pytest.fixture(autouse=True)
def _isolated_user_paths(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("user-paths")  # beside the test's tmp_path, which tests list
    for name in _USER_PATHS:
        path = root / name.lower()
        path.mkdir()
        monkeypatch.setenv(name, str(path))
    for name in _GPU_CORE_ENV:
        monkeypatch.delenv(name, raising=False)  # restored as it was after the test


# A ChatML template in the common hub style: whitespace control, a default system prompt, a generation prompt.
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if loop.first and messages[0]['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Ids 0..5 in this order. The three reserved tokens are used by no text and no template: mask-token candidates.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|reserved_0|>", "<|reserved_1|>", "<|reserved_2|>"]
RESERVED_TOKEN_IDS = [3, 4, 5]
EOS_TOKEN_ID = 2  # <|im_end|>
PAD_TOKEN_ID = 0  # <|endoftext|>

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and verifies them in one forward pass of the target model.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12345 and 3.14159 appear in text; so do symbols such as #, $, % and {braces}.",
    "Café, naïve, résumé, Straße, smörgåsbord.",
    "你好，世界。日本語のテキスト。한국어 문장.",
    "Emoji: 🙂🚀✨ and math: ∑ ∫ √ ≤ ≥.",
    "You are a helpful assistant. What is the capital of France? Paris is the capital of France.",
]

FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral", "mistral_swa", "qwen3_moe", "gpt_oss", "gemma3",
            "gemma3_gguf", "gemma4")


def _tokenizer_files(out: Path) -> int:
    """Trains a tiny byte-level BPE (deterministic) and writes tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
        "bos_token": None,
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def _hf_config(family: str, vocab_size: int, num_layers: int, tie_word_embeddings: bool):
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )
    if family == "llama":
        return transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "llama3":
        # original_max_position_embeddings is small so the llama3 scaling bends frequencies of a 16-dim head.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, use_sliding_window=False)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if family == "mistral_swa":
        return transformers.MistralConfig(**common, sliding_window=6)
    # The MoE families: 8 experts, top 2, YaRN over a short original context so that it bends a 16-dim head's
    # frequencies; Qwen3-MoE with one dense layer, GPT-OSS with a 6-token window, sinks and a clamp that bites.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                           norm_topk_prob=True, mlp_only_layers=[1],
                                           rope_parameters={**yarn, "rope_theta": 10000.0})
    if family == "gpt_oss":
        common = {**common, "intermediate_size": 32}
        return transformers.GptOssConfig(**common, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
                                         swiglu_limit=0.5, attention_bias=True,
                                         rope_parameters={**yarn, "rope_theta": 150000.0, "beta_fast": 32.0,
                                                          "beta_slow": 1.0, "truncate": False})
    if family == "gemma3":
        # A 6-token window on every layer but the last; the global layers' RoPE linearly scaled; scores scaled by
        # a query_pre_attn_scalar other than head_dim; final logits soft-capped where they bite.
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
        return transformers.Gemma3TextConfig(**common, sliding_window=6, query_pre_attn_scalar=24,
                                             layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"],
                                             final_logit_softcapping=2.0, rope_parameters=rope)
    if family == "gemma3_gguf":
        # A Gemma 3 that a GGUF file says all of, read alike by llama.cpp and transformers: every sixth layer
        # global, no logits capped, and (as in the released models but the 27B) head_dim = query_pre_attn_scalar
        # = 256, which transformers' GGUF loader assumes; one KV head, as the 270M.
        common = {**common, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 256}
        return transformers.Gemma3TextConfig(**common, sliding_window=6, query_pre_attn_scalar=256)
    if family == "gemma4":
        # A Gemma 4 with per-layer inputs, the experts beside the MLP, keys as values in the global layer and
        # proportional RoPE there (test_engine_gemma4.py serves the wider global heads and KV sharing).
        return transformers.Gemma4TextConfig(**common, sliding_window=6, global_head_dim=16, attention_k_eq_v=True,
                                             layer_types=["sliding_attention"] * (num_layers - 1) + ["full_attention"],
                                             hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size,
                                             enable_moe_block=True, num_experts=4, top_k_experts=2,
                                             moe_intermediate_size=24, final_logit_softcapping=5.0)
    raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")


def _write_checkpoint(out: Path, family: str, num_layers: int, tie_word_embeddings: bool,
                      max_shard_size: str | None, seed: int) -> None:
    import transformers

    vocab_size = _tokenizer_files(out)
    config = _hf_config(family, vocab_size, num_layers, tie_word_embeddings)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Norm weights start at one; perturb them so a misplaced norm cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    generation = {"bos_token_id": None, "eos_token_id": [EOS_TOKEN_ID, PAD_TOKEN_ID], "pad_token_id": PAD_TOKEN_ID}
    (out / "generation_config.json").write_text(json.dumps(generation))


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """Factory: `tiny_hf_checkpoint(family="llama", *, num_layers=8, tie_word_embeddings=False,
    max_shard_size=None, seed=0) -> Path`.

    family is one of "llama", "llama3" (llama3 rope scaling), "qwen2", "qwen3", "mistral" (sliding_window null).
    The model: hidden 64, 4 heads of 16, 2 KV heads, FFN 96, fp32, vocab = the tokenizer's (about 400).
    `max_shard_size` (e.g. "40KB") makes a sharded save with model.safetensors.index.json.
    """
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama", *, num_layers: int = 8, tie_word_embeddings: bool = False,
             max_shard_size: str | None = None, seed: int = 0) -> Path:
        key = (family, num_layers, tie_word_embeddings, max_shard_size, seed)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            _write_checkpoint(out, family, num_layers, tie_word_embeddings, max_shard_size, seed)
            cache[key] = out
        return cache[key]

    return make


# HF module -> GGUF tensor stem, as llama.cpp names them.
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                      "lm_head.weight": "output.weight"}
GGUF_ARCH = {"llama": "llama", "llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "gemma3_gguf": "gemma3"}
_GEMMA3_GGUF_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                            "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = _GEMMA3_GGUF_LAYER_NAMES if arch == "gemma3" else _GGUF_LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{kind}"


GEMMA_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' "
    "else message['role']) + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _sentencepiece_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A Gemma-style SentencePiece vocabulary of `size` tokens as a GGUF lists it (tokens, scores, llama.cpp token
    types): specials, 256 byte-fallback tokens, the corpus's characters, then its most frequent word pieces ("▁" for
    a space), best first; <unused> control tokens fill the rest."""
    from collections import Counter

    words = ["▁" + w for text in _CORPUS for w in text.split(" ")]
    chars = sorted({c for w in words for c in w})
    pieces = Counter(w[i:j] for w in words for i in range(len(w)) for j in range(i + 2, min(len(w), i + 6) + 1))
    tokens = [*GEMMA_SPECIAL_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), *chars]
    tokens += [p for p, _ in pieces.most_common() if p not in tokens][:size - len(tokens)]
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    types = [3 if t.startswith("<") and not t.startswith("<0x") else 6 if t.startswith("<0x") else 1 for t in tokens]
    types[3] = 2  # <unk>
    return tokens, [-float(i) for i in range(size)], types


def _llama_cpp_permute(w, n_head: int):
    # llama.cpp's convert_hf_to_gguf `permute`: rotate-half rows -> interleaved pairs, per head.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(cfg: dict):
    # What llama.cpp stores for llama3 RoPE scaling: one divisor per frequency.
    import math

    rope = cfg["rope_parameters"]
    dim, theta = cfg["head_dim"], rope["rope_theta"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _gguf_writer(out: Path, arch: str, name: str, cfg: dict):
    """A GGUF writer for `arch` holding the model's name and the shapes every architecture states."""
    import gguf

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    return w


def _write_gguf_tensors(w, hf_dir: Path, arch: str, qtypes, prepare) -> None:
    """Adds the checkpoint's tensors (in name order, each as `prepare(name, tensor)` makes it) and writes the file.
    With `qtypes` (two quantization types), the matrices alternate between them; other tensors stay F32."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    for i, (name, tensor) in enumerate(sorted(load_file(str(hf_dir / "model.safetensors")).items())):
        tensor = np.ascontiguousarray(prepare(name, tensor), dtype=np.float32)
        if qtypes and tensor.ndim == 2:
            qtype = qtypes[i % 2]
            w.add_tensor(_gguf_name(name, arch), gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name, arch), tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_gguf(hf_dir: Path, out: Path, family: str, quantize: bool, chat_template: bool = True,
                context_length: int | None = None) -> None:
    import gguf
    import numpy as np

    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["max_position_embeddings"] = context_length or cfg["max_position_embeddings"]
    arch = GGUF_ARCH[family]
    if arch == "gemma3":
        _write_gemma3_gguf(cfg, hf_dir, out, quantize, chat_template)
        return
    w = _gguf_writer(out, arch, f"tiny {family}", cfg)
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg["rope_parameters"]["rope_type"] == "llama3":
        w.add_rope_scaling_orig_ctx_len(cfg["rope_parameters"]["original_max_position_embeddings"])
        w.add_tensor("rope_freqs.weight", np.array(_llama3_rope_freqs(cfg), dtype=np.float32))

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(EOS_TOKEN_ID)
    w.add_pad_token_id(PAD_TOKEN_ID)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(CHATML_TEMPLATE)

    def llama_cpp_rows(name, tensor):
        if arch == "llama" and ".q_proj." in name:
            return _llama_cpp_permute(tensor, cfg["num_attention_heads"])
        if arch == "llama" and ".k_proj." in name:
            return _llama_cpp_permute(tensor, cfg["num_key_value_heads"])
        return tensor

    # Quantized: alternate F16 and Q8_0 over the matrices, like mixed-precision quantized files do.
    qtypes = (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0) if quantize else None
    _write_gguf_tensors(w, hf_dir, arch, qtypes, llama_cpp_rows)


def _write_gemma3_gguf(cfg: dict, hf_dir: Path, out: Path, quantize: bool, chat_template: bool = True) -> None:
    # llama.cpp's gemma3 layout: no Q/K permutation, every norm weight stored as 1 + w, a SentencePiece vocabulary
    # with scores and no merges; quantized, the matrices alternate Q8_0 and Q5_0 (the gguf library writes no K-quants).
    import gguf

    w = _gguf_writer(out, "gemma3", "tiny gemma3", cfg)
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_sliding_window(cfg["sliding_window"])
    tokens, scores, types = _sentencepiece_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if chat_template:
        w.add_chat_template(GEMMA_CHAT_TEMPLATE)
    qtypes = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_0) if quantize else None
    _write_gguf_tensors(w, hf_dir, "gemma3", qtypes,
                        lambda name, tensor: tensor + 1 if name.endswith("norm.weight") else tensor)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_hf_checkpoint, tmp_path_factory):
    """Factory: `tiny_gguf(family="llama", *, quantize=True, tie_word_embeddings=False, chat_template=True,
    context_length=None) -> Path` to a .gguf file.

    The model and tokenizer of `tiny_hf_checkpoint(family, tie_word_embeddings=...)`, in llama.cpp's layout:
    arch llama (for llama, llama3, mistral: Q/K permuted; llama3 adds rope_freqs), qwen2 or qwen3.
    quantize=True stores the matrices alternately as Q8_0 and F16; norms and biases stay F32.
    "gemma3_gguf" writes arch gemma3 (norms as 1 + w) with a Gemma-style SentencePiece vocabulary of the same size
    instead of the BPE one, and a Gemma chat template; quantized, its matrices alternate Q8_0 and Q5_0.
    chat_template=False leaves the template out, as a base model's GGUF (Gemma 3 270M's) does; context_length
    replaces the model's 256 positions in the GGUF's metadata.
    """
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama", *, quantize: bool = True, tie_word_embeddings: bool = False,
             chat_template: bool = True, context_length: int | None = None) -> Path:
        key = (family, quantize, tie_word_embeddings, chat_template, context_length)
        if key not in cache:
            hf_dir = tiny_hf_checkpoint(family, tie_word_embeddings=tie_word_embeddings)
            out = tmp_path_factory.mktemp(f"gguf-{family}") / f"tiny-{family}.gguf"
            _write_gguf(hf_dir, out, family, quantize, chat_template, context_length)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def config_only_checkpoint(tmp_path_factory):
    """Factory: `config_only_checkpoint(architecture="LlamaForCausalLM", **overrides) -> Path`, a directory holding
    only a small config.json (no weights, no tokenizer), for random-weight (load_format="dummy") runs."""

    def make(architecture: str = "LlamaForCausalLM", **overrides) -> Path:
        cfg = {"architectures": [architecture], "model_type": architecture.removesuffix("ForCausalLM").lower(),
               "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
               "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 2,
               **overrides}
        d = tmp_path_factory.mktemp("config-only")
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    return make


@pytest.fixture(scope="session")
def repo_script():
    """`repo_script("server_overhead")`: the module of scripts/server_overhead.py (the scripts are not a package)."""
    def load(name: str):
        path = Path(__file__).parents[2] / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # so that worker processes find its functions by name
        spec.loader.exec_module(module)
        return module
    return load
