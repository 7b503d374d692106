"""`peagle convert ...`: bring checkpoints from other formats into the Hugging Face layout peagle loads."""

from __future__ import annotations

import argparse
from pathlib import Path

GGUF_DESCRIPTION = """\
Convert a GGUF file (llama.cpp's format) into a Hugging Face checkpoint directory that `peagle` and
`transformers` both load: config.json, model.safetensors (sharded past 2 GiB), tokenizer.json,
tokenizer_config.json (with the chat template) and generation_config.json.

Quantized tensors are dequantized and stored in --dtype; llama.cpp's Q/K row permutation is undone.
Supported architectures: llama (Llama 2/3/3.1/3.2, SmolLM2, Mistral dense), qwen2, qwen3 with a
byte-level BPE tokenizer, and gemma3 (Gemma 3 text, e.g. gemma-3-270m) with its SentencePiece tokenizer,
rebuilt as transformers' GGUF loader builds it. Dequantizing cannot restore the original weights: the
result computes what the GGUF computes (up to rounding to --dtype), not what the unquantized model did.

The output is written to a temporary directory beside OUT_DIR and renamed when complete, so an
interrupted or failed conversion leaves nothing behind. An existing non-empty OUT_DIR is refused
unless --force is given (it is then replaced only after the conversion succeeded).

example:
  peagle convert gguf SmolLM2-135M-Instruct.Q4_1.gguf ./smollm2-135m --dtype bf16
"""


def register(subparsers) -> None:
    convert = subparsers.add_parser(
        "convert", help="convert a checkpoint from another format (GGUF) to a Hugging Face directory",
        description="Convert checkpoints from other formats into Hugging Face safetensors directories.",
    )
    formats = convert.add_subparsers(dest="format", metavar="FORMAT", required=True)
    gguf = formats.add_parser(
        "gguf", help="GGUF file -> Hugging Face checkpoint directory", description=GGUF_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gguf.add_argument("src", metavar="SRC.gguf", type=Path, help="the GGUF file to convert")
    gguf.add_argument("out", metavar="OUT_DIR", type=Path, help="the checkpoint directory to create")
    gguf.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                      help="dtype of the written weights (default: bf16)")
    gguf.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    gguf.set_defaults(func=run_convert_gguf)


def run_convert_gguf(args: argparse.Namespace) -> int:
    from peagle.models.gguf_convert import convert_gguf

    out = convert_gguf(args.src, args.out, dtype=args.dtype, force=args.force)
    print(f"wrote {out} ({args.dtype}); load it with peagle.models.loader.load_model({str(out)!r})")
    return 0
