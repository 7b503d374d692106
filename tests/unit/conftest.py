"""Shared fixtures: tiny random Hugging Face checkpoints written the way real ones are.

`tiny_hf_checkpoint(family="llama", ...)` returns a directory holding config.json, safetensors weights (written by
transformers' `save_pretrained`), generation_config.json, tokenizer.json and a hub-style tokenizer_config.json with a
ChatML chat template and a few reserved special tokens. Checkpoints are built once per session and cached by their
arguments, so treat the returned directory as read-only (copy it before damaging it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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

FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral")


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
