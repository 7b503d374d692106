"""Issue 48: the compiled loss chunk run under each launch config that Inductor's autotuner can pick for it.

Inductor compiles `_kl_chunk` (training/loss.py) with several candidate configs per reduction kernel and keeps the
one that times fastest at its first launch. Trainers side by side on one GPU time them under contention, so they can
keep a config that a trainer alone never runs. This forces each candidate in turn, one child process per index
(caches off, so every child compiles afresh), runs the fused loss forward and backward at the fault records' shapes
and at edge sizes, and compares loss and gradients with the eager chunk. With --sanitize each child runs under
compute-sanitizer memcheck (where the machine allows it): a config that reads or writes out of bounds is named.

Usage: python scripts/device/kl_configs.py OUT.json [--configs 6] [--sanitize] [--vocab 32768] [--hidden 576]
The JSON holds, per forced index, every compiled kernel's candidate count and the config it ran, each shape's result
(ok, a mismatch with its size, or the error) and the sanitizer's summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# (charged elements, teacher rows) of steps 251-256 of run 32's faulting trainers, then edge sizes around the 4096
# chunk (a last chunk of 1 row is specialised by the compiler).
SHAPES = [(8211, 2420), (3421, 1007), (7964, 2343), (7864, 2322), (16371, 4809), (8586, 2530), (1, 1), (4097, 300),
          (4095, 4095), (12289, 64)]


def child(index: int, vocab: int, hidden: int) -> dict:
    import torch
    from torch._inductor.runtime import triton_heuristics as th

    kernels = []
    original = th.cached_autotune

    def forced(size_hints, configs, *args, **kwargs):
        kernels.append({"file": Path(str(kwargs.get("filename") or "")).name, "configs": len(configs),
                        "forced": str(configs[index % len(configs)])})
        if len(configs) > 1:
            configs = [configs[index % len(configs)]]
        return original(size_hints, configs, *args, **kwargs)

    th.cached_autotune = forced
    from peagle.training import loss as L

    dev = torch.device("cuda")
    results = []
    for n, rows in SHAPES:
        g = torch.Generator(device=dev).manual_seed(n)
        h = torch.randn(n, hidden, device=dev, generator=g)
        w = torch.randn(vocab, hidden, device=dev, generator=g) * hidden ** -0.5
        table = torch.log_softmax(torch.randn(rows, vocab, device=dev, generator=g) * 3, -1)
        row = torch.randint(0, rows, (n,), device=dev, generator=g)
        scale = torch.rand(n, device=dev, generator=g) / n
        out = {}
        try:
            for mode in ("compiled", "eager"):
                L._COMPILE["on"] = mode == "compiled"
                hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss, argmax = L.draft_kl_loss(hh, ww, table, row, scale)
                loss.backward()
                torch.cuda.synchronize()
                out[mode] = (loss.detach(), argmax, hh.grad, ww.grad)
            c, e = out["compiled"], out["eager"]
            worst = max(float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-12))
                        for a, b in ((c[0], e[0]), (c[2], e[2]), (c[3], e[3])))
            same_argmax = float((c[1] == e[1]).float().mean())
            results.append({"elements": n, "rows": rows, "ok": worst < 2e-2 and same_argmax > 0.99,
                            "relative_diff": worst, "argmax_agree": same_argmax})
        except Exception as ex:  # noqa: BLE001 - a fault is the finding: record it and stop (the context is gone)
            results.append({"elements": n, "rows": rows, "ok": False, "error": f"{type(ex).__name__}: {ex}"[:400]})
            break
    return {"index": index, "kernels": kernels, "shapes": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--configs", type=int, default=6, help="candidate indices to force, 0..N-1 (Inductor's reduction "
                    "heuristics offer at most 6)")
    ap.add_argument("--sanitize", action="store_true", help="each child under compute-sanitizer memcheck")
    ap.add_argument("--vocab", type=int, default=32768, help="the draft vocabulary (the trainer's default)")
    ap.add_argument("--hidden", type=int, default=576, help="the drafter's width (the testbed target's)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    for name in ("configs", "vocab", "hidden"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.child is not None:
        print("KL_CONFIGS " + json.dumps(child(args.child, args.vocab, args.hidden)), flush=True)
        return 0
    sanitizer = shutil.which("compute-sanitizer") if args.sanitize else None
    if args.sanitize and sanitizer is None:
        print("compute-sanitizer is not on this machine: running without it", flush=True)
    report = {"vocab": args.vocab, "hidden": args.hidden, "sanitizer": bool(sanitizer), "runs": []}
    procs = []
    for i in range(args.configs):
        cache = tempfile.mkdtemp(prefix=f"kl-{i}-")
        env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
               "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": f"{cache}/triton", "CUDA_LAUNCH_BLOCKING": "1"}
        cmd = [sys.executable, __file__, args.out, "--child", str(i), "--vocab", str(args.vocab), "--hidden",
               str(args.hidden)]
        log = Path(cache) / "sanitizer.log"
        if sanitizer:  # every tensor its own allocation, so that an access past one is seen
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
            cmd = [sanitizer, "--tool", "memcheck", "--print-limit", "10", "--log-file", str(log), *cmd]
        procs.append((i, log, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True)))
    for i, log, p in procs:
        text, _ = p.communicate()
        line = next((x for x in text.splitlines() if x.startswith("KL_CONFIGS ")), None)
        run = json.loads(line[len("KL_CONFIGS "):]) if line else {"index": i, "error": text[-1500:]}
        run["exit"] = p.returncode
        if sanitizer and log.is_file():
            san = log.read_text(errors="replace").splitlines()
            run["sanitizer"] = [x for x in san if "ERROR SUMMARY" in x or "Invalid" in x or "Error" in x][:12]
        report["runs"].append(run)
        bad = [s for s in run.get("shapes", []) if not s["ok"]]
        candidates = [k["configs"] for k in run.get("kernels", [])]
        print(f"config index {i}: exit {p.returncode}, kernels' candidates {candidates}, "
              f"{len(run.get('shapes', []))} shapes, {len(bad)} bad; sanitizer {run.get('sanitizer', '-')}",
              flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
