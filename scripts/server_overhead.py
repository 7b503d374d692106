"""What the HTTP server costs per streamed token, apart from the model: `peagle serve`'s app over a stand-in engine
whose steps take --step-ms (the GIL released, as while a GPU runs) and give every running request
--tokens-per-step tokens, driven by raw-socket streaming chat clients (cheap to run, so the server is what is
measured). Reports output tokens/s through HTTP, chunks/s, and the server process's CPU time per token.

    python scripts/server_overhead.py --tokenizer TOKENIZER_DIR --concurrency 64 --seconds 15
    python scripts/server_overhead.py --tokenizer DIR --src old=OLD_TREE/src --src new=src   # side by side

Each --src ([LABEL=]a source tree's `src` folder, default this checkout's) runs the server in a subprocess of its
own, one after the other, --repeat times in alternation; each --stream-interval value is a row. A table is printed, then
one JSON line. Linux only (the server's CPU time is read from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

_SERVER = r'''
import os, sys, time, types
import uvicorn
from peagle.engine.llm_engine import EngineStats
from peagle.engine.outputs import RequestMetrics, StepOutput
from peagle.models.loader import load_tokenizer
from peagle.server import create_app

tokenizer_dir, port, step_s, per, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
loop, http = sys.argv[6].split("+")


class StandInEngine:
    """Steps of step_s seconds giving every request `per` tokens of a fixed text, until its max_tokens."""

    def __init__(self):
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.max_model_len = 1 << 16
        self.k = 7
        self.config = types.SimpleNamespace(max_num_seqs=1024, enable_prefix_caching=False, model="stand-in")
        self.model_config = types.SimpleNamespace(vocab_size=self.tokenizer.vocab_size)
        text = " ".join(f"Sentence {i} of a long answer, with words, numbers like {i * 37} and punctuation."
                        for i in range(2000))
        self.text_ids = [t for t in self.tokenizer.encode(text) if t not in self.eos_token_ids]
        self.requests = {}

    def add_request(self, request_id, prompt_ids, params):
        self.requests[request_id] = [params.max_tokens, 0]
        return types.SimpleNamespace(prompt_logprobs=None)

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def stats(self):
        return EngineStats(len(self.requests), 0, len(self.requests), 1 << 20)

    def step(self):
        time.sleep(step_s)
        outputs, n_text = [], len(self.text_ids) - per
        for request_id, state in list(self.requests.items()):
            n = min(per, state[0] - state[1])
            start = state[1] % n_text
            state[1] += n
            done = state[1] >= state[0]
            metrics = RequestMetrics(state[1] // per, state[1], state[1] // 2, [], state[1], 0.0, 0.0, 0.0) if done else None
            outputs.append(StepOutput(request_id, self.text_ids[start:start + n], done, "length" if done else None,
                                      metrics=metrics))
            if done:
                del self.requests[request_id]
        return outputs


app = create_app(StandInEngine(), "m", log_stats_interval_s=None,  # an older tree's app may lack stream_interval
                 **({"stream_interval": interval} if interval != 1 else {}))
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop=loop, http=http)
'''

_USAGE = re.compile(rb'"completion_tokens":(\d+)')
_CONTENT = re.compile(rb'"delta":\{"content":"[^"]')  # a chunk that carries text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(argv: list[str], src_path: str, timeout_s: float) -> tuple[subprocess.Popen, int]:
    """A server process run from a source tree (in front of PYTHONPATH) on a free port (argv's "{port}"), once it
    accepts connections."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.abspath(src_path),
                                                                     os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([a.replace("{port}", str(port)) for a in argv], env=env)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, port
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"the server from {src_path} did not start")
            time.sleep(0.2)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def _clients(port: int, concurrency: int, seconds: float, max_tokens: int) -> tuple[int, int, float]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    totals = [0, 0]  # tokens, chunks

    async def one(stop: float):
        while time.monotonic() < stop:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            data = bytearray()
            while chunk := await reader.read(1 << 16):
                data += chunk
            writer.close()
            usage = _USAGE.findall(bytes(data))
            if not usage:
                raise RuntimeError(f"a response without usage: {bytes(data[:300])!r}")
            totals[0] += int(usage[-1])
            totals[1] += len(_CONTENT.findall(bytes(data)))

    start = time.monotonic()
    await asyncio.gather(*(one(start + seconds) for _ in range(concurrency)))
    return totals[0], totals[1], time.monotonic() - start


