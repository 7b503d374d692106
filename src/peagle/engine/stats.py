"""The engine's load after a step, read by the server's metrics and admission. Torch-free, and a msgspec struct so
that the engine process's step messages carry it to the API server processes as it is."""

from __future__ import annotations

import msgspec


class EngineStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
