"""`peagle drafter init`, `peagle inspect`, `peagle export`."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from peagle.drafters.checkpoint import (FORMATS, check_fits, check_output_dir, export_drafter, read_config,
                                        save_drafter)
from peagle.drafters.config import DEFAULT_NUM_LAYERS, DEFAULT_NUM_SPECULATIVE_TOKENS, METHODS
from peagle.drafters.drafter import Drafter
from peagle.drafters.target import TargetParts
from peagle.drafters.vocab import read_token_corpus
from peagle.models.config import ModelConfig
from peagle.models.loader import parse_dtype
from peagle.models.weights import SafetensorsCheckpoint

VOCAB_MAPS = ("d2t", "t2d")  # buffers, not parameters
EMBEDDING = "embed_tokens.weight"


def register(subparsers) -> None:
    drafter = subparsers.add_parser("drafter", help="create drafter heads")
    actions = drafter.add_subparsers(dest="drafter_command", metavar="ACTION", required=True)
    init = actions.add_parser(
        "init", help="a randomly initialised drafter for a target (for tests and timing)",
        description="Write a drafter head for --target with random layers, the target's embedding and its "
                    "output rows as lm_head, in the speculators format.",
    )
    init.add_argument("--target", type=Path, required=True, help="target checkpoint directory")
    init.add_argument("--method", choices=METHODS, required=True)
    init.add_argument("--num-layers", type=int, help=f"drafter layers (default {_per_method(DEFAULT_NUM_LAYERS)})")
    init.add_argument("--draft-vocab-size", type=int,
                      help="draft vocabulary size (default: the whole target vocabulary)")
    init.add_argument("--vocab-corpus", type=Path,
                      help="token ids to pick the draft vocabulary from by frequency (JSON Lines of id lists or "
                           "objects with input_ids, or whitespace-separated ids per line)")
    init.add_argument("--num-speculative-tokens", type=int,
                      help=f"K the head is meant for (default {_per_method(DEFAULT_NUM_SPECULATIVE_TOKENS)})")
    init.add_argument("--aux-layer-ids", type=int, nargs=3, metavar="ID",
                      help="target layers whose input residual streams feed the drafter (default 2, L/2, L-3)")
    init.add_argument("--mask-token-id", type=int, help="P-EAGLE mask token (default: a reserved token)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--out", type=Path, required=True, help="output directory")
    init.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    init.set_defaults(func=_init)

    inspect = subparsers.add_parser("inspect", help="describe a drafter checkpoint")
    inspect.add_argument("path", type=Path, help="drafter checkpoint directory")
    inspect.add_argument("--target", type=Path, help="target checkpoint: check the fit, report parameter share")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(func=_inspect)

    export = subparsers.add_parser("export", help="write a drafter checkpoint in another format")
    export.add_argument("path", type=Path, help="drafter checkpoint directory (either format)")
    export.add_argument("--format", choices=FORMATS, required=True,
                        help="speculators (vLLM-native, peagle's own) or aws (HF-Llama style, midlayer.*)")
    export.add_argument("out", type=Path, help="output directory")
    export.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    export.set_defaults(func=_export)


def _per_method(defaults: dict[str, int]) -> str:
    return ", ".join(f"{v} for {k}" for k, v in defaults.items())


def _init(args: argparse.Namespace) -> int:
    check_output_dir(args.out, args.force)
    if args.vocab_corpus and not args.draft_vocab_size:
        raise ValueError("--vocab-corpus picks a draft vocabulary of --draft-vocab-size ids; give that size too")
    parts = TargetParts.of(args.target)
    drafter = Drafter.for_target(
        parts, args.method, args.num_layers,
        draft_vocab=args.draft_vocab_size,
        vocab_corpus=read_token_corpus(args.vocab_corpus) if args.vocab_corpus else None,
        aux_layer_ids=args.aux_layer_ids,
        mask_token_id=args.mask_token_id,
        num_speculative_tokens=args.num_speculative_tokens,
        seed=args.seed,
    )
    drafter.to(parse_dtype(parts.config.torch_dtype))
    save_drafter(drafter, args.out, force=args.force)
    cfg = drafter.config
    print(f"wrote a {cfg.method} drafter ({cfg.num_layers} layers, draft vocabulary {cfg.draft_vocab_size}) "
          f"to {args.out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    export_drafter(args.path, args.out, args.format, force=args.force)
    print(f"wrote {args.path} in the {args.format} format to {args.out}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    info = describe(args.path, args.target)
    if args.json:
        print(json.dumps(info))
    else:
        print(_as_text(info))
    # A head that does not fit --target is a failed check for scripts, as a load would fail.
    return 1 if info.get("fits_target") is False else 0


def describe(path: Path, target: Path | None = None) -> dict[str, Any]:
    config, fmt = read_config(path)
    shapes = _shapes(path)
    params = sum(math.prod(s) for name, s in shapes.items() if name not in VOCAB_MAPS)
    embedding = math.prod(shapes[EMBEDDING]) if EMBEDDING in shapes else 0
    info: dict[str, Any] = {
        "format": fmt,
        "method": config.method,
        "num_layers": config.num_layers,
        "layer_family": config.transformer_layer_config.family,
        "hidden_size": config.hidden_size,
        "num_speculative_tokens": config.num_speculative_tokens,
        "draft_vocab_size": config.draft_vocab_size,
        "target_vocab_size": config.target_vocab_size,
        "aux_layer_ids": list(config.aux_layer_ids) if config.aux_layer_ids else None,
        "mask_token_id": config.mask_token_id,
        "norm_before_residual": config.norm_before_residual,
        "target": {"name_or_path": config.target_name_or_path, "architecture": config.target_architecture,
                   "hidden_size": config.target_hidden_size},
        "num_parameters": params,
        "num_parameters_without_embedding": params - embedding,
        "stores_embedding": EMBEDDING in shapes,
    }
    if target is not None:
        target_params = sum(math.prod(s) for s in _shapes(target).values())
        info["target_parameters"] = target_params
        info["share_of_target"] = (params - embedding) / target_params
        try:
            check_fits(config, ModelConfig.from_dir(target))
            info["fits_target"], info["mismatch"] = True, None
        except ValueError as e:
            info["fits_target"], info["mismatch"] = False, str(e)
    return info


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    ckpt = SafetensorsCheckpoint(path)
    return {name: ckpt.shape(name) for name in ckpt.file_of}


def _as_text(info: dict[str, Any]) -> str:
    aux = ", ".join(map(str, info["aux_layer_ids"])) if info["aux_layer_ids"] else "the target's default (2, L/2, L-3)"
    target = info["target"]
    rows = [
        ("method", f"{info['method']}{' (parallel drafting)' if info['method'] == 'peagle' else ''}"),
        ("format", info["format"]),
        ("layers", f"{info['num_layers']} {info['layer_family']} layers, hidden {info['hidden_size']}"),
        ("trained K", str(info["num_speculative_tokens"])),
        ("draft vocabulary", f"{info['draft_vocab_size']} of {info['target_vocab_size']} target ids"),
        ("aux layer ids", aux),
        ("mask token id", "-" if info["mask_token_id"] is None else str(info["mask_token_id"])),
        ("norm_before_residual", str(info["norm_before_residual"]).lower()),
        ("target", f"{target['name_or_path'] or 'unknown'} ({target['architecture'] or 'architecture unknown'}, "
                   f"hidden {target['hidden_size']})"),
        ("parameters", f"{info['num_parameters_without_embedding']:,} without the embedding"
                       + (f", {info['num_parameters']:,} with it" if info["stores_embedding"]
                          else " (the embedding is the target's)")),
    ]
    if "target_parameters" in info:
        rows.append(("share of target", f"{100 * info['share_of_target']:.2f}% of {info['target_parameters']:,}"))
        rows.append(("fits target", "yes" if info["fits_target"] else f"no: {info['mismatch']}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
