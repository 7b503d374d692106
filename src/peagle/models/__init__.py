"""Target models of the Llama family (Llama 2/3/3.1/3.2, SmolLM2, Mistral dense, Qwen2, Qwen3)."""

from peagle.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from peagle.models.llama import LlamaModel, ModelOutput

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "LlamaModel", "ModelOutput"]
