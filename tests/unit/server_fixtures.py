"""Helpers for the server tests: tiny CPU engines and a real uvicorn server on 127.0.0.1 in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from peagle.drafters import Drafter, save_drafter
from peagle.engine.config import EngineConfig, SpeculativeConfig
from peagle.engine.llm_engine import LLMEngine

MODES = ("none", "eagle3", "peagle")  # no speculation, EAGLE-3 chained drafting, P-EAGLE parallel drafting
K = 3


def make_head(target_dir: Path, method: str, out: Path) -> Path:
    """A random drafter head for the target; accepts few drafts, which is enough to exercise every code path."""
    drafter = Drafter.for_target(target_dir, method, 1, seed=3)
    save_drafter(drafter, out)
    return out


def make_engine(target_dir: Path, head: Path | None = None, method: str = "none", **kw) -> LLMEngine:
    spec = None
    if head is not None:
        spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": str(head), "num_speculative_tokens": K,
                                            "parallel_drafting": method == "peagle"})
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineConfig(model=str(target_dir), device="cpu", dtype="float32", max_model_len=256,
                                  speculative=spec, **kw))


@contextmanager
def serve(app) -> Iterator[str]:
    """Runs `app` with uvicorn on a free 127.0.0.1 port; yields its base URL (no trailing slash)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


class StepControl:
    """Replaces an engine's `step`: slows it down (so requests stay in flight), holds it while `gate` is cleared,
    or makes the next step raise once `fail_next` is set."""

    def __init__(self, engine: LLMEngine, delay_s: float = 0.0):
        self.inner = engine.step
        self.delay_s = delay_s
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = threading.Event()
        engine.step = self

    def __call__(self):
        if not self.gate.wait(timeout=60):
            raise RuntimeError("the test left the step gate closed")
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail_next.is_set():
            self.fail_next.clear()
            raise RuntimeError("injected step failure")
        return self.inner()


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted labels): value}, through prometheus-client's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
