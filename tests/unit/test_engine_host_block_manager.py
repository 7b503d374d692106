import random

import pytest

from peagle.engine.block_manager import BlockManager
from peagle.engine.sampling_params import SamplingParams
from peagle.engine.sequence import Sequence


def make_seq(i=0):
    return Sequence(f"r{i}", [1], SamplingParams(), arrival_time=0.0)


def test_invalid_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_allocate_grows_and_free_returns():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    seq = make_seq()
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_used_blocks == 2 and bm.num_free_blocks == 6
    bm.allocate(seq, 3)  # never shrinks
    assert len(seq.block_table) == 2
    bm.allocate(seq, 12)
    assert len(seq.block_table) == 3 and bm.usage == 3 / 8
    assert bm.can_allocate(seq, 32) and not bm.can_allocate(seq, 33)
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.free(seq)  # a sequence without blocks frees nothing
    assert bm.num_free_blocks == 8


def test_allocating_beyond_free_blocks_is_a_bug():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(AssertionError):
        bm.allocate(make_seq(), 9)


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq(0), make_seq(1)
    bm.allocate(a, 4)
    b.block_table = list(a.block_table)  # corruption: two owners of one block
    bm.free(a)
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(b)


def test_random_allocate_free_never_leaks():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4)
    seqs = [make_seq(i) for i in range(20)]
    for _ in range(5000):
        seq = rng.choice(seqs)
        if rng.random() < 0.3:
            bm.free(seq)
        else:
            n = len(seq.block_table) * 4 + rng.randint(0, 12)
            if bm.can_allocate(seq, n):
                bm.allocate(seq, n)
        owned = [b for s in seqs for b in s.block_table]
        assert len(owned) == len(set(owned)) == bm.num_used_blocks
        assert all(0 <= b < 64 for b in owned)
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free_blocks == 64 and bm.num_used_blocks == 0
