"""Command-line checks vLLM makes: the port range, max_model_len against the model's limit, speculative-config field
types, and `peagle inspect --target` failing for a head that does not fit."""

from __future__ import annotations

import json

import pytest
import uvicorn

from peagle.cli import main


@pytest.fixture(scope="module")
def target_dir(tiny_hf_checkpoint):
    return str(tiny_hf_checkpoint("llama", num_layers=4))


@pytest.fixture
def no_server(monkeypatch):
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("the server should not start"))
    for var in ("PEAGLE_SPECULATIVE_CONFIG", "SM_VLLM_SPECULATIVE_CONFIG"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("port", ["99999", "0", "http"])
def test_port_outside_the_range_is_refused(target_dir, no_server, capsys, port):
    with pytest.raises(SystemExit) as e:
        main(["serve", target_dir, "--port", port])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "1..65535" in err and "Traceback" not in err


def test_max_model_len_above_the_models_limit_is_refused(target_dir, no_server, capsys):
    assert main(["serve", target_dir, "--device", "cpu", "--max-model-len", "1000"]) == 1
    err = capsys.readouterr().err
    assert "max_position_embeddings" in err and "256" in err


@pytest.mark.parametrize("field, value", [
    ("num_speculative_tokens", "seven"),
    ("parallel_drafting", "yes"),
    ("method", 3),
    ("adaptive", [1, 2]),
])
def test_speculative_config_type_errors_name_the_field(target_dir, no_server, capsys, field, value):
    spec = {"method": "eagle3", "model": target_dir, "num_speculative_tokens": 3, field: value}
    assert main(["serve", target_dir, "--device", "cpu", "--speculative-config", json.dumps(spec)]) == 1
    assert f"speculative_config.{field}" in capsys.readouterr().err


def test_inspect_fails_for_a_head_that_does_not_fit(tmp_path, tiny_hf_checkpoint, target_dir, capsys):
    head = tmp_path / "head"
    assert main(["drafter", "init", "--target", target_dir, "--method", "eagle3", "--out", str(head)]) == 0
    assert main(["inspect", str(head), "--target", target_dir]) == 0
    assert main(["inspect", str(head), "--target", str(tiny_hf_checkpoint("qwen3"))]) == 1
    assert "fits target" in capsys.readouterr().out
