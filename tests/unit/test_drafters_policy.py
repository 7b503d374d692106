"""A head's adaptive.json (as `peagle bench --calibrate` writes it) as the head's default policy."""

import json

import pytest

from peagle.bench.calibration import write_policy
from peagle.drafters.policy import POLICY_FILE, head_adaptive_default
from peagle.engine.config import SpeculativeConfig


def test_head_policy_is_the_default_only_when_none_is_given(tmp_path):
    spec = {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 7, "parallel_drafting": True}
    assert head_adaptive_default(spec) is spec  # no adaptive.json: unchanged
    write_policy(tmp_path / POLICY_FILE, {"thresholds": [[8, 7], [32, 3]], "above": 0}, {"gpu": "test"})
    saved = json.loads((tmp_path / POLICY_FILE).read_text())
    assert saved["calibration"] == {"gpu": "test"} and saved["above"] == 0
    assert head_adaptive_default(spec)["adaptive"] == {"thresholds": [[8, 7], [32, 3]], "above": 0}
    fixed = {**spec, "adaptive": {}}
    assert head_adaptive_default(fixed) is fixed  # an explicit (empty) policy wins
    # Both LLM(speculative_config=...) and peagle serve (--speculative-config or the environment) parse here.
    parsed = SpeculativeConfig.from_dict(json.dumps(spec))
    assert [parsed.adaptive.k_for(n, 7) for n in (1, 8, 9, 33)] == [7, 7, 3, 0]
    assert SpeculativeConfig.from_dict(fixed).adaptive.thresholds == ()
    assert SpeculativeConfig.from_dict({**spec, "model": "dummy"}).adaptive.thresholds == ()


def test_environment_config_gets_the_head_default(tmp_path, monkeypatch):
    write_policy(tmp_path / POLICY_FILE, {"thresholds": [[4, 5]], "above": 3}, {})
    monkeypatch.setenv("PEAGLE_SPECULATIVE_CONFIG", json.dumps(
        {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 5}))
    assert SpeculativeConfig.from_env().adaptive.above == 3


def test_a_malformed_policy_file_says_which_file(tmp_path):
    (tmp_path / POLICY_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="adaptive.json is not an adaptive policy file"):
        head_adaptive_default({"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3})
