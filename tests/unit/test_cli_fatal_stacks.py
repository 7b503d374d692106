"""A process that dies of a fatal signal under `peagle` leaves every thread's Python stack on stderr."""

from __future__ import annotations

import subprocess
import sys

CRASH = """
import ctypes, threading, time
from peagle.cli import main

def planner():  # a second thread, as the trainer's prefetcher
    time.sleep(60)

threading.Thread(target=planner, name="plan-prefetch", daemon=True).start()
import peagle.cli
peagle.cli.build_parser = lambda: _parser()

def _parser():
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("crash").set_defaults(func=lambda args: ctypes.string_at(0))
    return p

main(["crash"])
"""


def test_a_segfault_in_a_command_prints_every_threads_stack():
    out = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Fatal Python error: Segmentation fault" in out.stderr
    assert "planner" in out.stderr  # the other thread's stack, not only the crashing one
    assert "string_at" in out.stderr or "<lambda>" in out.stderr


def test_without_peagle_main_no_stack_is_printed():
    # the control: the same crash outside main() dies silently, so the test above measures main's doing
    out = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.string_at(0)"], capture_output=True,
                         text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "Fatal Python error" not in out.stderr
