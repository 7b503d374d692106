import pytest

from peagle.engine.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, -1, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and not p.ignore_eos
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=0).top_k == -1


def test_keyword_only():
    with pytest.raises(TypeError):
        SamplingParams(0.5)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=3.0), "max_tokens"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=[3]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
    (dict(seed="7"), "seed"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**kwargs)


def test_error_message_shows_the_value():
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=5).greedy
    assert not SamplingParams(temperature=1.0, top_k=0).greedy
