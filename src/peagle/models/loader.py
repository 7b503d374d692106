"""Loading a local Hugging Face checkpoint directory: the model (weights checked and mapped) and its tokenizer."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from peagle.models.config import ModelConfig, not_a_checkpoint
from peagle.models.layers import RotaryEmbedding
from peagle.models.llama import LlamaModel
from peagle.models.registry import build_model
from peagle.models.tokenizer import Tokenizer
from peagle.models.weights import load_into

logger = logging.getLogger(__name__)

DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use bfloat16, float16 or float32")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[key]


def empty_model(cfg: ModelConfig) -> LlamaModel:
    """A model whose parameters live on the meta device (no memory), ready for `load_into`."""
    with torch.device("meta"):
        model = build_model(cfg)
    # RoPE frequencies are computed, not loaded; the meta context would have left them without data.
    model.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    return model


def load_model(
    path: str | Path, dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu"
) -> LlamaModel:
    """The target model from a checkpoint directory (config.json + safetensors), in eval mode without grads."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(not_a_checkpoint(path))
    cfg = ModelConfig.from_dir(path)
    torch_dtype = parse_dtype(dtype)
    model = empty_model(cfg)
    load_into(model, path, torch_dtype, device)
    logger.info("loaded %s (%d layers) from %s as %s on %s", cfg.architecture, cfg.num_hidden_layers, path,
                torch_dtype, device)
    return model.eval().requires_grad_(False)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> LlamaModel:
    """A model of `cfg`'s shape with random weights (normal, std 0.02), built directly on the device, in eval mode
    without grads: vLLM's dummy load format, for speed at a real size without its weights."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(cfg)
            for p in model.parameters():
                if p.dim() > 1:
                    torch.nn.init.normal_(p, std=0.02)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.from_dir(path)
