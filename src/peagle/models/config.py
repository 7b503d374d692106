"""ModelConfig: the target model's shape, read from and written to a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF architecture name -> family. The dense families share llama.py and differ in small options; the others have a
# model file of their own (models/registry.py).
TEXT_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
}
# Multimodal checkpoints whose `text_config` describes the text decoder peagle serves (the vision tower is not read).
MULTIMODAL_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "gemma3", "Gemma4ForConditionalGeneration": "gemma4"}
SUPPORTED_ARCHITECTURES = {**TEXT_ARCHITECTURES, **MULTIMODAL_ARCHITECTURES}
FAMILY_ARCHITECTURE = {family: arch for arch, family in TEXT_ARCHITECTURES.items()}
FAMILY_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                     "qwen3_moe": "qwen3_moe", "gpt_oss": "gpt_oss", "gemma3": "gemma3_text",
                     "gemma4": "gemma4_text"}
MODEL_TYPE_FAMILY = {model_type: family for family, model_type in FAMILY_MODEL_TYPE.items()}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    pass


def not_a_checkpoint(path: str | Path) -> str:
    """Why `path` is no model for peagle, and how to get a local checkpoint directory (a hub id is the usual slip)."""
    path = Path(path)
    if path.suffix == ".gguf":
        what, how = f"{path} is a GGUF file", f"convert it first: `peagle convert gguf {path} DIR`"
    else:
        what = f"{path} has no config.json" if path.is_dir() else f"{path} is not a directory"
        hub_id = not path.exists() and not path.is_absolute() and str(path).count("/") == 1
        repo = str(path) if hub_id and not str(path).startswith(".") else "ORG/NAME"
        how = (f"get one with `hf download {repo} --local-dir DIR` (older huggingface_hub: `huggingface-cli "
               "download`), or convert a GGUF file with `peagle convert gguf FILE.gguf DIR`")
    return (f"{what}: peagle takes a local checkpoint directory (config.json, safetensors weights, tokenizer.json) and "
            f"downloads nothing from a hub; {how}, then pass DIR")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"
    # Attention: per layer "full_attention" or "sliding_attention" (empty: every layer full); a sliding layer's query
    # at position p sees keys p - sliding_window < j <= p. attention_sinks: a learned logit per head (GPT-OSS).
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    attention_sinks: bool = False
    # Mixture of experts (num_experts 0: a dense MLP in every layer). dense_layers: the layers of a MoE model that
    # keep a dense MLP of intermediate_size (Qwen3-MoE's mlp_only_layers and decoder_sparse_step).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    # GPT-OSS's experts: gate clamped above, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    # Gemma: the sliding layers' RoPE base (0: every layer rotates with rope_theta / rope_scaling); attention scores
    # scaled by query_pre_attn_scalar ** -0.5 (0: head_dim ** -0.5); the final logits soft-capped to
    # cap * tanh(logits / cap) (0: not capped).
    sliding_rope_theta: float = 0.0
    query_pre_attn_scalar: int = 0
    final_logit_softcapping: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.family not in FAMILY_ARCHITECTURE:
            raise UnsupportedModelError(
                f"unsupported model family {self.family!r}; supported: {sorted(FAMILY_ARCHITECTURE)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise UnsupportedModelError(
                    f"unsupported rope_scaling type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has "
                                 f"{self.num_hidden_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise UnsupportedModelError(f"unsupported layer type(s) {unknown}; supported: {list(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not positive")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                                 f"({self.num_experts})")
            if self.moe_intermediate_size <= 0:
                raise ValueError("a mixture-of-experts config needs a positive moe_intermediate_size")
        for name in ("sliding_rope_theta", "query_pre_attn_scalar", "final_logit_softcapping"):
            if getattr(self, name) < 0:
                raise ValueError(f"config field {name} must be >= 0 (0: unused), got {getattr(self, name)}")

    @property
    def architecture(self) -> str:
        return FAMILY_ARCHITECTURE[self.family]

    @property
    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        """EAGLE-3's choice (low, middle, high: the inputs of layers 2, n/2, n-3), moved apart on shallow targets so
        that from 3 layers on they are distinct layers' inputs (vLLM taps only inputs, 0..n-1, and refuses a head
        that taps one twice)."""
        n = self.num_hidden_layers
        low, mid, high = min(2, n), n // 2, max(0, n - 3)
        if low < mid < high:
            return (low, mid, high)
        if n < 3:
            return (0, n // 2, n - 1)
        low = min(low, n - 3)
        mid = max(low + 1, min(mid, n - 2))
        return (low, mid, max(mid + 1, min(high, n - 1)))

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` (0: full attention)."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
        multimodal = arch in MULTIMODAL_ARCHITECTURES
        if arch is None:
            model_type = d.get("model_type")
            family = MODEL_TYPE_FAMILY.get(model_type)
            if family is None and text.get("model_type") in ("gemma3_text", "gemma4_text"):
                family, multimodal = MODEL_TYPE_FAMILY[text["model_type"]], True
            if family is None:
                raise UnsupportedModelError(
                    f"unsupported architecture {archs or model_type!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                )
        else:
            family = SUPPORTED_ARCHITECTURES[arch]
        d = _text_decoder(d) if multimodal else dict(d)
        if family == "gemma3":
            d = _gemma3_dict(d)
        elif family == "gemma4":
            d = _gemma4_dict(d)
        # transformers >= 5 folds rope_theta / rope_scaling into rope_parameters; accept both spellings.
        rope = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        if family == "gpt_oss" and "quantization_config" in d:
            d.pop("quantization_config")  # MXFP4 experts: dequantised to the compute dtype at load (weights.py)
        heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(
            **_attention_fields(d, family),
            **_moe_fields(d, family),
            **_gemma_fields(d, family),
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else bool(d.get("attention_bias", False)),
            o_bias=False if family == "qwen2" else bool(d.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3", "gemma4"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face config.json of a dense family (the drafters' layers and the test models are dense), or of
        Gemma 3 (a converted GGUF's)."""
        if self.num_experts or self.attention_sinks or (self.layer_types and self.family != "gemma3"):
            raise ValueError(f"to_hf_dict writes dense full-attention configs only, not a {self.family} one")
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": FAMILY_MODEL_TYPE[self.family],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.family in ("llama", "qwen3"):
            d["attention_bias"] = self.qkv_bias
        if self.family in ("qwen2", "qwen3", "mistral"):
            d["sliding_window"] = None
            d["use_sliding_window"] = False
        if self.family == "gemma3":
            d.update(self._gemma3_hf_fields(d))
        return d

    def _gemma3_hf_fields(self, d: dict[str, Any]) -> dict[str, Any]:
        # Gemma3TextConfig spells RoPE per layer type; its activation has its own key.
        full = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": d.pop("rope_theta")}
        d.pop("rope_scaling")
        d.pop("hidden_act")
        sliding = {"rope_type": "default", "rope_theta": self.sliding_rope_theta or self.rope_theta}
        return {"rope_parameters": {"full_attention": full, "sliding_attention": sliding},
                "hidden_activation": GEMMA_ACTIVATION, "attention_bias": self.qkv_bias,
                "query_pre_attn_scalar": self.query_pre_attn_scalar or self.head_dim,
                "sliding_window": self.sliding_window or None,
                "layer_types": list(self.layer_types) or ["full_attention"] * self.num_hidden_layers,
                "final_logit_softcapping": self.final_logit_softcapping or None, "attn_logit_softcapping": None}

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(not_a_checkpoint(path))
        try:
            d = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)


