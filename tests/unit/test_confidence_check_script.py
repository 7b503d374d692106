"""scripts/confidence_check.py on the CPU: its replay of rounds under each confidence rule, and its recording of the
drafter's probabilities beside the drafts each round accepted, on a tiny model and random heads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from peagle import LLM
from peagle.drafters import Drafter, save_drafter

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "confidence_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("confidence_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rules_replay_rounds_as_prefixes(check):
    # Two rounds: probabilities [0.9, 0.5, 0.9] (both rules verify 3 at cutoff 0.4; at 0.5 the product stops at 1,
    # since 0.9 x 0.5 = 0.45) and [0.3, 0.9, 0.9]; the first accepted 2 drafts, the second none.
    probs = torch.tensor([[0.9, 0.5, 0.9], [0.3, 0.9, 0.9]])
    accepted = torch.tensor([2, 0])
    product = {r["cutoff"]: r for r in check.curve(probs, accepted, "product")}
    position = {r["cutoff"]: r for r in check.curve(probs, accepted, "position")}
    assert product[0.0] == {"cutoff": 0.0, "verified": 3.0, "accepted": 1.0}
    assert (product[0.5]["verified"], product[0.5]["accepted"]) == (0.5, 0.5)  # round 1 cut after its first draft
    assert (position[0.5]["verified"], position[0.5]["accepted"]) == (1.5, 1.0)
    assert check.kept_at(check.curve(probs, accepted, "position"), 0.5) == pytest.approx(1.0)
    assert 0.0 <= check.separation(probs, accepted, "product") <= 1.0


def test_rounds_are_recorded_per_request(tiny_hf_checkpoint, tmp_path, check):
    target = tiny_hf_checkpoint("llama", num_layers=2)
    save_drafter(Drafter.for_target(target, "peagle", 1, seed=3), tmp_path / "head")
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3,
            "parallel_drafting": True, "adaptive": {}}
    llm = LLM(model=str(target), speculative_config=spec, device="cpu", dtype="float32", max_model_len=96,
              max_num_seqs=2, async_scheduling=False, enforce_eager=True)
    chats = [[{"role": "user", "content": "Hello there"}], [{"role": "user", "content": "Count: 1 2 3"}]]
    probs, accepted = check.record_rounds(llm, chats, 12)
    assert probs.shape[1] == 3 and len(probs) == len(accepted) > 4
    assert ((probs > 0) & (probs <= 1)).all() and ((accepted >= 0) & (accepted <= 3)).all()
