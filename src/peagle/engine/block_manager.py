"""BlockManager: hands out the paged KV cache's blocks (ints 0..num_blocks-1) to sequences' block tables."""

from __future__ import annotations

from collections import deque

from peagle.engine.sequence import Sequence


class BlockManager:
    """A free list of fixed-size KV blocks. Block `b` holds slots `b*block_size .. (b+1)*block_size - 1`.

    A sequence owns the blocks in its `block_table`; its KV position p lives in block `block_table[p // block_size]`.
    No prefix caching: every block has exactly one owner.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    @property
    def usage(self) -> float:
        return len(self._used) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _missing(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq`'s block table can be grown to cover `num_tokens` slots."""
        return self._missing(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int):
        """Grow `seq.block_table` to cover `num_tokens` slots (never shrinks it)."""
        missing = self._missing(seq, num_tokens)
        assert missing <= len(self._free), f"{seq.seq_id}: needs {missing} blocks, {len(self._free)} free"
        for _ in range(missing):
            block = self._free.popleft()
            self._used.add(block)
            seq.block_table.append(block)

    def free(self, seq: Sequence):
        """Return all of `seq`'s blocks; a sequence without blocks is a no-op."""
        for block in seq.block_table:
            assert block in self._used, f"{seq.seq_id}: block {block} freed twice or never allocated"
            self._used.remove(block)
            self._free.append(block)
        seq.block_table.clear()
