"""`peagle bench` at real size without weights: random weights and (benchmark-only) synthetic acceptance."""

import json

import pytest

from peagle.cli import main


@pytest.fixture(scope="module")
def config_only_dir(config_only_checkpoint):
    return config_only_checkpoint()


def test_dummy_weights_with_synthetic_acceptance(config_only_dir, tiny_hf_checkpoint, tmp_path):
    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(config_only_dir), "--tokenizer", str(tiny_hf_checkpoint("llama")),
               "--load-format", "dummy", "--draft-eagle3", "dummy", "--draft-peagle", "dummy",
               "--methods", "none,eagle3,peagle", "--k", "2", "--concurrency", "2", "--datasets", "mtbench",
               "--num-prompts", "2", "--max-tokens", "24", "--ignore-eos", "--synthetic-acceptance", "0.9,0.6",
               "--device", "cpu", "--dtype", "float32", "--max-model-len", "1024", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert "SYNTHETIC ACCEPTANCE" in results["config"]["note"] and "RANDOM WEIGHTS" in results["config"]["note"]
    spec = [p for p in results["points"] if p["method"] != "none"]
    assert {p["method"] for p in spec} == {"eagle3", "peagle"}
    for p in spec:  # AL = 1 + 0.9 + 0.6 in expectation; random weights alone would give about 1.0
        assert 1.8 < p["acceptance_length"] < 3.0


def test_synthetic_acceptance_needs_dummy_weights(tiny_hf_checkpoint, tmp_path, capsys):
    rc = main(["bench", "--model", str(tiny_hf_checkpoint("llama")), "--methods", "peagle", "--k", "2",
               "--synthetic-acceptance", "0.9,0.6", "--device", "cpu", "--out", str(tmp_path / "x")])
    assert rc != 0
    assert "--load-format dummy" in capsys.readouterr().err


def test_k11_sweep_with_sampling_table_end_to_end(config_only_dir, tiny_hf_checkpoint, tmp_path):
    # K = 11, the sweep's largest: drafts accepted (by dice) deep into the round, greedy and sampled tables.
    rates = "0.95,0.9,0.85,0.8,0.75,0.7,0.65,0.6,0.55,0.5,0.45"
    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(config_only_dir), "--tokenizer", str(tiny_hf_checkpoint("llama")),
               "--load-format", "dummy", "--draft-eagle3", "dummy", "--draft-peagle", "dummy",
               "--methods", "eagle3,peagle", "--k", "11", "--concurrency", "2", "--datasets", "mtbench",
               "--num-prompts", "2", "--max-tokens", "24", "--ignore-eos", "--synthetic-acceptance", rates,
               "--temperature", "0,0.7", "--no-remeasure", "--device", "cpu",
               "--dtype", "float32", "--max-model-len", "1024", "--out", str(out)])
    assert rc == 0
    points = json.loads((out / "results.json").read_text())["points"]
    assert len(points) == 4 and {p["temperature"] for p in points} == {0.0, 0.7}
    for p in points:
        assert p["num_failed"] == 0 and p["output_tokens"] == 24 * p["num_prompts"], p
        assert p["k"] == 11 and len(p["per_position_acceptance"]) == 11 and p["acceptance_length"] > 3.0, p
    table = (out / "results.md").read_text()
    assert "## Greedy" in table and "## Temperature 0.7 sampling" in table
    assert (out / "throughput_mtbench_t0.7.png").is_file() and (out / "acceptance_vs_k_t0.7.png").is_file()
