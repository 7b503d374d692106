"""Drafter checkpoints on disk: save, load for a target (with fit checks), convert between formats.

Two layouts are read (detected from config.json and tensor names) and written: "speculators" (peagle's native
format, served by vLLM) and "aws" (HF-Llama style with `midlayer.*`). In memory both become the speculators tensor
names (`DrafterCheckpoint.tensors`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from peagle.drafters import aws_format, speculators_format
from peagle.drafters.config import DrafterConfig
from peagle.drafters.drafter import Drafter
from peagle.drafters.vocab import DraftVocab
from peagle.models.config import ModelConfig
from peagle.models.layers import RotaryEmbedding
from peagle.models.llama import LlamaModel
from peagle.models.loader import parse_dtype
from peagle.models.weights import SafetensorsCheckpoint, save_safetensors

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
FORMATS = ("speculators", "aws")
EMBEDDING = "embed_tokens.weight"


class DrafterMismatchError(ValueError):
    """A drafter head that does not belong to the target it is loaded for."""

    def __init__(self, field: str, expected: Any, found: Any):
        self.field, self.expected, self.found = field, expected, found
        super().__init__(
            f"the drafter does not fit this target: {field} expected {expected} (the target's), "
            f"found {found} (the drafter's)"
        )


@dataclass
class DrafterCheckpoint:
    config: DrafterConfig
    tensors: dict[str, torch.Tensor]  # speculators names and shapes
    format: str


def read_config(path: str | Path) -> tuple[DrafterConfig, str]:
    """The head's config and the layout it is stored in, without reading the weights."""
    path = Path(path)
    d = _read_json(path / CONFIG_FILE)
    if speculators_format.is_speculators_config(d):
        return speculators_format.config_from_dict(d), "speculators"
    names = list(SafetensorsCheckpoint(path).file_of)
    if aws_format.is_aws_layout(d, names):
        return aws_format.config_from_dict(d, names), "aws"
    raise ValueError(
        f"{path} is not a drafter checkpoint: its config.json has neither speculators_model_type (speculators "
        "format) nor draft_vocab_size / ptd_token_id (HF-Llama-style head)"
    )


def read_checkpoint(path: str | Path) -> DrafterCheckpoint:
    config, fmt = read_config(path)
    ckpt = SafetensorsCheckpoint(path)
    tensors = {name: ckpt.get(name) for name in ckpt.file_of}
    if fmt == "aws":
        tensors = aws_format.from_aws_names(tensors)
    if "d2t" not in tensors and config.draft_vocab_size == config.target_vocab_size:
        # Left out on disk when the draft vocabulary is the whole target vocabulary (by peagle and speculators).
        identity = DraftVocab.identity(config.target_vocab_size)
        tensors.update(d2t=identity.d2t, t2d=identity.t2d)
    return DrafterCheckpoint(config, tensors, fmt)


def write_checkpoint(ckpt: DrafterCheckpoint, out: str | Path, format: str = "speculators",
                     force: bool = False) -> Path:
    """Writes config.json + safetensors into `out` through a temporary directory renamed into place."""
    if format not in FORMATS:
        raise ValueError(f"unknown drafter checkpoint format {format!r}; choose one of {', '.join(FORMATS)}")
    tensors = speculators_format.without_identity_maps(ckpt.tensors, ckpt.config)
    if format == "aws":
        config, tensors = aws_format.config_to_dict(ckpt.config), aws_format.to_aws_names(tensors)
    else:
        config = speculators_format.config_to_dict(ckpt.config)

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_safetensors(sorted(tensors.items()), tmp)

    return _write_dir(Path(out), force, write)


def save_drafter(drafter: Drafter, out: str | Path, format: str = "speculators", force: bool = False) -> Path:
    state = {name: t.detach().cpu() for name, t in drafter.state_dict().items()}
    tensors = speculators_format.tensors_from_state_dict(state, drafter.config)
    # config.json names the dtype the weights are stored in, whatever the module was built with.
    layers = drafter.config.transformer_layer_config
    stored = dataclasses.replace(layers, torch_dtype=str(drafter.fc.weight.dtype).removeprefix("torch."))
    config = dataclasses.replace(drafter.config, transformer_layer_config=stored)
    return write_checkpoint(DrafterCheckpoint(config, tensors, format), out, format, force)


