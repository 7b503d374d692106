"""Shared fixtures of the GPU tests."""

from __future__ import annotations

import json

import pytest

# A small Llama shape whose engines run with random weights (load_format="dummy"): fast to build, big enough for
# every kernel's tiling (GQA, head_dim 64) and for prompts of a few hundred tokens.
DUMMY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 256,
                "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 64, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "eos_token_id": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory holding only DUMMY_CONFIG's config.json."""
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(DUMMY_CONFIG))
    return str(d)
