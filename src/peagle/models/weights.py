"""Hugging Face <-> peagle tensor names, and safetensors checkpoints read and written with checks.

peagle fuses two groups of HF tensors (concatenated along dim 0, weights and biases alike):
    layers.N.self_attn.qkv_proj  = cat(q_proj, k_proj, v_proj)
    layers.N.mlp.gate_up_proj    = cat(gate_proj, up_proj)
Every other tensor keeps its HF name without the `model.` prefix; `lm_head` has no prefix on either side and is
absent from peagle models with tied embeddings. A mixture of experts (`layers.N.mlp`: router, w13, w2, b13, b2) is
read from each family's layout (`_expert_sources`); quantised tensors are dequantised as they are read
(models/quantized.py). A multimodal checkpoint's text decoder is read under the text-only names (DECODER_PREFIXES).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from peagle.models import quantized
from peagle.models.config import ModelConfig

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# peagle module -> the HF modules it concatenates, in order.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Tensors some checkpoints carry that are recomputed rather than loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A multimodal checkpoint's text decoder (Gemma3ForConditionalGeneration) is read under a text-only checkpoint's
# names: prefixes as transformers >= 5 saves them, then as the hub's older checkpoints spell them.
DECODER_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                    ("language_model.lm_head.", "lm_head."))
_EXPERT_PARAMS = ("router.weight", "router.bias", "w13", "w2", "b13", "b2")


def fused_split_sizes(cfg: ModelConfig, fused: str) -> list[int]:
    if fused == "self_attn.qkv_proj":
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def hf_names(peagle_name: str) -> list[str]:
    """HF tensor names that make up one peagle tensor (one name, or the parts of a fused tensor)."""
    if peagle_name.startswith("lm_head."):
        return [peagle_name]
    for fused, parts in FUSED.items():
        marker = f".{fused}."
        if marker in peagle_name:
            head, tail = peagle_name.split(marker)
            return [f"model.{head}.{part}.{tail}" for part in parts]
    return [f"model.{peagle_name}"]


def _fused_module(peagle_name: str) -> str | None:
    return next((f for f in FUSED if f".{f}." in peagle_name), None)


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """peagle tensors -> HF-named tensors (fused tensors split), ready for `save_safetensors`."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        names = hf_names(name)
        fused = _fused_module(name)
        parts = tensor.split(fused_split_sizes(cfg, fused), dim=0) if fused else (tensor,)
        for hf_name, part in zip(names, parts, strict=True):
            out[hf_name] = part.contiguous()
    return out


