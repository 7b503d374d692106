"""Device measurement for training: peak GPU memory and trained positions/s of a P-EAGLE head by sequence length
and number of sequence-partition segments (the memory/speed table of the training issue).

Usage: python scripts/device/train_memory.py TARGET_DIR OUT.json --data DIR [DIR ...]
       [--lengths 2048,8192,16384] [--segments 1,2,4,8] [--steps 5]
Each (length, segments) point trains a fresh 4-layer head for a few steps on packed sequences of that length; the
first two steps (compilation of new shapes) are not counted. Lengths beyond the target's max_position_embeddings
run on a copy of its config with that limit raised (same weights): packed documents keep their own positions, so
this measures the cost of the longer sequence, not a model that was trained on it. An out-of-memory point is
recorded as such and the sweep goes on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from peagle.training.config import TrainConfig
from peagle.training.distributed import DistContext
from peagle.training.trainer import LOG_FILE, build_trainer

COUNTED_FROM = 2  # steps before this index compile new shapes


def target_for(target: Path, length: int, scratch: Path) -> Path:
    config = json.loads((target / "config.json").read_text())
    if length <= config.get("max_position_embeddings", length):
        return target
    copy = scratch / f"target-{length}"
    if not copy.exists():
        copy.mkdir(parents=True)
        for f in target.iterdir():
            if f.name != "config.json":
                (copy / f.name).symlink_to(f.resolve())
        (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": length}))
    return copy


def measure(target: Path, data: list[Path], length: int, segments: int, steps: int, scratch: Path,
            loss_chunk: int = 4096) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(target=target_for(target, length, scratch), data=tuple(data),
                      out=scratch / f"run-{length}-{segments}", method="peagle", k_train=8, num_segments=segments,
                      max_length=length, steps=steps, save_every=10 ** 9, eval_every=10 ** 9, eval_fraction=0.0,
                      loss_chunk=loss_chunk, log_every=1)  # every step read back alone: its own time and memory
    point = {"max_length": length, "num_segments": segments, "loss_chunk": loss_chunk}
    try:
        trainer = build_trainer(cfg, DistContext(0, 1, device))
        trainer.train()
        rows = [json.loads(line) for line in (cfg.out / LOG_FILE).read_text().splitlines()]
        records = [r for r in rows if r["kind"] == "train"]
    except torch.OutOfMemoryError as e:
        point["error"] = f"out of memory: {str(e).splitlines()[0]}"
        return point
    finally:
        trainer = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    counted = records[COUNTED_FROM:] or records
    point.update({
        "peak_memory_gb": max(r["peak_memory_gb"] for r in counted),
        "positions_per_s": statistics.median(r["positions_per_s"] for r in counted),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in counted),
        "step_s": statistics.median(r["step_s"] for r in counted),
        "steps_counted": len(counted),
    })
    return point


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--data", type=Path, nargs="+", required=True)
    parser.add_argument("--lengths", default="2048,8192,16384")
    parser.add_argument("--segments", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--loss-chunk", type=int, default=4096,
                        help="elements per loss chunk: its full-vocabulary logits are a fixed share of the peak")
    args = parser.parse_args()
    points = []
    with tempfile.TemporaryDirectory() as scratch:
        for length in map(int, args.lengths.split(",")):
            for segments in map(int, args.segments.split(",")):
                point = measure(args.target, args.data, length, segments, args.steps, Path(scratch),
                                args.loss_chunk)
                print(json.dumps(point), flush=True)
                points.append(point)
                args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                                                else "cpu", "points": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
