"""A tiny random Llama checkpoint with a real tokenizer and chat template, written in code for smoke runs.

It has the layout of a real Hugging Face checkpoint (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json with a ChatML template and reserved special tokens for a P-EAGLE mask token),
so every peagle command runs on it unchanged; its outputs are random, so numbers measured on it mean nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Ids 0..5. The reserved tokens appear in no text and no template: candidates for the P-EAGLE mask token.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|reserved_0|>", "<|reserved_1|>", "<|reserved_2|>")
PAD, EOS = 0, 2
VOCAB_SIZE = 1024
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 8, 4, 2  # 8 layers: distinct default aux layers (2, 4, 5)
MAX_POSITIONS = 8192


def write_tokenizer(out: Path, texts: Iterable[str]) -> int:
    """Trains a byte-level BPE on `texts` (deterministic); writes tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer)
    tok.save(str(out / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    config = {"added_tokens_decoder": added, "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
              "bos_token": None, "eos_token": SPECIAL_TOKENS[EOS], "pad_token": SPECIAL_TOKENS[PAD], "unk_token": None,
              "chat_template": CHATML_TEMPLATE, "clean_up_tokenization_spaces": False,
              "model_max_length": MAX_POSITIONS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def write_tiny_checkpoint(out: Path, texts: Iterable[str], seed: int = 0) -> Path:
    """A random fp32 Llama of HIDDEN width and LAYERS layers with a tokenizer trained on `texts`, into `out`."""
    import torch
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(out, texts)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=EOS, pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "pad_token_id": PAD}))
    return out