def _layer_types(d: dict[str, Any], family: str) -> tuple[str, ...]:
    n = d["num_hidden_layers"]
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    if family == "gpt_oss":  # sliding first, then alternating, as the released checkpoints
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n))
    if family == "gemma3":  # every sliding_window_pattern-th layer full, the others sliding (Gemma3TextConfig)
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))
    if not d.get("sliding_window") or not d.get("use_sliding_window", family == "mistral"):
        return ()
    first = 0 if family == "mistral" else d.get("max_window_layers", n)  # Qwen: layers from max_window_layers slide
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))


def _attention_fields(d: dict[str, Any], family: str) -> dict[str, Any]:
    types = _layer_types(d, family)
    if "sliding_attention" not in types:
        types = ()
    return dict(layer_types=types, sliding_window=int(d.get("sliding_window") or 0) if types else 0,
                attention_sinks=family == "gpt_oss")


def _moe_fields(d: dict[str, Any], family: str) -> dict[str, Any]:
    if family == "qwen3_moe":
        n, step = d["num_hidden_layers"], d.get("decoder_sparse_step") or 1
        only = set(d.get("mlp_only_layers") or ())
        return dict(num_experts=d.get("num_experts") or d["num_local_experts"],
                    num_experts_per_tok=d["num_experts_per_tok"], moe_intermediate_size=d["moe_intermediate_size"],
                    norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                    dense_layers=tuple(i for i in range(n) if i in only or (i + 1) % step))
    if family == "gpt_oss":  # softmax over the top-k logits: the full softmax's top-k, renormalised
        return dict(num_experts=d["num_local_experts"], num_experts_per_tok=d["num_experts_per_tok"],
                    moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True,
                    swiglu_limit=float(d.get("swiglu_limit", 7.0)), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))
    if family == "gemma4" and d.get("enable_moe_block"):  # beside the dense MLP in every layer
        return dict(num_experts=d["num_experts"], num_experts_per_tok=d["top_k_experts"],
                    moe_intermediate_size=d["moe_intermediate_size"], norm_topk_prob=True)
    return {}


