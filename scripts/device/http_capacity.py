"""Tokens/s that `peagle serve` streams to raw-socket clients (scripts/server_overhead.py's), per source tree and
stream interval, with the real engine: the model directory's weights, or random ones (--dummy, for plain decoding's
cost without a checkpoint). Each source tree's server runs in a process of its own, one after another; the JSON line
printed last holds every row.

    python scripts/device/http_capacity.py MODEL_DIR OUT.json --src old=.old/src --src new=src --dummy \
        --concurrency 64 --stream-interval 1,8
    python scripts/device/http_capacity.py MODEL_DIR OUT.json --src new=src --dummy --engine-modes thread,process
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server_overhead import _clients, _cpu_seconds, start_server  # noqa: E402


def measure(model: str, src: str, interval: int, concurrency: int, seconds: float, dummy: bool,
            max_tokens: int, engine_mode: str = "thread") -> dict:
    label, _, path = src.rpartition("=")
    argv = [sys.executable, "-m", "peagle", "--log-level", "warning", "serve", model, "--port", "{port}",
            "--served-model-name", "m", "--max-num-seqs", str(max(concurrency, 1)), "--disable-log-stats",
            "--disable-uvicorn-access-log"]
    argv += ["--load-format", "dummy"] if dummy else []
    argv += ["--stream-interval", str(interval)] if interval != 1 else []
    argv += ["--engine-process"] if engine_mode == "process" else []
    server, port = start_server(argv, path, 300)
    try:
        asyncio.run(_clients(port, concurrency, 3.0, max_tokens))  # warm-up: CUDA graphs for this batch
        kids = _children(server.pid)  # the engine process, with --engine-process
        cpu0, kid0 = _cpu_seconds(server.pid), sum(map(_cpu_seconds, kids))
        tokens, chunks, wall = asyncio.run(_clients(port, concurrency, seconds, max_tokens))
        cpu, kid = _cpu_seconds(server.pid) - cpu0, sum(map(_cpu_seconds, kids)) - kid0
    finally:
        server.terminate()
        server.wait(60)
    return {"src": label or path, "engine": engine_mode, "stream_interval": interval, "concurrency": concurrency,
            "tokens_per_s": tokens / wall, "chunks_per_s": chunks / wall, "server_cpu_per_s": cpu / wall,
            "server_cpu_us_per_token": 1e6 * cpu / max(tokens, 1), "engine_process_cpu_per_s": kid / wall,
            "seconds": wall}


def _children(pid: int) -> list[int]:
    """The processes `pid` started (its threads' children, from /proc)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text() if (task / "children").exists() else ""
        kids += [int(k) for k in text.split()]
    return kids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the target checkpoint (with --dummy: a directory with its config.json)")
    p.add_argument("out", help="the JSON file to write")
    p.add_argument("--src", action="append", required=True, metavar="[LABEL=]DIR", help="a source tree's src folder")
    p.add_argument("--dummy", action="store_true", help="random weights (--load-format dummy)")
    p.add_argument("--concurrency", default="64", help="comma-separated (default 64)")
    p.add_argument("--stream-interval", default="1", help="comma-separated (default 1)")
    p.add_argument("--engine-modes", default="thread",
                   help="comma-separated: thread (the engine in the server's process), process (--engine-process)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args(argv)
    rows = []
    modes = args.engine_modes.split(",")
    if not set(modes) <= {"thread", "process"}:
        p.error(f"--engine-modes: thread or process, got {args.engine_modes!r}")
    for c, interval, src, mode in itertools.product([int(v) for v in args.concurrency.split(",")],
                                                    [int(v) for v in args.stream_interval.split(",")], args.src,
                                                    modes):
        r = measure(args.model, src, interval, c, args.seconds, args.dummy, args.max_tokens, mode)
        rows.append(r)
        print(f"{r['src']:<12} {mode:<7} c={c:<3} interval {interval:>2}: {r['tokens_per_s']:>9,.0f} tok/s "
              f"{r['chunks_per_s']:>8,.0f} chunks/s  server CPU {r['server_cpu_per_s']:.2f} s/s, "
              f"{r['server_cpu_us_per_token']:.1f} us/token, engine process CPU {r['engine_process_cpu_per_s']:.2f} "
              "s/s", flush=True)
    result = {"config": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
