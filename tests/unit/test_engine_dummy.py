"""Random-weight loading and synthetic acceptance (benchmarking at real size without trained weights)."""


import pytest
import torch

from peagle import LLM, SamplingParams
from peagle.engine.config import EngineConfig, SpeculativeConfig
from peagle.engine.spec import verifier
from peagle.engine.spec.verifier import verify_synthetic


@pytest.fixture(scope="module")
def config_only_dir(config_only_checkpoint):
    return config_only_checkpoint("Qwen3ForCausalLM", max_position_embeddings=512, rope_theta=1e6, eos_token_id=1)


def test_dummy_load_runs_from_config_alone(config_only_dir):
    llm = LLM(model=str(config_only_dir), load_format="dummy", device="cpu", dtype="float32", max_model_len=128)
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 8 and out[0].text == ""
    with pytest.raises(ValueError, match="token-id lists"):
        llm.generate("text needs a tokenizer")


def test_synthetic_acceptance_matches_rates(config_only_dir):
    rates = [0.8, 0.6, 0.3]
    llm = LLM(model=str(config_only_dir), load_format="dummy", device="cpu", dtype="float32", max_model_len=256,
              speculative_config={"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3,
                                  "parallel_drafting": True}, synthetic_acceptance=rates, max_num_seqs=8)
    outs = llm.generate([[i + 2, 5, 7] for i in range(8)],
                        SamplingParams(temperature=0, max_tokens=150, ignore_eos=True), use_tqdm=False)
    rounds = sum(o.metrics.num_drafting_rounds for o in outs)
    per_pos = [sum(o.metrics.accepted_per_position[i] for o in outs) / rounds for i in range(3)]
    assert rounds > 300
    for got, want in zip(per_pos, rates):
        assert abs(got - want) < 0.07, (per_pos, rates)


def test_synthetic_verifier_statistics():
    torch.manual_seed(0)
    n, k = 100_000, 4
    rates = (0.9, 0.7, 0.5, 0.2)
    out = verify_synthetic(torch.zeros(n, k + 1, dtype=torch.long), torch.ones(n, k, dtype=torch.long),
                           torch.full((n,), k), rates)
    for i, r in enumerate(rates):
        assert abs((out.num_accepted > i).float().mean().item() - r) < 0.01
    assert torch.all(out.output_tokens[torch.arange(n), out.num_accepted] == 0)
    # fewer drafts than rates: the first k rates; the conditional rates are made once, not every step
    out = verify_synthetic(torch.zeros(n, 3, dtype=torch.long), torch.ones(n, 2, dtype=torch.long),
                           torch.full((n,), 2), rates)
    for i, r in enumerate(rates[:2]):
        assert abs((out.num_accepted > i).float().mean().item() - r) < 0.01
    made = verifier._conditional_rates(rates[:2], torch.device("cpu"))
    assert verifier._conditional_rates(rates[:2], torch.device("cpu")) is made
    assert torch.allclose(made, torch.tensor([0.9, 0.7 / 0.9]))


def test_synthetic_acceptance_cannot_be_enabled_by_accident(tmp_path):
    spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="load_format='dummy'"):
        EngineConfig(model="m", speculative=spec, synthetic_acceptance=(0.5, 0.4))
    with pytest.raises(ValueError, match="never increase"):
        EngineConfig(model="m", speculative=spec, load_format="dummy", synthetic_acceptance=(0.2, 0.4))
    with pytest.raises(ValueError, match="one rate per draft position"):
        EngineConfig(model="m", speculative=spec, load_format="dummy", synthetic_acceptance=(0.5,))


def test_cuda_graphs_cover_every_k_the_adaptive_policy_picks(config_only_dir):
    llm = LLM(model=str(config_only_dir), load_format="dummy", device="cpu", dtype="float32", max_model_len=128,
              speculative_config={"method": "eagle3", "model": "dummy", "num_speculative_tokens": 7,
                                  "parallel_drafting": True,
                                  "adaptive": {"thresholds": [[4, 7], [16, 5], [64, 9]], "above": 2}})
    assert llm.engine.planner.graph_ks() == [2, 5, 7]
    off = LLM(model=str(config_only_dir), load_format="dummy", device="cpu", dtype="float32", max_model_len=128,
              speculative_config={"method": "eagle3", "model": "dummy", "num_speculative_tokens": 7,
                                  "parallel_drafting": True, "adaptive": {"thresholds": [[4, 7]], "above": 0}})
    assert off.engine.planner.graph_ks() == [0, 7]  # K = 0: plain-step graphs (speculation off)


def test_kv_sizing_collects_dropped_engines_first_and_explains_a_shortfall(config_only_dir, monkeypatch):
    # On a GPU the KV cache is sized from free memory; an engine dropped earlier may hold memory through reference
    # cycles until the garbage collector runs, so sizing collects first. Simulated here with a fake 10 GiB device.
    import gc

    import peagle.engine.llm_engine as llm_engine

    llm = LLM(model=str(config_only_dir), load_format="dummy", device="cpu", dtype="float32", max_model_len=128)
    engine = llm.engine
    calls = []
    collect = gc.collect
    monkeypatch.setattr(llm_engine.gc, "collect", lambda: calls.append("collect") or collect())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def mem_get_info(device):
        calls.append("mem_get_info")
        return free[0], 10 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    engine.device = torch.device("cuda")
    free = [8 * 2**30]
    assert engine._num_blocks(None) > 0
    assert calls == ["collect", "empty_cache", "mem_get_info"]
    free[0] = 1 * 2**30  # 9 GiB held elsewhere: not even one sequence fits under 0.9 x 10 GiB
    with pytest.raises(ValueError, match=r"9\.0 of 10\.0 GiB already in use.*another LLM still referenced"):
        engine._num_blocks(None)



def test_async_scheduling_is_on_unless_turned_off():
    from peagle.cli import build_parser

    assert EngineConfig(model="m", device="cuda").async_scheduling is True
    assert EngineConfig(model="m", device="cuda", async_scheduling=False).async_scheduling is False
    parse = build_parser().parse_args
    assert parse(["serve", "m"]).async_scheduling is True
    assert parse(["serve", "m", "--no-async-scheduling"]).async_scheduling is False
    assert parse(["serve", "m", "--async-scheduling"]).async_scheduling is True
    assert parse(["regenerate", "--model", "m", "--prompts", "p", "--out", "o"]).async_scheduling is True
    assert parse(["regenerate", "--model", "m", "--prompts", "p", "--out", "o",
                  "--no-async-scheduling"]).async_scheduling is False