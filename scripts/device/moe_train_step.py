"""A P-EAGLE training run against a mixture-of-experts target at its real shape (random weights): tokens/s and peak
memory on one GPU (issue 49's last row).

Usage: python scripts/device/moe_train_step.py SHAPE OUT.json --tokenizer DIR --data DIR [DIR ...] [--steps 60]
       [-- more `peagle train` arguments]
SHAPE is one of moe_check.py's (qwen3-30b-a3b, gpt-oss-20b), or a config.json file of another shape; DIR's tokenizer
only needs ids that fit the vocabulary.
The target is built on the GPU from its config alone (`peagle train --load-format dummy`); the head it trains is
meaningless. The steady rate is the mean of the logged intervals after the first (compilation); the JSON holds them
all beside the peak memory and the command.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from moe_check import SHAPES  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", help=f"{', '.join(sorted(SHAPES))}, or a config.json")
    ap.add_argument("out")
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json (and tokenizer_config.json)")
    ap.add_argument("--data", nargs="+", required=True, help="peagle train --data directories")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--max-length", type=int, default=8192)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: more `peagle train` arguments
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if args.shape in SHAPES:
        config = SHAPES[args.shape]
    elif Path(args.shape).is_file():
        config = json.loads(Path(args.shape).read_text())
    else:
        ap.error(f"shape {args.shape!r}: expected one of {', '.join(sorted(SHAPES))} or a config.json file")
    work = Path(tempfile.mkdtemp())
    target = work / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    for f in Path(args.tokenizer).glob("tokenizer*"):
        shutil.copy(f, target)
    cmd = [sys.executable, "-m", "peagle", "train", "--target", str(target), "--load-format", "dummy", "--data",
           *args.data, "--method", "peagle", "--num-layers", "4", "--k-train", "8", "--max-length",
           str(args.max_length), "--steps", str(args.steps), "--log-every", "10", "--eval-fraction", "0",
           "--save-every", "1000000", "--out", str(work / "run"), *extra]
    print(" ".join(cmd), flush=True)
    rc = subprocess.run(cmd).returncode
    rows = [json.loads(line) for line in (work / "run" / "train_log.jsonl").read_text().splitlines()] \
        if (work / "run" / "train_log.jsonl").is_file() else []
    intervals = {}
    for r in rows:
        if r.get("kind") == "train" and r.get("tokens_per_s") is not None:
            intervals[(r["step"] - 1) // 10] = r  # the steps of one logged interval share its rates
    steady = [r for i, r in sorted(intervals.items()) if i > min(intervals, default=0)]
    result = {"shape": args.shape, "rc": rc, "command": cmd, "steps": args.steps, "max_length": args.max_length,
              "tokens_per_s": (sum(r["tokens_per_s"] for r in steady) / len(steady)) if steady else None,
              "peak_memory_gb": max((r.get("peak_memory_gb") or 0 for r in rows), default=None),
              "intervals": [{k: r.get(k) for k in ("step", "tokens_per_s", "positions_per_s", "step_s", "mfu",
                                                   "peak_memory_gb")} for _, r in sorted(intervals.items())]}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("intervals", "command")}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