class SafetensorsCheckpoint:
    """The safetensors files of one checkpoint directory (single file or sharded with an index), opened lazily.

    Opening validates every file's header, which is where truncated and corrupted files show up.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fp8_block = _fp8_block(self.path)
        self.files = self._files()
        self._handles = {}
        self.file_of: dict[str, Path] = {}
        self._stored: dict[str, str] = {}  # name -> the name in the file, where a decoder prefix was rewritten
        for file in self.files:
            handle = self._open(file)
            self._handles[file] = handle
            for stored in handle.keys():
                name = _text_decoder_name(stored)
                self.file_of[name] = file
                if name != stored:
                    self._stored[name] = stored

    def _files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index} is not a valid safetensors index (no readable weight_map): {e}") from None
            files = [self.path / f for f in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(
                    f"shard(s) {', '.join(missing)} listed in {index} are missing from {self.path}; "
                    "download the complete checkpoint"
                )
            return files
        if (self.path / SINGLE_FILE).is_file():
            return [self.path / SINGLE_FILE]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{self.path} holds no *.safetensors weights (expected {SINGLE_FILE} or {INDEX_FILE} with shards)"
            )
        return files

    @staticmethod
    def _open(file: Path):
        try:
            return safe_open(str(file), framework="pt", device="cpu")
        except SafetensorError as e:
            raise ValueError(
                f"{file} is not a readable safetensors file (truncated or corrupted?): {e}; "
                "re-download or re-convert it"
            ) from None

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds `name`, plainly or MXFP4-quantised."""
        return name in self.file_of or name + quantized.MXFP4_BLOCKS in self.file_of

    def where(self, name: str) -> Path:
        return self.file_of.get(name) or self.file_of[name + quantized.MXFP4_BLOCKS]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as a full-precision checkpoint would hold it."""
        if name not in self.file_of:
            return quantized.mxfp4_shape(self._raw_shape(name + quantized.MXFP4_BLOCKS))
        return self._raw_shape(name)

    def _raw_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[name]].get_slice(self._stored.get(name, name)).get_shape())

    def companions(self, name: str) -> list[str]:
        """The stored tensors that make up `name`: itself, or its quantised parts and scales."""
        if name not in self.file_of:
            return [name + quantized.MXFP4_BLOCKS, name + quantized.MXFP4_SCALES]
        scale = name.removesuffix("weight") + quantized.FP8_SCALE
        return [name, scale] if name.endswith("weight") and scale in self.file_of else [name]

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor on `device`; a quantised one dequantised there to `dtype`, which it then requires."""
        parts = [self._read(n).to(device) for n in self.companions(name)]
        if len(parts) == 1:
            if quantized.is_fp8(parts[0].dtype):
                raise ValueError(f"tensor {name} is {parts[0].dtype} without the block scales peagle reads "
                                 f"({quantized.FP8_SCALE}); only block-scaled FP8 checkpoints load")
            return parts[0]
        if dtype is None:
            raise ValueError(f"tensor {name} is quantised: give the dtype to dequantise it to")
        if name in self.file_of:
            if self.fp8_block is None:
                raise ValueError(f"{self.path}/config.json names no weight_block_size for the FP8 tensor {name}")
            return quantized.dequantize_fp8_blocks(parts[0], parts[1], self.fp8_block, dtype)
        return quantized.dequantize_mxfp4(parts[0], parts[1], dtype)

    def _read(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self.file_of[name]].get_tensor(self._stored.get(name, name))
        except SafetensorError as e:
            raise ValueError(f"cannot read tensor {name} from {self.file_of[name]} (corrupted file?): {e}") from None


def _text_decoder_name(name: str) -> str:
    for prefix, plain in DECODER_PREFIXES:
        if name.startswith(prefix):
            return plain + name.removeprefix(prefix)
    return name


def _fp8_block(path: Path) -> tuple[int, int] | None:
    try:
        qc = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, json.JSONDecodeError):
        return None
    block = qc.get("weight_block_size") if qc.get("quant_method") == "fp8" else None
    return tuple(block) if block else None


