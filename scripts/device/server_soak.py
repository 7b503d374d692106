"""Soak test of `peagle serve`: many concurrent streaming clients for a while, then check nothing leaked.

Usage: python scripts/device/server_soak.py MODEL_DIR OUT.json [--head DIR --k 7] [--clients 64] [--seconds 120]
Starts the server as a subprocess, runs the clients (random lengths, greedy and sampled, 10% disconnect mid-stream),
then reads /metrics: throughput, acceptance length, errors, and KV usage after the load (must return to 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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


async def client(url: str, i: int, seconds: float, stats: dict) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            n, leave = rng.randint(16, 256), rng.random() < 0.1
            body = {"model": "soak", "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}],
                    "max_tokens": n, "temperature": rng.choice([0, 0.8]), "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            try:
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        stats["errors"].append(f"{r.status_code} {(await r.aread())[:200]!r}")
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
                    usage = json.loads(events[-2])["usage"]
                    if events[-1] != "[DONE]" or usage["completion_tokens"] != n:
                        stats["errors"].append(f"bad stream end: {events[-3:]}")
                        continue
                    stats["ok"] += 1
                    stats["tokens"] += n
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
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "peagle", "serve", args.model, "--served-model-name", "soak", "--port", str(port),
           "--max-num-seqs", str(args.clients), *args.serve_arg]
    if args.head:
        cmd += ["--speculative-config", json.dumps({"method": "eagle3", "model": args.head,
                                                     "num_speculative_tokens": args.k, "parallel_drafting": True})]
    server = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(1)
        stats = {"ok": 0, "disconnected": 0, "tokens": 0, "errors": []}

        async def run_all():
            await asyncio.gather(*(client(url, i, args.seconds, stats) for i in range(args.clients)))

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
                  "aborted": metric(text, "peagle_request_success_total", {"finished_reason": "abort"})}
        print(json.dumps(result), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return 0 if not stats["errors"] and result["kv_cache_usage_after"] == 0 else 1
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
