"""A script written for vLLM's Python API runs against `from peagle import LLM, SamplingParams` unchanged, and what
peagle does not implement is refused with an error that names it."""

from __future__ import annotations

import logging
import math

import pytest

from peagle import LLM, SamplingParams

EOS = 2  # <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def target_dir(tiny_hf_checkpoint):
    return str(tiny_hf_checkpoint("llama", num_layers=4))


@pytest.fixture(scope="module")
def llm(target_dir):
    # Every keyword here is one a vLLM user passes; dtype is left to "auto" (float32 on the CPU).
    return LLM(model=target_dir, tokenizer=target_dir, trust_remote_code=True, tensor_parallel_size=1,
               enable_prefix_caching=False, max_model_len=128, max_num_seqs=4, seed=0)


def test_a_vllm_style_script_runs(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The quick brown fox")
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=7, max_tokens=12, logprobs=2,
                            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, ignore_eos=True)
    outputs = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}], params, use_tqdm=False)

    assert [o.prompt for o in outputs] == ["Hello there", None]
    assert outputs[1].prompt_token_ids == ids
    for output in outputs:
        assert [c.index for c in output.outputs] == [0, 1]
        for c in output.outputs:
            assert len(c.token_ids) == 12 and c.finish_reason == "length" and c.stop_reason is None
            assert c.text == tokenizer.decode(c.token_ids)
            assert len(c.logprobs) == len(c.token_ids)
            for token_id, entry in zip(c.token_ids, c.logprobs):
                assert token_id in entry and 2 <= len(entry) <= 3
                assert entry[token_id].logprob <= 0 and entry[token_id].rank >= 1
                assert [lp.rank for t, lp in entry.items() if t != token_id] == sorted(
                    lp.rank for t, lp in entry.items() if t != token_id)
            assert math.isclose(c.cumulative_logprob, sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
        assert output.text == output.outputs[0].text  # the thin property over outputs[0]
    # n = 2 is two sequences with seeds 7 and 8, as vLLM's parallel sampling seeds them.
    single = [llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0.8, top_p=0.95, seed=s, max_tokens=12, presence_penalty=0.5, frequency_penalty=0.3,
        repetition_penalty=1.1, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids for s in (7, 8)]
    assert [c.token_ids for c in outputs[1].outputs] == single and single[0] != single[1]


def test_cpu_default_dtype_is_float32(llm, target_dir, caplog):
    assert str(llm.engine.dtype) == "torch.float32"
    with caplog.at_level(logging.INFO, logger="peagle.engine.llm"):
        LLM(model=target_dir, max_model_len=32, max_num_seqs=1)
    assert "float32" in caplog.text


def test_stop_token_text_and_stop_reason(llm):
    force_eos = {EOS: 100.0}
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=8, logit_bias=force_eos, min_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == EOS and EOS not in out.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason is None  # EOS: vLLM reports no stop_reason
    shown = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=8, logit_bias=force_eos, min_tokens=3,
                                              include_stop_str_in_output=True, skip_special_tokens=False),
                         use_tqdm=False)[0].outputs[0]
    assert shown.text == out.text + "<|im_end|>"
    by_id = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=8, logit_bias={77: 100.0},
                                              stop_token_ids=[77], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == [77] and by_id.stop_reason == 77 and by_id.text == ""


def test_stop_string_reason_and_inclusion(llm):
    free = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    stop = next(free.text[i:i + 2] for i in range(len(free.text) // 2, len(free.text) - 2)
                if free.text[i:i + 2].strip() and "\ufffd" not in free.text[i:i + 2])
    cut = free.text[:free.text.index(stop)]
    for include, text in ((False, cut), (True, cut + stop)):
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                   include_stop_str_in_output=include), use_tqdm=False)[0]
        assert out.outputs[0].text == text and out.outputs[0].stop_reason == stop


