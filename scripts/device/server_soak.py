"""Soak test of `peagle serve`: many concurrent streaming clients for a while, then check nothing leaked.

Usage: python scripts/device/server_soak.py MODEL_DIR OUT.json [--head DIR --k 7] [--clients 64] [--seconds 120]
       [--kill-engine-at SECONDS]
Starts the server as a subprocess, runs the clients (random lengths, greedy and sampled, 10% disconnect mid-stream),
then reads /metrics: throughput, acceptance length, errors, and KV usage after the load (must return to 0).

With --kill-engine-at, the engine process is killed (SIGKILL) that far into the load: the streams in flight must end
with an error event, the server must exit 1, and it is started again as a supervisor would, the clients going on.
Every request then is answered (ok), left by its client, or failed cleanly (an error event or a 5xx, or refused while
the server was down); anything else is an error, and a request silent for --hang-s seconds is a hang.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

QUESTIONS = ["Explain how a hash map works.", "Write a Python function that reverses a linked list.",
             "What causes the seasons on Earth?", "Summarise the plot of Hamlet.", "How do vaccines work?",
             "Write a haiku about the sea.", "What is speculative decoding?", "Give three tips for learning Rust."]


def metric(text: str, name: str, labels: dict | None = None) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and (labels is None or all(s.labels.get(k) == v for k, v in labels.items())):
                return s.value
    return 0.0


async def client(url: str, i: int, seconds: float, stats: dict, hang_s: float = 120) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(base_url=url, timeout=hang_s) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            n, leave = rng.randint(16, 256), rng.random() < 0.1
            body = {"model": "soak", "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
                    "max_tokens": n, "temperature": rng.choice([0, 0.8]), "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            try:
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        body = (await r.aread())[:200]
                        if r.status_code >= 500 and stats["killed"]:
                            stats["failed_cleanly"] += 1
                        else:
                            stats["errors"].append(f"{r.status_code} {body!r}")
                        continue
                    events = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if leave and len(events) > 3:
                                break
                    if leave:
                        stats["disconnected"] += 1
                        continue
                    if len(events) >= 2 and events[-1] == "[DONE]" and '"error"' in events[-2]:
                        stats["failed_cleanly"] += 1  # the engine died under it: an error event, then [DONE]
                        continue
                    usage = json.loads(events[-2])["usage"]
                    if events[-1] != "[DONE]" or usage["completion_tokens"] != n:
                        stats["errors"].append(f"bad stream end: {events[-3:]}")
                        continue
                    stats["ok"] += 1
                    stats["tokens"] += n
            except httpx.TimeoutException as e:
                stats["hangs"] += 1
                stats["errors"].append(f"hang: {e!r}"[:300])
            except httpx.TransportError as e:
                if not stats["killed"]:
                    stats["errors"].append(repr(e)[:300])
                    continue
                # refused, or a kept-alive connection closed, while the server was down or going down
                stats["refused"] += 1
                await asyncio.sleep(0.2)
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                stats["errors"].append(repr(e)[:300])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--head")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `peagle serve` argument (repeatable)")
    ap.add_argument("--kill-engine-at", type=float, metavar="SECONDS",
                    help="SIGKILL the engine process this far into the load, then start the server again")
    ap.add_argument("--hang-s", type=float, default=120, help="a request silent this long is a hang (default 120)")
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "peagle", "serve", args.model, "--served-model-name", "soak", "--port", str(port),
           "--max-num-seqs", str(args.clients), *args.serve_arg]
    if args.head:
        cmd += ["--speculative-config", json.dumps({"method": "eagle3", "model": args.head,
                                                     "num_speculative_tokens": args.k, "parallel_drafting": True})]
    url = f"http://127.0.0.1:{port}"
    servers = [start_server(cmd, url)]
    kill: dict = {}
    try:
        stats = {"ok": 0, "disconnected": 0, "tokens": 0, "errors": [], "killed": False, "failed_cleanly": 0,
                 "refused": 0, "hangs": 0}

        async def kill_engine():
            await asyncio.sleep(args.kill_engine_at)
            engine = spawned(servers[-1].pid)[0]
            stats["killed"] = True
            t0 = time.monotonic()
            os.kill(engine, signal.SIGKILL)
            code = await asyncio.to_thread(servers[-1].wait, 60)
            kill.update(engine_pid=engine, server_exit_code=code, server_exit_s=round(time.monotonic() - t0, 2))
            servers.append(await asyncio.to_thread(start_server, cmd, url))
            kill["restarted_after_s"] = round(time.monotonic() - t0, 2)

        async def run_all():
            extra = [kill_engine()] if args.kill_engine_at is not None else []
            await asyncio.gather(*(client(url, i, args.seconds, stats, args.hang_s) for i in range(args.clients)),
                                 *extra)

        start = time.monotonic()
        asyncio.run(run_all())
        wall = time.monotonic() - start
        time.sleep(2)
        text = httpx.get(url + "/metrics", timeout=10).text
        drafts = metric(text, "peagle_spec_decode_num_drafts_total")
        accepted = metric(text, "peagle_spec_decode_num_accepted_tokens_total")
        result = {"clients": args.clients, "seconds": round(wall, 1), "completed": stats["ok"],
                  "disconnected_by_client": stats["disconnected"], "errors": len(stats["errors"]),
                  "first_errors": stats["errors"][:5], "output_tokens_per_s": round(stats["tokens"] / wall, 1),
                  "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
                  "kv_cache_usage_after": metric(text, "peagle_kv_cache_usage_perc"),
                  "running_after": metric(text, "peagle_num_requests_running"),
                  "aborted": metric(text, "peagle_request_success_total", {"finished_reason": "abort"}),
                  "failed_cleanly": stats["failed_cleanly"], "refused_while_down": stats["refused"],
                  "hangs": stats["hangs"], "engine_kill": kill or None}
        print(json.dumps(result), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        killed_cleanly = args.kill_engine_at is None or kill.get("server_exit_code") == 1
        return 0 if not stats["errors"] and result["kv_cache_usage_after"] == 0 and killed_cleanly else 1
    finally:
        servers[-1].terminate()
        servers[-1].wait(timeout=60)


def start_server(cmd: list[str], url: str) -> subprocess.Popen:
    """The server, once /health answers 200."""
    server = subprocess.Popen(cmd)
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("the server did not come up")
        time.sleep(1)


def spawned(pid: int) -> list[int]:
    """The processes `multiprocessing` spawned from `pid`, oldest first (the engine process first)."""
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(k) for k in f.read().split()]
    kids = [k for k in kids if b"spawn_main" in open(f"/proc/{k}/cmdline", "rb").read()]
    return sorted(kids, key=lambda k: int(open(f"/proc/{k}/stat").read().rsplit(")", 1)[1].split()[19]))


if __name__ == "__main__":
    sys.exit(main())