def _expert_sources(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The HF tensors (name, shape) of one parameter of a mixture of experts, `layers.N.mlp.<param>`."""
    head, param = name.split(".mlp.")
    base = f"model.{head}.mlp"
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if cfg.family == "gpt_oss":  # stacked experts, gate and up interleaved, [E, in, out]
        stacked = {"router.weight": ("router.weight", (e, h)), "router.bias": ("router.bias", (e,)),
                   "w13": ("experts.gate_up_proj", (e, h, 2 * i)), "w2": ("experts.down_proj", (e, i, h)),
                   "b13": ("experts.gate_up_proj_bias", (e, 2 * i)), "b2": ("experts.down_proj_bias", (e, h))}
        hf, hf_shape = stacked[param]
        return [(f"{base}.{hf}", hf_shape)]
    if param == "router.weight":  # Qwen3-MoE: one tensor per expert and projection
        return [(f"{base}.gate.weight", shape)]
    if param == "w13":
        return [(f"{base}.experts.{x}.{proj}.weight", (i, h)) for x in range(e) for proj in ("gate_proj", "up_proj")]
    if param == "w2":
        return [(f"{base}.experts.{x}.down_proj.weight", (h, i)) for x in range(e)]
    raise ValueError(f"{cfg.family} experts have no {param}")


def _combine_experts(name: str, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    param = name.split(".mlp.")[1]
    if cfg.family == "gpt_oss":
        t = parts[0]
        if param in ("w13", "b13"):  # interleaved gate/up columns -> gate rows, then up rows
            t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
        return t.transpose(1, 2).contiguous() if param in ("w13", "w2") else t
    if param == "w13":
        return torch.stack([torch.cat(parts[x:x + 2]) for x in range(0, len(parts), 2)])
    return torch.stack(parts) if param == "w2" else parts[0]


def _is_expert_param(name: str, cfg: ModelConfig) -> bool:
    return cfg.num_experts > 0 and ".mlp." in name and name.split(".mlp.")[1] in _EXPERT_PARAMS


def sources(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The HF tensors (name, shape in full precision) that make up the peagle parameter `name` of `shape`."""
    if _is_expert_param(name, cfg):
        return _expert_sources(name, shape, cfg)
    fused = _fused_module(name)
    shapes = [(size, *shape[1:]) for size in fused_split_sizes(cfg, fused)] if fused else [shape]
    return list(zip(hf_names(name), shapes, strict=True))


def combine(name: str, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The peagle parameter `name` from its HF tensors, in `sources` order."""
    if _is_expert_param(name, cfg):
        return _combine_experts(name, parts, cfg)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def check_checkpoint(ckpt: SafetensorsCheckpoint, model: nn.Module) -> None:
    """Every tensor the model needs is present with the right shape; names the culprits otherwise."""
    cfg: ModelConfig = model.config
    needed = {}
    for name, param in model.state_dict().items():
        needed.update(sources(name, tuple(param.shape), cfg))
    missing = [n for n in needed if not ckpt.has(n)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"checkpoint {ckpt.path} lacks {len(missing)} tensor(s) the {cfg.architecture} config needs: {shown}; "
            "does config.json match these weights?"
        )
    for hf_name, expected in needed.items():
        found = ckpt.shape(hf_name)
        if found != expected:
            raise ValueError(
                f"tensor {hf_name} in {ckpt.where(hf_name).name} has shape {list(found)}, "
                f"but config.json implies {list(expected)}; the weights do not match config.json"
            )
    used = {part for n in needed for part in ckpt.companions(n)}
    extra = [n for n in ckpt.file_of if n not in used and not n.endswith(IGNORED_SUFFIXES)]
    if cfg.tie_word_embeddings:
        extra = [n for n in extra if n != "lm_head.weight"]
    if extra:
        logger.warning("ignoring %d checkpoint tensor(s) the model does not use, e.g. %s", len(extra), extra[:3])


def load_into(model: nn.Module, path: str | Path, dtype: torch.dtype, device: str | torch.device) -> None:
    """Fills `model` (parameters typically on the meta device) from the checkpoint, one tensor at a time.

    Each tensor is read from its memory-mapped file, fused if needed, and cast/moved to (dtype, device) before
    the next one, so peak memory is the target model plus one tensor.
    """
    ckpt = SafetensorsCheckpoint(path)
    check_checkpoint(ckpt, model)
    cfg: ModelConfig = model.config
    state = {}
    for name, param in model.state_dict().items():
        parts = [ckpt.get(n, dtype, device).to(dtype) for n, _ in sources(name, tuple(param.shape), cfg)]
        state[name] = combine(name, parts, cfg)
    model.load_state_dict(state, strict=True, assign=True)


def save_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, max_shard_bytes: int = 2 * 1024**3
) -> list[Path]:
    """Writes HF-named tensors as model.safetensors, or as shards plus model.safetensors.index.json.

    Tensors are consumed one by one and written out when a shard fills up, so a caller may produce them lazily.
    """
    out_dir = Path(out_dir)
    written: list[tuple[Path, list[str]]] = []
    for i, shard in enumerate(_shards(tensors, max_shard_bytes)):
        file = out_dir / f"shard-{i}.safetensors.part"
        save_file(shard, str(file), metadata={"format": "pt"})
        written.append((file, list(shard)))
    if len(written) == 1:
        final = [out_dir / SINGLE_FILE]
    else:
        n = len(written)
        final = [out_dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for (file, names), target in zip(written, final):
        os.replace(file, target)
        weight_map.update({name: target.name for name in names})
        total += target.stat().st_size
    if len(final) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return final


def _shards(tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = tensor.contiguous()
        size += nbytes
    if shard:
        yield shard
