"""Device measurement for training throughput: `peagle train` runs of two code trees side by side, each alone on the
GPU, and a count of host-device synchronisations inside the new trainer's steps.

Usage: python scripts/device/train_throughput.py TARGET_DIR OUT.json --data DIR [DIR ...]
       --runs NAME=SRC:METHOD:K_TRAIN:MAX_LENGTH:BATCH[:ARG,...] [...] [--steps 70 | --seconds 45] [--skip-steps 10]
       [--sync-check SRC]
Each run is `python -m peagle train` with PYTHONPATH=SRC (a source tree: today's `src`, or an older one unpacked
for comparison), a fresh head, and either --steps STEPS (every run does the same work, however long its compilation
takes) or --time-limit SECONDS; its train_log.jsonl gives tokens/s, positions/s, MFU and GPU busy share, as medians
over the steps after the first SKIP (compilation of new shapes). --sync-check runs a few
steps of the trainer in SRC in-process with CUDA's sync debug mode on and reports how many synchronisations each
step made (the logging interval is set beyond the checked steps, so none of its intended reads count).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_run(text: str) -> dict:
    """NAME=SRC:METHOD:K_TRAIN:MAX_LENGTH:BATCH[:ARG,ARG...] (the optional last field: more `peagle train`
    arguments, comma-separated, e.g. --compile-elementwise)."""
    name, _, spec = text.partition("=")
    src, method, k, length, batch, *extra = spec.split(":", 5)
    return {"name": name, "src": src, "method": method, "k_train": int(k), "max_length": int(length),
            "batch_size": int(batch), "extra": [a for a in (extra[0].split(",") if extra else []) if a]}


def train_args(target: Path, data: list[Path], out: Path, run: dict, seconds: float, steps: int,
               extra: list[str]) -> list[str]:
    budget = ["--steps", str(steps)] if steps else ["--steps", "100000", "--time-limit", str(seconds / 60)]
    return [sys.executable, "-m", "peagle", "train", "--target", str(target), "--data", *map(str, data),
            "--method", run["method"], "--out", str(out), "--k-train", str(run["k_train"]),
            "--max-length", str(run["max_length"]), "--batch-size", str(run["batch_size"]), "--lr", "1e-3",
            *budget, "--save-every", "1000000", "--eval-every", "1000000", "--eval-fraction", "0",
            *run.get("extra", []), *extra]


def median(rows: list[dict], key: str):
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def measure(target: Path, data: list[Path], run: dict, seconds: float, steps: int, skip: int, scratch: Path,
            profile: bool, timeout: float) -> dict:
    out = scratch / run["name"]
    extra = ["--profile-steps", "3"] if profile else []
    env = {**os.environ, "PYTHONPATH": run["src"] + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.monotonic()
    try:
        done = subprocess.run(train_args(target, data, out, run, seconds, steps, extra), env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {**run, "wall_s": round(time.monotonic() - start, 1), "error": f"timed out after {timeout:.0f} s: "
                + (e.stderr or b"")[-1500:].decode(errors="replace")}
    point = {**run, "wall_s": round(time.monotonic() - start, 1), "returncode": done.returncode}
    log = out / "train_log.jsonl"
    if done.returncode != 0 or not log.is_file():
        point["error"] = done.stderr[-2000:]
        return point
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    counted = train[skip:]
    point.update(steps=len(train), counted_steps=len(counted))
    for key in ("tokens_per_s", "positions_per_s", "step_s", "mfu", "gpu_busy", "peak_memory_gb"):
        point[key] = median(counted, key)
    point["tokens_per_step"] = (point["tokens_per_s"] or 0) * (point["step_s"] or 0)
    point["final_loss"] = train[-1]["loss"] if train else None
    if profile and (out / "profile.txt").is_file():
        point["profile"] = str(out / "profile.txt")
    return point


def sync_check(target: Path, data: list[Path], src: str, scratch: Path, steps: int = 12) -> dict:
    """Synchronisations per step of the trainer in `src`, P-EAGLE at 8K, in a child process."""
    code = f"""
import json, sys, warnings, torch
from pathlib import Path
sys.path.insert(0, {src!r})
from peagle.training.config import TrainConfig
from peagle.training.distributed import DistContext
from peagle.training.trainer import build_trainer, Prefetcher
cfg = TrainConfig(target=Path({str(target)!r}), data=[Path(d) for d in {[str(d) for d in data]!r}],
                  out=Path({str(scratch / 'sync')!r}),
                  method="peagle", k_train=8, max_length=8192, steps=1000, save_every=10**9, eval_every=10**9,
                  eval_fraction=0.0, log_every=10**6)
trainer = build_trainer(cfg, DistContext(0, 1, torch.device("cuda")))
trainer._prefetch = Prefetcher(trainer)
for _ in range(4):  # compilation and first-use work
    trainer.train_step(); trainer.step += 1
torch.cuda.synchronize()
counts = []
for _ in range({steps}):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        trainer.train_step()
        torch.cuda.set_sync_debug_mode("default")
    trainer.step += 1
    counts.append([str(w.message).splitlines()[0][:160] for w in caught])
trainer._prefetch.close()
print(json.dumps({{"syncs_per_step": [len(c) for c in counts], "examples": sorted(set(m for c in counts for m in c))[:8]}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--data", type=Path, nargs="+", required=True)
    parser.add_argument("--runs", nargs="+", required=True, type=parse_run, metavar="NAME=SRC:METHOD:K:LEN:BATCH")
    parser.add_argument("--seconds", type=float, default=45.0, help="time limit of each run (without --steps)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps of each run (instead of --seconds)")
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds a run may take in all")
    parser.add_argument("--skip-steps", type=int, default=10)
    parser.add_argument("--profile", nargs="*", default=[], metavar="NAME", help="runs that also write a profile")
    parser.add_argument("--sync-check", metavar="SRC", help="count synchronisations per step of this tree's trainer")
    args = parser.parse_args()
    result = {"target": str(args.target), "seconds": None if args.steps else args.seconds, "steps": args.steps or None,
              "skip_steps": args.skip_steps, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if args.sync_check:
            result["sync_check"] = sync_check(args.target, args.data, args.sync_check, scratch)
            print("sync check:", json.dumps(result["sync_check"]), flush=True)
        for run in args.runs:
            point = measure(args.target, args.data, run, args.seconds, args.steps, args.skip_steps, scratch,
                            run["name"] in args.profile, args.run_timeout)
            if "profile" in point:
                text = Path(point["profile"]).read_text()
                point["profile"] = text[:6000]
            result["runs"].append(point)
            args.out.write_text(json.dumps(result, indent=1))
            print(f"{point['name']:>16} {point['method']:>7} len {point['max_length']} x{point['batch_size']}: "
                  f"{point.get('tokens_per_s') or 0:10.0f} tokens/s {point.get('positions_per_s') or 0:10.0f} pos/s "
                  f"mfu {point.get('mfu')} busy {point.get('gpu_busy')} mem {point.get('peak_memory_gb')} "
                  f"steps {point.get('steps')} {point.get('error', '')[-300:]}", flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"} | {
        "tokens_per_s": {r["name"]: r.get("tokens_per_s") for r in result["runs"]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
