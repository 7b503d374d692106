"""The vectorised decode-step input builder equals the general one."""

import random

import numpy as np
import pytest

from peagle.engine.model_runner import ModelRunner


class FakeSeq:
    def __init__(self, rng: random.Random, block_size: int):
        n = rng.randrange(1, 200)
        self.token_ids = [rng.randrange(1000) for _ in range(n)]
        self.num_computed_tokens = n - 1
        blocks = -(-(n + 16) // block_size)
        self.block_table = rng.sample(range(500), blocks)

    @property
    def num_tokens(self):
        return len(self.token_ids)


@pytest.mark.parametrize("k,pad", [(0, 0), (3, 0), (7, 5)])
def test_decode_fast_path_equals_general_path(k, pad):
    rng = random.Random(k)
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.scratch_block, runner.max_blocks_per_seq = 16, 500, 32
    seqs = [FakeSeq(rng, 16) for _ in range(9)]
    drafts = [[rng.randrange(1000) for _ in range(k)] for _ in seqs]
    fast = runner._build_decode_inputs(seqs, drafts, k, len(seqs) + pad)
    general = runner._build_general_inputs(seqs, drafts, k, len(seqs) + pad)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "block_tables", "logit_rows",
                 "drafts", "num_drafts"):
        assert np.array_equal(getattr(fast, name), getattr(general, name)), name
    assert (fast.max_query_len, fast.num_real) == (general.max_query_len, general.num_real)
