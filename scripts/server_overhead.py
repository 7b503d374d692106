"""What the HTTP server costs per streamed token, apart from the model: `peagle serve`'s app over a stand-in engine
(peagle.server.stand_in: steps of --step-ms with the GIL released, as while a GPU runs, giving every running request
--tokens-per-step tokens), driven by raw-socket streaming chat clients (cheap to run, so the server is what is
measured). Reports output tokens/s through HTTP, chunks/s, and the CPU time of the server's processes, of the engine
process and of the clients (a warning when the clients neared their cores: then they set the rate).

    python scripts/server_overhead.py --tokenizer TOKENIZER_DIR --concurrency 64 --seconds 15
    python scripts/server_overhead.py --tokenizer DIR --src old=OLD_TREE/src --src new=src   # side by side
    python scripts/server_overhead.py --tokenizer DIR --engine thread,process,process2 --client-processes 2
    python scripts/server_overhead.py --tokenizer DIR --engine process --concurrency 1 --latency 300   # TTFT too

Each --src ([LABEL=]a source tree's `src` folder, default this checkout's) runs the server in a subprocess of its
own, one after the other, --repeat times in alternation; each --stream-interval value and --engine mode is a row
(thread: the engine in the server's process; process: the engine process, as `peagle serve` runs by default;
processN: N API servers). A table is printed, then one JSON line. Linux only (CPU times are read from /proc).
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
import sys
import uvicorn
from peagle.server import create_app

tokenizer_dir, port, step_s, per, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
loop, http = sys.argv[6].split("+")
engine_mode = sys.argv[7]
try:
    from peagle.server.stand_in import StandInConfig, StandInEngine
except ImportError:  # a tree from before the stand-in: the measuring tree's, over this tree's engine types
    import types
    module = sys.modules["peagle_stand_in"] = types.ModuleType("peagle_stand_in")
    exec(sys.argv[8], module.__dict__)
    StandInConfig, StandInEngine = module.StandInConfig, module.StandInEngine

if engine_mode == "thread":  # create_app in this process, so that --server's loop and parser apply
    engine = StandInEngine(StandInConfig(tokenizer=tokenizer_dir, step_s=step_s, tokens_per_step=per))
    app = create_app(engine, "m", log_stats_interval_s=None,  # an older tree's app may lack stream_interval
                     **({"stream_interval": interval} if interval != 1 else {}))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop=loop, http=http)
    sys.exit(0)
from peagle.cli import build_parser
from peagle.server.launcher import launch

servers = "1" if engine_mode == "process" else engine_mode.removeprefix("process")
args = build_parser().parse_args(["--log-level", "warning", "serve", "m", "--port", str(port), "--disable-log-stats",
                                  "--disable-uvicorn-access-log", "--stream-interval", str(interval),
                                  "--api-server-count", servers])
sys.exit(launch(args, StandInConfig(tokenizer=tokenizer_dir, step_s=step_s, tokens_per_step=per),
                engine_factory=StandInEngine))
'''

# Trees from before peagle.server.stand_in run this tree's stand-in (its source, passed to the server), so that every
# tree serves the same engine.
_STAND_IN_SOURCE = (Path(__file__).resolve().parents[1] / "src/peagle/server/stand_in.py").read_text()


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


async def _latency(port: int, n: int, max_tokens: int) -> dict:
    """`n` streamed requests one after another on one kept-alive connection, as a chat client sends them: the time to
    the first chunk with text and to the response's end, medians in ms (the first tenth left out as warm-up)."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
                       "stream": True}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    firsts, ends = [], []
    for i in range(n):
        start, first, data = time.perf_counter(), None, bytearray()
        writer.write(request)
        while not data.endswith(b"0\r\n\r\n"):  # the chunked body's last chunk
            chunk = await reader.read(1 << 16)
            if not chunk:
                raise RuntimeError("the server closed a kept-alive connection")
            data += chunk
            if first is None and _CONTENT.search(data):
                first = time.perf_counter()
        if i >= n // 10:
            firsts.append(1e3 * (first - start))
            ends.append(1e3 * (time.perf_counter() - start))
    writer.close()
    return {"ttft_p50_ms": statistics.median(firsts), "request_p50_ms": statistics.median(ends)}


