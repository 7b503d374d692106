"""The drafter's element-wise steps compiled for training: RMSNorm, add + RMSNorm, RoPE and SiLU-and-mul.

While autograd records, the decoder layers run the PyTorch references of these steps (the Triton kernels have no
backward), several small kernels each plus the dtype casts between them, a sizeable share of a P-EAGLE training
step on the GPU (off by default: docs/DECISIONS.md). `install` compiles each reference (`torch.compile`,
dynamic shapes), checks the compiled forward and backward against the reference on small inputs in both dtypes a
step sees, and installs the ones that agree in `peagle.models.layers.TRAINING_OPS`; an op whose compilation or check
fails keeps its reference, and so does one whose compiled form fails later on a new input.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from peagle import kernels
from peagle.models import layers

logger = logging.getLogger(__name__)

OPS = ("rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul")


def _samples(name: str, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list:
    """Small inputs of op `name` (requires_grad where the training forward differentiates)."""
    def rand(*shape, grad=True, dt=dtype):
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(device, dt).requires_grad_(grad)

    t, d = 37, 64
    if name == "rms_norm":
        return [rand(t, d), rand(d, dt=torch.float32), 1e-5]
    if name == "fused_add_rms_norm":
        return [rand(t, d), rand(t, d), rand(d, dt=torch.float32), 1e-5]
    if name == "rotary":
        positions = torch.randint(0, 96, (t,), generator=gen).to(device)
        cos, sin = rand(96, 16, grad=False, dt=torch.float32), rand(96, 16, grad=False, dt=torch.float32)
        return [positions, rand(t, 4, 16), rand(t, 2, 16), cos, sin]
    return [rand(t, 2 * d)]


def _outputs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


def agrees(name: str, fn: Callable, device: torch.device, dtypes=(torch.float32, torch.bfloat16)) -> bool:
    """Whether `fn` gives op `name`'s reference outputs and input gradients on small inputs of each dtype."""
    ref = getattr(kernels, f"{name}_ref")
    for dtype in dtypes:
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        gen = torch.Generator().manual_seed(0)
        args = _samples(name, device, dtype, gen)
        grads = []
        for impl in (ref, fn):
            inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
            outs = _outputs(impl(*inputs))
            sum(o.float().sum() * (i + 1) for i, o in enumerate(outs)).backward()
            grads.append(([o.detach() for o in outs],
                          [a.grad for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]))
        (ref_out, ref_grad), (out, grad) = grads
        if len(out) != len(ref_out) or len(grad) != len(ref_grad):
            return False
        for a, b in zip(out + grad, ref_out + ref_grad):
            if a.dtype != b.dtype or not torch.allclose(a.float(), b.float(), **tol):
                return False
    return True


class _Guarded:
    """The compiled op, or the reference once the compiled one has failed (logged once)."""

    def __init__(self, name: str, compiled: Callable):
        self.name, self.compiled, self.ref = name, compiled, getattr(kernels, f"{name}_ref")

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - a compiled op that fails falls back to its reference
                logger.warning("compiled %s failed (%s: %s); using its reference", self.name, type(e).__name__,
                               str(e).splitlines()[0] if str(e) else "")
                self.compiled = None
        return self.ref(*args)


def install(device: torch.device, backend: str = "inductor") -> list[str]:
    """Compiles, checks and installs the training implementations of OPS for `device`; returns the names
    installed. `uninstall` restores the references."""
    installed = []
    for name in OPS:
        compiled = torch.compile(getattr(kernels, f"{name}_ref"), dynamic=True, backend=backend)
        try:
            ok = agrees(name, compiled, device)
        except Exception as e:  # noqa: BLE001 - any compile failure means: keep the reference
            logger.warning("compiling %s for training failed (%s: %s); using its reference", name,
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            continue
        if not ok:
            logger.warning("compiled %s differs from its reference; using the reference", name)
            continue
        layers.TRAINING_OPS[name] = _Guarded(name, compiled)
        installed.append(name)
    logger.info("compiled element-wise steps for training: %s", ", ".join(installed) or "none")
    return installed


def uninstall() -> None:
    layers.TRAINING_OPS.clear()