def test_invalid_prompts_raise_like_vllm(llm):
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.generate({"prompt_token_ids": [5] * 200}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_ids": [5]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("Hi", SamplingParams(logit_bias={10_000: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_logprobs_are_the_targets(llm, target_dir):
    """vLLM's prompt_logprobs: None for the first prompt token, then each token's log-probability under the target
    given the tokens before it (its rank and the top alternatives), as a dense forward computes them."""
    import torch

    from peagle.models.attention import DenseAttention
    from peagle.models.loader import load_model

    ids = [(11 * i) % 80 + 5 for i in range(40)]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, n=2),
                       use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    model = load_model(target_dir, dtype="float32")
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention([len(ids)])).hidden
        ref = torch.log_softmax(model.compute_logits(h), -1)[:-1]
    for j, entry in enumerate(plp[1:]):
        tok = ids[j + 1]
        assert tok in entry and 2 <= len(entry) <= 3
        assert math.isclose(entry[tok].logprob, float(ref[j, tok]), abs_tol=1e-4)
        assert entry[tok].rank == int((ref[j] > ref[j, tok]).sum()) + 1
        for rank, t in enumerate(ref[j].topk(2).indices.tolist(), 1):
            assert entry[t].rank == rank and math.isclose(entry[t].logprob, float(ref[j, t]), abs_tol=1e-4)
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are what the model reads (prompt_token_ids), with
    the output of sending only them; a prompt longer than the context fits once cut; -1 keeps max_model_len."""
    ids = [(7 * i) % 90 + 5 for i in range(200)]  # longer than max_model_len (128)
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=30, **greedy),
                       use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": ids[-30:]}, SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-30:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    short = llm.generate({"prompt_token_ids": ids[:10]}, SamplingParams(truncate_prompt_tokens=30, **greedy),
                         use_tqdm=False)[0]
    assert short.prompt_token_ids == ids[:10]
    with pytest.raises(ValueError, match="longer than the maximum model length"):  # 128 tokens leave no room
        llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, name", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"max_model_len": 4096}, "max_model_len"),
])
def test_unimplemented_llm_options_are_refused(target_dir, kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM(model=target_dir, **kwargs)


def test_unknown_llm_option_names_itself(target_dir):
    with pytest.raises(TypeError, match="quantization"):
        LLM(model=target_dir, quantization="awq")


@pytest.mark.parametrize("kwargs, name", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"bad_words": [""]}, "bad_words"),
    ({"guided_decoding": {"json": {}, "regex": "a+"}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ({"logits_processors": [print]}, "logits_processors"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"n": 0}, "n"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens"),
])
def test_sampling_params_refusals_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        SamplingParams(**kwargs)
    with pytest.raises(TypeError, match="use_beam_search"):
        SamplingParams(use_beam_search=True)


def test_min_p_keeps_only_likely_tokens(llm):
    # min_p = 1 keeps just the most likely token, so sampling at any temperature is greedy decoding.
    greedy = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    hot = llm.generate("Hello", SamplingParams(temperature=1.5, min_p=1.0, max_tokens=10, ignore_eos=True, seed=3),
                       use_tqdm=False)
    assert hot[0].token_ids == greedy[0].token_ids


def test_chat_with_tools_needs_a_template_that_renders_them(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="tools"):
        llm.chat([{"role": "user", "content": "Hi"}], tools=[{"type": "function", "function": {"name": "f"}}])


def test_chat_takes_a_template_for_the_call(llm, tmp_path):
    messages = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    for given in (template, str(tmp_path / "t.jinja")):
        out = llm.chat(messages, params, use_tqdm=False, chat_template=given)
        assert out[0].prompt_token_ids == llm.get_tokenizer().encode("<user>Hi")
    own = llm.chat(messages, params, use_tqdm=False)  # the model's own template is untouched
    assert own[0].prompt_token_ids != out[0].prompt_token_ids
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        llm.chat(messages, params, chat_template="{% if %}")


def test_chat_continues_the_final_message(llm):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)
    tok = llm.get_tokenizer()
    assert out[0].prompt_token_ids == tok.encode_chat(messages, add_generation_prompt=False,
                                                      continue_final_message=True)
    assert tok.decode(out[0].prompt_token_ids).endswith("Hello, I am")


def test_default_sampling_params_come_from_the_generation_config(target_dir, tmp_path):
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(target_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": 3}))
    llm = LLM(model=str(model), max_model_len=64, max_num_seqs=2)
    assert (llm.get_default_sampling_params().temperature, llm.get_default_sampling_params().max_tokens) == (0.0, 3)
    out = llm.generate("Hello", use_tqdm=False)[0]  # no sampling_params: the model's defaults
    assert len(out.token_ids) <= 3
    assert out.token_ids == llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].token_ids
    ignored = LLM(model=str(model), max_model_len=64, max_num_seqs=2, generation_config="vllm")
    assert ignored.get_default_sampling_params() == SamplingParams()