def spawned(pid: int) -> list[int]:
    """The processes `multiprocessing` spawned from `pid` (the engine, API servers), oldest first."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    kids = [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    return sorted(kids, key=lambda k: int(Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[19]))


def _client_process(port: int, concurrency: int, seconds: float, max_tokens: int) -> tuple[int, int, float, float]:
    cpu0 = time.process_time()
    tokens, chunks, wall = asyncio.run(_clients(port, concurrency, seconds, max_tokens))
    return tokens, chunks, wall, time.process_time() - cpu0


def run_clients(port: int, concurrency: int, seconds: float, max_tokens: int, processes: int = 1) -> dict:
    """`concurrency` raw-socket streaming clients split over `processes` processes: tokens, chunks, wall seconds and
    the clients' CPU seconds (user + system, all processes)."""
    if processes == 1:
        tokens, chunks, wall, cpu = _client_process(port, concurrency, seconds, max_tokens)
    else:
        import concurrent.futures

        shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
        with concurrent.futures.ProcessPoolExecutor(processes) as pool:
            parts = list(pool.map(_client_process, [port] * processes, shares, [seconds] * processes,
                                  [max_tokens] * processes))
        tokens, chunks = sum(p[0] for p in parts), sum(p[1] for p in parts)
        wall, cpu = max(p[2] for p in parts), sum(p[3] for p in parts)
    return {"tokens": tokens, "chunks": chunks, "wall": wall, "client_cpu": cpu}


