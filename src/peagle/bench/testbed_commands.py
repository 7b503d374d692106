"""The testbed's subprocesses: a step's commands started side by side, each with its log, stopped at the step's
wall-clock limit (SIGTERM, then SIGKILL after STOP_GRACE_S), a half-written output never left behind, a failure
named with the end of its log; and a SIGTERM of the build itself stopping them before it exits. Also the plan's
units that testbed.py builds and testbed_report.py describes: steps, and the phases they run in."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

logger = logging.getLogger("peagle.bench.testbed")  # one logger for the whole build's progress

# A stopped subprocess gets this long to write what it finished before it is killed.
STOP_GRACE_S = 30.0
LOG_TAIL_LINES = 15
# How often a phase's lanes and their waits look whether the build was interrupted.
INTERRUPT_POLL_S = 0.5


class TestbedStepError(ValueError):
    """A step failed in a way the user can act on (network, disk, a failing subcommand); rerun resumes there."""


@dataclass(frozen=True, slots=True)
class Command:
    """A subprocess of a step. It succeeded when it exits with status 0; `partial`, if given, is the file it writes,
    moved to `output` only then, so a stopped command leaves no half-written file behind."""

    name: str
    argv: tuple[str, ...]
    output: Path
    log: Path | None = None  # its stdout and stderr (None: this terminal)
    partial: Path | None = None

    def display(self) -> str:
        args = self.argv[1:]
        if args[:2] == ("-m", "peagle"):
            return " ".join(("peagle", *args[2:]))
        return " ".join(("python", *(Path(a).name if i == 0 and a.endswith(".py") else a for i, a in enumerate(args))))


# What runs in place of a command that failed before the step's limit, given the command, its exit code and the
# seconds left; None lets the failure stand.
Restart = Callable[[Command, int, float], "Command | None"]


def run_commands(commands: Sequence[Command], limit_s: float, env: Mapping[str, str] | None = None,
                 cancel: threading.Event | None = None, restart: Restart | None = None) -> list[str]:
    """Starts the commands side by side and waits until they exit or `limit_s` has passed; those still running then
    get SIGTERM and, STOP_GRACE_S later, SIGKILL. Returns the names of the commands stopped at the limit.
    `restart`: a command that fails before the limit is replaced, once, by what it returns (the others run on).

    Raises TestbedStepError for a command that failed, or that was stopped before it wrote its output. A SIGTERM or
    Ctrl-C of this process stops the commands too (Ctrl-C reaches them itself) before it propagates; so does
    `cancel` being set, which raises KeyboardInterrupt here (how a phase's main thread stops its other lanes).
    """
    started: list[tuple[Command, subprocess.Popen]] = []
    stopped: list[str] = []
    deadline = time.monotonic() + limit_s
    with sigterm_raises_interrupt():
        try:
            for c in commands:
                started.append((c, _start(c, env)))
            _wait(started, deadline, cancel, restart, env)
            late = [(c, proc) for c, proc in started if proc.poll() is None]
            if late:
                stopped = [c.name for c, _ in late]
                logger.info("time limit of %s reached: stopping %s", seconds(limit_s), ", ".join(stopped))
                _stop([proc for _, proc in late])
        finally:
            _stop([proc for _, proc in started if proc.poll() is None])
    errors = []
    for c, proc in started:
        if proc.returncode == 0 and c.partial is not None and c.partial.exists():
            os.replace(c.partial, c.output)
        elif c.partial is not None:
            c.partial.unlink(missing_ok=True)
        if c.name in stopped:
            if not c.output.exists():
                errors.append(f"`{c.display()}` was stopped at the step's limit of {seconds(limit_s)} before it "
                              f"wrote {c.output}{_tail(c.log)}")
        elif proc.returncode != 0:
            errors.append(f"`{c.display()}` failed (exit code {proc.returncode}){_tail(c.log)}")
    if errors:
        raise TestbedStepError("; ".join(errors) + "; fix the cause (or give the step more time: Scale) and rerun "
                               "`peagle testbed`: finished steps are kept, stopped ones resume")
    return stopped


def _wait(started: list[tuple[Command, subprocess.Popen]], deadline: float, cancel: threading.Event | None,
          restart: Restart | None = None, env: Mapping[str, str] | None = None) -> None:
    """Until every process has exited or the deadline has passed; raises KeyboardInterrupt once `cancel` is set.
    A process that fails meanwhile is replaced in `started`, once per command, by what `restart` gives for it."""
    restarted: set[str] = set()
    while (left := deadline - time.monotonic()) > 0:
        if cancel is not None and cancel.is_set():
            raise KeyboardInterrupt("the testbed build was interrupted")
        for i, (c, proc) in enumerate(started):
            if restart is not None and proc.poll() not in (None, 0) and c.name not in restarted:
                restarted.add(c.name)
                again = restart(c, proc.returncode, left)
                if again is not None:
                    started[i] = (again, _start(again, env))
        running = [proc for _, proc in started if proc.poll() is None]
        if not running:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            running[0].wait(timeout=min(left, INTERRUPT_POLL_S))


def _start(command: Command, env: Mapping[str, str] | None) -> subprocess.Popen:
    if command.log is None:
        return subprocess.Popen(command.argv, env=env)
    command.log.parent.mkdir(parents=True, exist_ok=True)
    with open(command.log, "ab") as log:  # the child holds its own descriptor
        return subprocess.Popen(command.argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM, then SIGKILL after STOP_GRACE_S for any that still runs."""
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def sigterm_raises_interrupt():
    """SIGTERM of the testbed itself raises KeyboardInterrupt where it waits, so its subprocesses are stopped
    before it exits (instead of outliving it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _tail(log: Path | None) -> str:
    if log is None or not log.is_file():
        return ""
    lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    return f"; the end of {log}:\n" + "\n".join(lines) + "\n"


def seconds(s: float) -> str:
    return f"{s:,.0f} s" if s >= 10 else f"{s:.1f} s"


# ---- the build plan: steps and the phases they run in ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    outputs: tuple[Path, ...]
    limit_s: float  # subprocesses are stopped there; in-process work is measured against it
    run: Callable[[], str]  # does the work; returns a note for the progress line ("" for none)
    commands: Callable[[], list[Command]] | None = None  # the subprocesses `run` would start now, side by side
    budgeted: bool = True  # counts toward Scale.budget_s (downloads do not)


@dataclass(frozen=True, slots=True)
class Phase:
    """One unit of the build order: a phase of PHASES (lanes side by side, each lane's steps one after another), or
    a step that runs alone (one lane of itself, named after it)."""

    name: str
    lanes: tuple[tuple[Step, ...], ...]

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(step for lane in self.lanes for step in lane)

    @property
    def limit_s(self) -> float:
        """Its wall-clock limit: its longest lane's (what counts toward Scale.budget_s)."""
        return max(sum(step.limit_s for step in lane) for lane in self.lanes)

    @property
    def budgeted(self) -> bool:
        return all(step.budgeted for step in self.steps)