def measure(src: str, tokenizer: str, interval: int, impl: str, args) -> dict:
    label, _, path = src.rpartition("=")
    server, port = start_server([sys.executable, "-c", _SERVER, tokenizer, "{port}", str(args.step_ms / 1000),
                                 str(args.tokens_per_step), str(interval), impl], path, 60)
    try:
        asyncio.run(_clients(port, args.concurrency, 1.0, args.max_tokens))  # warm-up
        cpu0 = _cpu_seconds(server.pid)
        tokens, chunks, wall = asyncio.run(_clients(port, args.concurrency, args.seconds, args.max_tokens))
        cpu = _cpu_seconds(server.pid) - cpu0
    finally:
        server.terminate()
        server.wait(30)
    return {"src": label or path, "stream_interval": interval, "server": impl, "tokens_per_s": tokens / wall, "chunks_per_s": chunks / wall,
            "server_cpu_per_s": cpu / wall, "server_cpu_us_per_token": 1e6 * cpu / max(tokens, 1), "seconds": wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json (the text's tokens)")
    p.add_argument("--src", action="append", metavar="[LABEL=]DIR",
                   help="a source tree's src folder, labelled (repeatable; default: this checkout's)")
    p.add_argument("--concurrency", type=int, default=64, help="streaming clients at once (default 64)")
    p.add_argument("--seconds", type=float, default=15.0, help="measured seconds per point (default 15)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request (default 256)")
    p.add_argument("--step-ms", type=float, default=1.0, help="the stand-in engine's step time (default 1.0)")
    p.add_argument("--tokens-per-step", type=int, default=3,
                   help="tokens per request per step (default 3: a speculative round)")
    p.add_argument("--stream-interval", default="1", help="comma-separated values, each a row (default 1)")
    p.add_argument("--server", default="auto+auto",
                   help="uvicorn's event loop and HTTP implementation, LOOP+HTTP, comma-separated rows (e.g. "
                        "asyncio+h11,uvloop+httptools; default auto+auto: uvloop and httptools when installed)")
    p.add_argument("--repeat", type=int, default=1, help="passes over the sources, alternating (default 1)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    srcs = args.src or [f"this tree={Path(__file__).resolve().parents[1] / 'src'}"]
    intervals = [int(v) for v in args.stream_interval.split(",")]
    impls = args.server.split(",")
    rows = []
    for _ in range(args.repeat):
        for interval, impl, src in itertools.product(intervals, impls, srcs):
            rows.append(measure(src, args.tokenizer, interval, impl, args))
            r = rows[-1]
            print(f"{r['src']:<16} {impl:<18} interval {interval:>3}: {r['tokens_per_s']:>9,.0f} tok/s "
                  f"{r['chunks_per_s']:>8,.0f} chunks/s  server CPU {r['server_cpu_per_s']:.2f} s/s, "
                  f"{r['server_cpu_us_per_token']:.1f} us/token", flush=True)
    summary = {}
    for label, interval, impl in itertools.product(dict.fromkeys(r["src"] for r in rows), intervals, impls):
        mine = [r for r in rows if (r["src"], r["stream_interval"], r["server"]) == (label, interval, impl)]
        summary[f"{label}|{interval}|{impl}"] = {k: statistics.median(r[k] for r in mine) for k in
                                                 ("tokens_per_s", "chunks_per_s", "server_cpu_us_per_token")}
    result = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows, "median": summary}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