def _text_decoder(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text decoder: its text_config, with what the outer config says of the whole model
    (special token ids, dtype, tied embeddings, name) where the text_config is silent."""
    text = dict(d.get("text_config") or {})
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "torch_dtype", "dtype",
                "_name_or_path"):
        if text.get(key) is None and d.get(key) is not None:
            text[key] = d[key]
    return text


GEMMA_ACTIVATION = "gelu_pytorch_tanh"
# Gemma3TextConfig's defaults, which the hub's multimodal configs rely on (their text_config names only what differs).
_GEMMA3_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                        max_position_embeddings=131_072, tie_word_embeddings=True, query_pre_attn_scalar=256,
                        sliding_window=4096, hidden_activation=GEMMA_ACTIVATION, bos_token_id=2, eos_token_id=1,
                        pad_token_id=0)


def _gemma3_dict(d: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 text config as the other families spell theirs: Gemma3TextConfig's defaults where it is silent, the
    full-attention layers' RoPE as rope_theta / rope_scaling and the sliding layers' base as sliding_rope_theta;
    what peagle does not implement refused by name."""
    d = {**_GEMMA3_DEFAULTS, **d}
    activation = d.get("hidden_activation") or d.get("hidden_act")
    if activation != GEMMA_ACTIVATION:
        raise UnsupportedModelError(f"Gemma 3 with hidden_activation {activation!r} is not supported; only "
                                    f"{GEMMA_ACTIVATION!r} (GeGLU with tanh-approximated GELU)")
    if d.get("attn_logit_softcapping"):
        raise UnsupportedModelError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention (an embedding model's) is not supported: peagle "
                                    "serves causal decoders")
    rope = d.get("rope_parameters") or {}
    per_type = "full_attention" in rope or "sliding_attention" in rope
    full = dict(rope.get("full_attention") or {}) if per_type else dict(rope)
    sliding = dict(rope.get("sliding_attention") or {}) if per_type else {}
    full = {**(d.pop("rope_scaling", None) or {}), **full}  # older configs: rope_scaling scales the full layers
    full["rope_theta"] = full.get("rope_theta", d.pop("rope_theta", 1_000_000.0))
    if sliding.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"RoPE scaling on Gemma's sliding layers ({sliding['rope_type']!r}) is not "
                                    "supported")
    d.pop("rope_theta", None)
    d["rope_parameters"] = full
    d["sliding_rope_theta"] = sliding.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))
    return d


_GEMMA4_DEFAULTS = dict(vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                        max_position_embeddings=131_072, tie_word_embeddings=True, sliding_window=512,
                        hidden_activation=GEMMA_ACTIVATION, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262_144, global_head_dim=512,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                            "rope_theta": 1_000_000.0}})


def _gemma4_dict(d: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 4 text config with Gemma4TextConfig's defaults where it is silent and its last layer global (as
    transformers forces it); rope_theta / sliding_rope_theta from the per-layer-type RoPE, which stays in `extra` for
    models/gemma4.py (the global layers' proportional RoPE), as do its other fields."""
    d = {**_GEMMA4_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    activation = d.get("hidden_activation")
    if activation != GEMMA_ACTIVATION:
        raise UnsupportedModelError(f"Gemma 4 with hidden_activation {activation!r} is not supported; only "
                                    f"{GEMMA_ACTIVATION!r}")
    if d.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("use_bidirectional_attention='all' (an embedding model's) is not supported: "
                                    "peagle serves causal decoders")
    if d.get("num_kv_shared_layers", 0) >= d["num_hidden_layers"]:
        raise UnsupportedModelError("a Gemma 4 whose every layer reuses another model's KV states "
                                    "(num_kv_shared_layers = num_hidden_layers) is not supported")
    n = d["num_hidden_layers"]
    types = list(d.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    types[-1] = "full_attention"
    d["layer_types"] = types
    rope = d["rope_parameters"]
    d["rope_theta"] = rope["full_attention"]["rope_theta"]
    d["sliding_rope_theta"] = rope["sliding_attention"]["rope_theta"]
    d["query_pre_attn_scalar"] = 0  # its attention scales scores by 1, which models/gemma4.py carries into q
    return d


def _gemma_fields(d: dict[str, Any], family: str) -> dict[str, Any]:
    if family not in ("gemma3", "gemma4"):
        return {}
    return dict(sliding_rope_theta=float(d["sliding_rope_theta"]),
                query_pre_attn_scalar=int(d["query_pre_attn_scalar"]),
                final_logit_softcapping=float(d.get("final_logit_softcapping") or 0.0))