def py_spy(pid: int, out: Path, seconds: float | None = None, exe: str = "py-spy") -> subprocess.Popen:
    """py-spy sampling `pid` for `seconds` (None: until it is sent SIGINT) into `out` (collapsed stacks:
    "frame;frame;... count" lines)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    duration = [] if seconds is None else ["-d", str(max(1, int(seconds) - 1))]
    return subprocess.Popen([exe, "record", "--format", "raw", "--nonblocking", "-r", "200", *duration, "-o",
                             str(out), "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def profile_summary(path: Path, top: int = 25) -> list[tuple[str, float, float]]:
    """The `top` functions of a py-spy raw profile by inclusive share of the samples: (function, inclusive, self),
    shares of all samples (idle waits included)."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  if " (" in f else f for f in stack.split(";")]
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n
    ranked = sorted(inclusive, key=inclusive.get, reverse=True)[:top]
    return [(f, inclusive[f] / max(total, 1), own.get(f, 0) / max(total, 1)) for f in ranked]


def measure(src: str, tokenizer: str, interval: int, impl: str, engine: str, args) -> dict:
    """One row: a server from `src` over the stand-in engine (`engine`: thread, process, or processN for N API
    servers), its clients' rate, and the CPU of the server processes, the engine process and the clients."""
    label, _, path = src.rpartition("=")
    server, port = start_server([sys.executable, "-c", _SERVER, tokenizer, "{port}", str(args.step_ms / 1000),
                                 str(args.tokens_per_step), str(interval), impl, engine, _STAND_IN_SOURCE], path, 120)
    try:
        run_clients(port, args.concurrency, 1.0, args.max_tokens)  # warm-up
        kids = spawned(server.pid)
        engine_pid = kids[0] if kids else None  # spawned before the API servers
        pids = [server.pid, *kids]
        cpu0 = {pid: _cpu_seconds(pid) for pid in pids}
        spies = [] if not args.py_spy else [
            py_spy(pid, Path(args.py_spy) / f"{(label or 'tree').replace(' ', '-')}-{engine}-i{interval}-"
                                              f"{'engine' if pid == engine_pid else 'server'}-{pid}.txt",
                    args.seconds) for pid in pids]
        got = run_clients(port, args.concurrency, args.seconds, args.max_tokens, args.client_processes)
        cpu = {pid: _cpu_seconds(pid) - cpu0[pid] for pid in pids}
        for spy in spies:
            spy.wait(60)
        latency = asyncio.run(_latency(port, args.latency, args.max_tokens)) if args.latency else {}
    finally:
        server.terminate()
        server.wait(60)
    wall, tokens = got["wall"], got["tokens"]
    server_cpu = sum(c for pid, c in cpu.items() if pid != engine_pid)
    engine_cpu = cpu.get(engine_pid, 0.0)
    return {"src": label or path, "stream_interval": interval, "server": impl, "engine": engine,
            "concurrency": args.concurrency, "tokens_per_s": tokens / wall, "chunks_per_s": got["chunks"] / wall,
            "server_cpu_per_s": server_cpu / wall, "server_cpu_us_per_token": 1e6 * server_cpu / max(tokens, 1),
            "engine_cpu_per_s": engine_cpu / wall, "client_cpu_per_s": got["client_cpu"] / wall,
            "client_processes": args.client_processes, "seconds": wall, **latency}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", help="a directory with tokenizer.json (the text's tokens); required to measure")
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
                   help="uvicorn's event loop and HTTP implementation for the engine thread, LOOP+HTTP, "
                        "comma-separated rows (e.g. asyncio+h11,uvloop+httptools; default auto+auto: uvloop and "
                        "httptools when installed); the engine process's servers run `peagle serve`'s own")
    p.add_argument("--engine", default="thread",
                   help="comma-separated rows: thread (the engine in the server's process), process (the engine "
                        "process, one API server), processN (N API servers); trees from before the engine process "
                        "was the default take thread only (default thread)")
    p.add_argument("--client-processes", type=int, default=1,
                   help="processes the clients are split over, so that they are not the limit (default 1)")
    p.add_argument("--py-spy", metavar="DIR",
                   help="sample every server and engine process with py-spy over each measured window into DIR "
                        "(collapsed stacks; `python scripts/server_overhead.py --summarize FILE` ranks them)")
    p.add_argument("--summarize", metavar="FILE", help="print a py-spy profile's top functions and exit")
    p.add_argument("--latency", type=int, default=0, metavar="N",
                   help="after each row, N streamed requests one at a time on one kept-alive connection: TTFT and "
                        "request time medians (default 0: none)")
    p.add_argument("--repeat", type=int, default=1, help="passes over the sources, alternating (default 1)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.summarize:
        for name, inclusive, own in profile_summary(Path(args.summarize)):
            print(f"{100 * inclusive:6.1f}% {100 * own:6.1f}%  {name}")
        return 0
    if not args.tokenizer:
        p.error("--tokenizer is required")
    srcs = args.src or [f"this tree={Path(__file__).resolve().parents[1] / 'src'}"]
    intervals = [int(v) for v in args.stream_interval.split(",")]
    impls, engines = args.server.split(","), args.engine.split(",")
    for e in engines:
        if e != "thread" and not (e.startswith("process") and (e == "process" or e[7:].isdigit())):
            p.error(f"--engine: thread, process or processN, got {e!r}")
    rows = []
    for _ in range(args.repeat):
        for interval, impl, engine, src in itertools.product(intervals, impls, engines, srcs):
            if engine != "thread" and impl != impls[0]:
                continue  # the engine process's servers take no --server choice: one row
            rows.append(measure(src, args.tokenizer, interval, impl, engine, args))
            r = rows[-1]
            print(f"{r['src']:<16} {engine:<8} {impl:<18} interval {interval:>3}: {r['tokens_per_s']:>9,.0f} tok/s "
                  f"{r['chunks_per_s']:>8,.0f} chunks/s  server CPU {r['server_cpu_per_s']:.2f} s/s "
                  f"({r['server_cpu_us_per_token']:.1f} us/token), engine process {r['engine_cpu_per_s']:.2f} s/s, "
                  f"clients {r['client_cpu_per_s']:.2f} s/s" + (
                      f"; alone: TTFT p50 {r['ttft_p50_ms']:.2f} ms, request {r['request_p50_ms']:.2f} ms"
                      if args.latency else ""), flush=True)
            if r["client_cpu_per_s"] > 0.9 * args.client_processes:
                print(f"  warning: the clients used {r['client_cpu_per_s']:.2f} CPU-s/s over "
                      f"{args.client_processes} process(es): they, not the server, may have set this rate "
                      "(raise --client-processes)", flush=True)
    summary = {}
    for label, interval, impl, engine in itertools.product(dict.fromkeys(r["src"] for r in rows), intervals, impls,
                                                           engines):
        mine = [r for r in rows if (r["src"], r["stream_interval"], r["server"], r["engine"]) ==
                (label, interval, impl, engine)]
        if mine:
            summary[f"{label}|{interval}|{impl}|{engine}"] = {
                k: statistics.median(r[k] for r in mine) for k in
                ("tokens_per_s", "chunks_per_s", "server_cpu_us_per_token", "server_cpu_per_s", "engine_cpu_per_s",
                 "client_cpu_per_s", *(("ttft_p50_ms", "request_p50_ms") if args.latency else ()))}
    result = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows, "median": summary}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
