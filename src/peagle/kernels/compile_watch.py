"""Triton's just-in-time kernel variants counted, and logged once the engine serves: a variant built while serving
(compiled: hundreds of ms; or read from Triton's disk cache) stalls every request in the step that needed it, so
each one is a warning with the kernel's name and its constants (what a start-up warm-up would have to cover)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class CompileWatch:
    """Counts the kernel variants Triton builds in this process (`count`, `seconds`); after `serving()`, logs each."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self.serving_count = 0
        self._serving = False
        self._started: float | None = None
        self._chained: tuple = (None, None)

    def install(self) -> bool:
        """Hooks Triton's compiler (keeping any hooks set before); False where this Triton has no hooks."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_post_compile_hook"):
            return False
        if runtime.jit_post_compile_hook == self._after:
            return True  # installed already (a second engine in this process)
        self._chained = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        return True

    def serving(self):
        """From now on each compile is logged as a warning."""
        self._serving = True

    def _before(self, **kwargs):
        self._started = time.perf_counter()
        return self._chained[0](**kwargs) if self._chained[0] else None

    def _after(self, **kwargs):
        took = time.perf_counter() - self._started if self._started is not None else 0.0
        self._started = None
        self.count += 1
        self.seconds += took
        if self._serving:
            self.serving_count += 1
            fn, constants = kwargs.get("fn"), kwargs.get("compile", {}).get("constants", {})
            params = getattr(getattr(fn, "jit_function", None), "params", [])
            shown = ", ".join(f"{_param_name(k, params)}={v}" for k, v in constants.items() if not callable(v))
            name = getattr(fn, "name", "?")
            logger.warning("a new Triton kernel variant while serving: %s in %.0f ms (compiled, or read from "
                           "Triton's disk cache; %d so far): %s", name, 1e3 * took, self.serving_count, shown)
        return self._chained[1](**kwargs) if self._chained[1] else None


WATCH = CompileWatch()


def _param_name(path, params) -> str:
    """A constant's name: Triton keys constants by their argument's index path ((3,) for the fourth argument)."""
    if isinstance(path, tuple) and len(path) == 1 and isinstance(path[0], int) and path[0] < len(params):
        return params[path[0]].name
    return str(path)
