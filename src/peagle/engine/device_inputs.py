"""A step's inputs on the device, as the model runner and the CUDA graphs' static buffers hold them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DeviceInputs:
    """One step's inputs on the device (StepInputs uploaded, or a graph's static buffers): B requests (padding
    included), T fed tokens. Also read by name (`x["drafts"]`), as the kernels that write some take them."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    logit_rows: torch.Tensor | None  # [B * (k + 1)] int64 rows whose target logits verify; None: every row (decode)
    drafts: torch.Tensor  # [B, k] int64
    num_drafts: torch.Tensor  # [B] int64
    chunk_next: torch.Tensor | None = None  # [B] int64 the prompt token after a prefill chunk, -1 for the others

    def __getitem__(self, name: str) -> torch.Tensor | None:
        return getattr(self, name)