def export_drafter(src: str | Path, out: str | Path, format: str, force: bool = False) -> Path:
    """Converts a drafter checkpoint (either layout) to `format`; tensors are copied bit for bit."""
    if Path(out).resolve() == Path(src).resolve():
        raise ValueError(f"export would overwrite its source {src}; choose another output directory")
    return write_checkpoint(read_checkpoint(src), out, format, force)


def load_drafter(
    path: str | Path,
    target_config: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    target: LlamaModel | None = None,
) -> Drafter:
    """The drafter stored at `path`, checked against the target it will draft for, in eval mode.

    `dtype` None keeps the stored dtype. A head without embed_tokens (speculators EAGLE-3 heads often leave it to
    the target, as vLLM shares it) takes a copy of `target`'s embedding. Raises DrafterMismatchError (a ValueError)
    when the head belongs to another target.
    """
    ckpt = read_checkpoint(path)
    config = ckpt.config
    if config.aux_layer_ids is None:
        config = dataclasses.replace(config, aux_layer_ids=target_config.default_aux_layer_ids)
    check_fits(config, target_config)
    tensors = _complete(ckpt.tensors, config, target, path)
    drafter = _empty_drafter(config, DraftVocab(d2t=tensors["d2t"].long(), t2d=tensors["t2d"].bool()))
    state = speculators_format.state_dict_from_tensors(tensors, drafter.state_dict())
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.to(device=device, dtype=parse_dtype(dtype) if dtype is not None else None)
    logger.info("loaded %s drafter (%d layers, draft vocab %d) from %s", config.method, config.num_layers,
                config.draft_vocab_size, path)
    return drafter.eval()


def check_fits(config: DrafterConfig, target: ModelConfig) -> None:
    """Refuses a head trained for another target: hidden size, vocabulary, aux layer ids, family."""
    if config.target_hidden_size != target.hidden_size:
        raise DrafterMismatchError("hidden_size", target.hidden_size, config.target_hidden_size)
    if config.target_vocab_size != target.vocab_size:
        raise DrafterMismatchError("vocab_size", target.vocab_size, config.target_vocab_size)
    n = target.num_hidden_layers
    if config.aux_layer_ids is not None and not all(0 <= i <= n for i in config.aux_layer_ids):
        raise DrafterMismatchError("aux_layer_ids", f"ids in 0..{n}", list(config.aux_layer_ids))
    if config.target_architecture is not None and config.target_family != target.family:
        raise DrafterMismatchError("family", target.family, config.target_family or config.target_architecture)


def _complete(tensors: dict[str, torch.Tensor], config: DrafterConfig, target: LlamaModel | None,
              path) -> dict[str, torch.Tensor]:
    """The stored tensors plus the target's embedding when the head shares it; refuses a head without its maps."""
    if "d2t" not in tensors or "t2d" not in tensors:
        raise ValueError(
            f"the drafter at {path} has a draft vocabulary of {config.draft_vocab_size} ids but lacks d2t / t2d, "
            "the maps between draft and target ids"
        )
    if EMBEDDING in tensors:
        return tensors
    stored = next(t.dtype for t in tensors.values() if t.is_floating_point())
    return {**tensors, EMBEDDING: _shared_embedding(config, target, path).to(stored)}


def _shared_embedding(config: DrafterConfig, target: LlamaModel | None, path) -> torch.Tensor:
    if target is None:
        raise ValueError(
            f"the drafter at {path} carries no embed_tokens (it shares the target's, as vLLM does); "
            "pass the loaded target model (target=...) to copy its embedding"
        )
    if config.hidden_size != target.config.hidden_size:
        raise DrafterMismatchError("hidden_size", target.config.hidden_size, config.hidden_size)
    return target.embed_tokens.weight.detach().to("cpu", copy=True)


def _empty_drafter(config: DrafterConfig, vocab: DraftVocab) -> Drafter:
    """A drafter without memory behind its parameters, to be filled by load_state_dict(assign=True)."""
    with torch.device("meta"):
        drafter = Drafter(config, vocab)
    # RoPE frequencies are computed, not loaded; the meta context left them without data.
    lc = config.transformer_layer_config
    drafter.rope = RotaryEmbedding(lc.head_dim, lc.rope_theta, lc.rope_scaling, lc.max_position_embeddings)
    return drafter


def check_output_dir(out: str | Path, force: bool) -> None:
    """Refuses to write into an existing file or, without `force`, a non-empty directory."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty; choose another directory or pass --force to replace it")


def _write_dir(out: Path, force: bool, write: Callable[[Path], None]) -> Path:
    check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"{file.parent} has no {file.name}; is it a drafter checkpoint directory?")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
