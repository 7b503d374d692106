"""BlockManager: hands out the paged KV cache's blocks (ints 0..num_blocks-1) to sequences' block tables, and with
prefix caching keeps the blocks of finished prompts for later prompts that start the same way.

Prefix caching (vLLM's automatic prefix caching, by full block): a prompt's block i is named by a key that hashes
the keys before it, its own tokens and the token after it (`prefix_keys`). The token after belongs in the key
because the drafter's cache entry at a block's last position reads it (a draft slot pairs token p + 1 with the
target's feature at p): two prompts that share a block but not the token after it share no drafter entry. So a
block is only ever named once the token after it is in the prompt, and a prompt always computes at least its last
token. A block's key is registered (`register`) after the step that computes it has been scheduled, never within
it, so a prompt never reads a block that its own step is still writing; steps run in order on one stream. Blocks
with a key whose last owner has finished stay cached (evictable, least recently freed first) until a block is
needed; then they are the last to be handed out. A sequence that gives its blocks up (finished, aborted, preempted)
names its answer's full blocks as well, those before num_computed_tokens (`_name_computed`), so the next turn of
a chat, whose prompt is this prompt and this answer and more, takes them. Nothing writes into a cached block: a prompt that reuses k blocks
starts computing at position k x block_size, in blocks of its own.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Sequence as Seq

import numpy as np

from peagle.engine.sequence import Sequence


def prefix_keys(token_ids: Seq[int], block_size: int) -> list[bytes]:
    """The keys of a prompt's full blocks that have a token after them: block i covers tokens
    [i*block_size, (i+1)*block_size), and its key hashes block i-1's key, those tokens and token (i+1)*block_size."""
    keys: list[bytes] = []
    previous = b""
    ids = np.asarray(token_ids, dtype=np.int64)
    for i in range((len(ids) - 1) // block_size):
        digest = hashlib.sha256(previous)
        digest.update(ids[i * block_size:(i + 1) * block_size + 1].tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


class BlockManager:
    """A free list of fixed-size KV blocks. Block `b` holds slots `b*block_size .. (b+1)*block_size - 1`.

    A sequence owns the blocks in its `block_table`; its KV position p lives in block `block_table[p // block_size]`.
    Without prefix caching every block has exactly one owner; with it, a cached block may be in several tables
    (counted by reference) and stays cached after its last owner frees it, until it is needed.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # free and holding nothing worth keeping
        self._refs: dict[int, int] = {}  # blocks in some block table: how many
        self._cached: dict[bytes, int] = {}  # key -> the block holding that prefix block
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, in no table; oldest first
        self.num_hit_tokens = 0  # prompt tokens taken from the cache, over all admissions

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return len(self._refs) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix caching ----------------------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks that a sequence about to be prefilled from its start can take (its longest cached
        prefix of full blocks); [] without prefix caching or once the sequence holds blocks."""
        if not self.enable_prefix_caching or seq.block_table or seq.num_computed_tokens:
            return []
        # a sequence preempted by recompute has an answer too: its blocks, named when it gave them up, count
        keys = self._prompt_keys(seq) if seq.num_tokens == seq.num_prompt_tokens else prefix_keys(
            seq.token_ids, self.block_size)
        blocks = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take_cached_prefix(self, seq: Sequence, blocks: list[int]):
        """Give `seq` the cached `blocks` (from `cached_prefix`) as the start of its block table; its first
        len(blocks) x block_size tokens count as computed."""
        assert not seq.block_table and not seq.num_computed_tokens, seq
        for block in blocks:
            self._evictable.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
            seq.block_table.append(block)
        seq.num_computed_tokens = len(blocks) * self.block_size
        # prompt tokens served from the cache (a preempted sequence may take its answer's blocks too)
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.num_hit_tokens += seq.num_cached_tokens

    def register(self, seq: Sequence, num_computed_tokens: int):
        """Name the full prompt blocks of `seq` that a scheduled step computes up to `num_computed_tokens`, for later
        prompts to find; a key already held by another block keeps that block."""
        if not self.enable_prefix_caching:
            return
        self._name(seq, self._prompt_keys(seq), num_computed_tokens // self.block_size)

    def _name(self, seq: Sequence, keys: list[bytes], num_blocks: int):
        for i in range(min(len(keys), num_blocks, len(seq.block_table))):
            block, key = seq.block_table[i], keys[i]
            if key in self._cached or block in self._key_of:
                continue
            self._cached[key] = block
            self._key_of[block] = key

    def _name_computed(self, seq: Sequence):
        """As a sequence gives its blocks up, name every full block whose entries are final, its answer's too: the
        target's KV and the drafter's entry at each position before num_computed_tokens (the step that fed a token
        ran the drafter over it, with the token after it), so a later prompt that starts with this prompt and its
        answer (the next turn of a chat) takes them. Not after a step that fed it without the drafter (the adaptive
        policy's K = 0): its drafter entries there were never written."""
        if seq.drafter_gap or seq.num_computed_tokens <= seq.num_prompt_tokens:
            return  # the prompt's blocks were named when they were scheduled
        n = seq.num_computed_tokens
        self._name(seq, prefix_keys(seq.token_ids[:n + 1], self.block_size), n // self.block_size)

    def _prompt_keys(self, seq: Sequence) -> list[bytes]:
        if seq.prefix_keys is None:
            seq.prefix_keys = prefix_keys(seq.token_ids[:seq.num_prompt_tokens], self.block_size)
        return seq.prefix_keys

    # ---- allocation --------------------------------------------------------------------------------------------

    def _missing(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int, cached: Seq[int] = ()) -> bool:
        """Whether `seq`'s block table can be grown to cover `num_tokens` slots (after taking the `cached` blocks,
        which then are no longer free)."""
        missing = max(0, self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached))
        taken = sum(1 for block in cached if block in self._evictable)
        return missing <= self.num_free_blocks - taken

    def allocate(self, seq: Sequence, num_tokens: int):
        """Grow `seq.block_table` to cover `num_tokens` slots (never shrinks it)."""
        missing = self._missing(seq, num_tokens)
        assert missing <= self.num_free_blocks, f"{seq.seq_id}: needs {missing} blocks, {self.num_free_blocks} free"
        for _ in range(missing):
            if self._free:
                block = self._free.popleft()
            else:  # the least recently freed cached block gives up its key
                block, _ = self._evictable.popitem(last=False)
                del self._cached[self._key_of.pop(block)]
            self._refs[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence):
        """Return all of `seq`'s blocks (a cached block stays cached; with prefix caching its computed blocks are
        named first); a sequence without blocks is a no-op."""
        if self.enable_prefix_caching and seq.block_table:
            self._name_computed(seq)
        for block in reversed(seq.block_table):  # a prompt's last blocks are evicted before its first ones
            assert block in self._refs, f"{seq.seq_id}: block {block} freed twice or never allocated"
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            del self._refs[block]
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        seq.block_table.clear()
