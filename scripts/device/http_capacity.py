"""Tokens/s that `peagle serve` streams to raw-socket clients (scripts/server_overhead.py's), per source tree and
stream interval, with the real engine: the model directory's weights, or random ones (--dummy, for plain decoding's
cost without a checkpoint). Each source tree's server runs in a process of its own, one after another; the JSON line
printed last holds every row.

    python scripts/device/http_capacity.py MODEL_DIR OUT.json --src old=.old/src --src new=src --dummy \
        --concurrency 64 --stream-interval 1,8
    python scripts/device/http_capacity.py MODEL_DIR OUT.json --src new=src --dummy --engine-modes thread,process
    python scripts/device/http_capacity.py MODEL_DIR OUT.json --src new=src --dummy --engine-modes process,process2 \
        --client-processes 4

Engine modes: thread (--engine-thread), process (--engine-process: the default since issue 51, and a flag older
trees take), processN (--api-server-count N), default (no flag: what the tree's `peagle serve` does). Each row has the
CPU of the server processes, of the engine process and of the clients.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server_overhead import _cpu_seconds, run_clients, spawned, start_server  # noqa: E402


def measure(model: str, src: str, interval: int, concurrency: int, seconds: float, dummy: bool,
            max_tokens: int, engine_mode: str = "thread", client_processes: int = 1) -> dict:
    label, _, path = src.rpartition("=")
    argv = [sys.executable, "-m", "peagle", "--log-level", "warning", "serve", model, "--port", "{port}",
            "--served-model-name", "m", "--max-num-seqs", str(max(concurrency, 1)), "--disable-log-stats",
            "--disable-uvicorn-access-log"]
    argv += ["--load-format", "dummy"] if dummy else []
    argv += ["--stream-interval", str(interval)] if interval != 1 else []
    argv += {"thread": ["--engine-thread"], "process": ["--engine-process"], "default": []}.get(
        engine_mode) or ["--api-server-count", engine_mode.removeprefix("process")]
    server, port = start_server(argv, path, 300)
    try:
        run_clients(port, concurrency, 3.0, max_tokens)  # warm-up: CUDA graphs for this batch
        kids = spawned(server.pid)  # the engine process first, then any API server processes
        engine_pid = kids[0] if kids else None
        pids = [server.pid, *kids]
        cpu0 = {pid: _cpu_seconds(pid) for pid in pids}
        got = run_clients(port, concurrency, seconds, max_tokens, client_processes)
        cpu = {pid: _cpu_seconds(pid) - cpu0[pid] for pid in pids}
    finally:
        server.terminate()
        server.wait(90)
    wall, tokens = got["wall"], got["tokens"]
    server_cpu = sum(c for pid, c in cpu.items() if pid != engine_pid)
    return {"src": label or path, "engine": engine_mode, "stream_interval": interval, "concurrency": concurrency,
            "tokens_per_s": tokens / wall, "chunks_per_s": got["chunks"] / wall, "server_cpu_per_s": server_cpu / wall,
            "server_cpu_us_per_token": 1e6 * server_cpu / max(tokens, 1),
            "engine_process_cpu_per_s": cpu.get(engine_pid, 0.0) / wall, "client_cpu_per_s": got["client_cpu"] / wall,
            "client_processes": client_processes, "seconds": wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the target checkpoint (with --dummy: a directory with its config.json)")
    p.add_argument("out", help="the JSON file to write")
    p.add_argument("--src", action="append", required=True, metavar="[LABEL=]DIR", help="a source tree's src folder")
    p.add_argument("--dummy", action="store_true", help="random weights (--load-format dummy)")
    p.add_argument("--concurrency", default="64", help="comma-separated (default 64)")
    p.add_argument("--stream-interval", default="1", help="comma-separated (default 1)")
    p.add_argument("--engine-modes", default="default",
                   help="comma-separated: thread (--engine-thread), process (--engine-process), processN "
                        "(--api-server-count N), default (no flag) (default: default)")
    p.add_argument("--client-processes", type=int, default=1,
                   help="processes the raw-socket clients are split over (default 1)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args(argv)
    rows = []
    modes = args.engine_modes.split(",")
    for m in modes:
        if m not in ("thread", "process", "default") and not (m.startswith("process") and m[7:].isdigit()):
            p.error(f"--engine-modes: thread, process, processN or default, got {m!r}")
    for c, interval, src, mode in itertools.product([int(v) for v in args.concurrency.split(",")],
                                                    [int(v) for v in args.stream_interval.split(",")], args.src,
                                                    modes):
        r = measure(args.model, src, interval, c, args.seconds, args.dummy, args.max_tokens, mode,
                    args.client_processes)
        rows.append(r)
        print(f"{r['src']:<12} {mode:<7} c={c:<3} interval {interval:>2}: {r['tokens_per_s']:>9,.0f} tok/s "
              f"{r['chunks_per_s']:>8,.0f} chunks/s  server CPU {r['server_cpu_per_s']:.2f} s/s, "
              f"{r['server_cpu_us_per_token']:.1f} us/token, engine process CPU {r['engine_process_cpu_per_s']:.2f} "
              f"s/s, clients {r['client_cpu_per_s']:.2f} s/s", flush=True)
        if r["client_cpu_per_s"] > 0.9 * args.client_processes:
            print("  warning: the clients neared their cores and may have set this rate (raise --client-processes)",
                  flush=True)
    result = {"config": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
