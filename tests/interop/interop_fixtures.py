"""What the interop checks run on: a tiny random Llama target of head_dim 64 and prompts, all made in code.

vLLM's CPU attention runs head_dim 64 only (peagle's smoke model has head_dim 16), so this target is
hidden 128 = 2 heads x 64 with one KV head, 8 layers (distinct default aux layers 2, 4, 5) and the smoke model's
byte-level BPE tokenizer trained on Python standard-library docstrings. Prompts are made from those docstrings too:
one set of modules for the target to answer in training (`peagle regenerate`), another for the comparisons.
"""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 128, 256, 8, 2, 1, 64
MAX_POSITIONS = 2048
# A wider initialisation than HF's 0.02 spreads the random target's logits, so greedy choices are not near-ties
# that fp32 rounding in another engine's kernels could flip.
INIT_STD = 0.06
TRAIN_MODULES = ("collections", "json", "pathlib", "argparse", "logging", "functools", "itertools", "textwrap",
                 "string", "random", "statistics", "fractions", "decimal", "datetime", "calendar", "csv")
EVAL_MODULES = ("inspect", "shutil", "tempfile", "heapq", "bisect", "difflib")
TEMPLATES = ("Explain what this does: {}", "Write a short note about {}", "{}", "Summarise: {}",
             "Give an example of {}")


def docstrings(modules) -> list[str]:
    """First paragraphs of the public docstrings of `modules` (deterministic order)."""
    texts = []
    for name in modules:
        module = __import__(name)
        for attr in sorted(vars(module)):
            doc = inspect.getdoc(getattr(module, attr))
            if attr.startswith("_") or not doc:
                continue
            first = doc.split("\n\n")[0].replace("\n", " ").strip()
            if 20 <= len(first) <= 400 and first not in texts:
                texts.append(first)
    return texts


def prompts(modules, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = docstrings(modules)
    return [rng.choice(TEMPLATES).format(rng.choice(texts)) for _ in range(n)]


def write_target(out: Path, seed: int = 0) -> Path:
    """The tiny fp32 target (config.json, model.safetensors, tokenizer) in `out`."""
    import torch
    import transformers

    from peagle.bench.smoke_model import EOS, PAD, write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(out, docstrings(TRAIN_MODULES + EVAL_MODULES))
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=EOS, pad_token_id=PAD, initializer_range=INIT_STD,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "pad_token_id": PAD}))
    return out


def write_moe_target(out: Path, seed: int = 0) -> Path:
    """A tiny fp32 Qwen3-MoE target of the same tokenizer and attention shape: 4 layers (default aux layers 1, 2, 3),
    8 experts of 128, top 2, renormalised."""
    import torch
    import transformers

    from peagle.bench.smoke_model import EOS, PAD, write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(out, docstrings(TRAIN_MODULES + EVAL_MODULES))
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=FFN, moe_intermediate_size=FFN // 2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=EOS, pad_token_id=PAD, initializer_range=INIT_STD,
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "pad_token_id": PAD}))
    return out


def write_prompts(file: Path, texts: list[str]) -> Path:
    file.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return file
