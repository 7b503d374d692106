"""Hugging Face <-> peagle tensor names, and safetensors checkpoints read and written with checks.

peagle fuses two groups of HF tensors (concatenated along dim 0, weights and biases alike):
    layers.N.self_attn.qkv_proj  = cat(q_proj, k_proj, v_proj)
    layers.N.mlp.gate_up_proj    = cat(gate_proj, up_proj)
Every other tensor keeps its HF name without the `model.` prefix; `lm_head` has no prefix on either side and is
absent from peagle models with tied embeddings.
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
        self.files = self._files()
        self._handles = {}
        self.file_of: dict[str, Path] = {}
        for file in self.files:
            handle = self._open(file)
            self._handles[file] = handle
            for name in handle.keys():
                self.file_of[name] = file

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

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[name]].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self.file_of[name]].get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"cannot read tensor {name} from {self.file_of[name]} (corrupted file?): {e}") from None


def _expected_shapes(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> list[tuple[int, ...]]:
    fused = _fused_module(name)
    if fused is None:
        return [shape]
    return [(size, *shape[1:]) for size in fused_split_sizes(cfg, fused)]


def check_checkpoint(ckpt: SafetensorsCheckpoint, model: nn.Module) -> None:
    """Every tensor the model needs is present with the right shape; names the culprits otherwise."""
    cfg: ModelConfig = model.config
    needed = {}
    for name, param in model.state_dict().items():
        needed.update(zip(hf_names(name), _expected_shapes(name, tuple(param.shape), cfg)))
    missing = [n for n in needed if n not in ckpt.file_of]
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
                f"tensor {hf_name} in {ckpt.file_of[hf_name].name} has shape {list(found)}, "
                f"but config.json implies {list(expected)}; the weights do not match config.json"
            )
    extra = [n for n in ckpt.file_of if n not in needed and not n.endswith(IGNORED_SUFFIXES)]
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
    state = {}
    for name in model.state_dict():
        parts = [ckpt.get(n).to(device=device, dtype=dtype) for n in hf_names(name)]
        state[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
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
