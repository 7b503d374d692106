"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (Hopper and newer).

A batch-1 decode step of a small target is a chain of latency-bound kernels (about ten per layer of a few us each on
an H200): part of each one's time is the gap in which the GPU drains the kernel before and
starts the next. With PDL a kernel launched with `launch_pdl=True` may start while the kernel before it is still
running, once that one allows it (`gdc_launch_dependents`), and waits inside (`gdc_wait`) until the one before has
finished and its writes are visible. The kernels that take a USE_PDL constexpr begin with

    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before has finished; its writes are visible
        tl.extra.cuda.gdc_launch_dependents()  # the kernel after may start its launch

(written out in each kernel: a jitted helper from another module would not follow Triton's interpreter into the
private kernel copies of peagle.kernels' CPU tests). Nothing but weights (never written while the model runs: the GEMV
reads its first tile early) is read, and nothing written, before the wait, so a buffer that the caching allocator
hands from a finished kernel's input to the next kernel's output is never written early, and a kernel launched without
PDL (cuBLAS, PyTorch) simply runs after the one before, as always. Under CUDA graph capture the launches become
programmatic edges of the graph (CUDA 12.3 and newer).

`ENABLED` (off by default until timed: scripts/device/engine_timing.py, variant `+pdl`; the environment variable
PEAGLE_PDL=1 sets it at import, for any script) turns it on for CUDA devices of compute capability 9 or newer;
elsewhere, and under Triton's interpreter, `options` gives `USE_PDL=False` only.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "PEAGLE_PDL"


def _from_env() -> bool:
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 0 or 1")
    return value == "1"


ENABLED = _from_env()


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def active(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now."""
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


_ON = {"USE_PDL": True, "launch_pdl": True}
_OFF = {"USE_PDL": False}


def options(device: torch.device) -> dict:
    """Keyword arguments of a kernel launch on `device` (called at every launch; shared, never to be changed): the
    kernel's USE_PDL constexpr, and Triton's launch_pdl option where PDL is active."""
    return _ON if active(device) else _OFF

