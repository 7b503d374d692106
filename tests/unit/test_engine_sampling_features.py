"""Sampling features under speculation: penalties, logit_bias, min_tokens, allowed ids and logprobs are computed per
verified row with the drafts before it as history, so speculative greedy output equals plain greedy output (fp32)
with them on, and logprobs are the target's at every emitted token, accepted drafts included."""

from __future__ import annotations

import json
import math

import pytest
import torch
from engine_helpers import cpu_llm, heads, spec_config, target_dir  # noqa: F401 (fixtures)

from peagle import SamplingParams
from peagle.engine.sampler import LogitsProcessing, bad_word_bans, process_logits
from peagle.engine.sampling_params import with_bad_words
from peagle.engine.structured_output import with_grammar
from peagle.models.attention import DenseAttention
from peagle.models.loader import load_model

PROMPTS = [[7, 20, 31, 40], [9, 15], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30]]
EOS = 2


def make_llm(target_dir, head=None, method="peagle", k=3):
    # Synchronous: the oracle drafts below replace the answers of `runner.execute`, the synchronous step (async
    # scheduling commits each step through `launch` instead, and runs requests with processing without launching
    # ahead).
    return cpu_llm(target_dir, spec_config(head, k, method == "peagle"), max_num_seqs=4, async_scheduling=False)


@pytest.fixture(scope="module")
def plain(target_dir):
    return make_llm(target_dir)


PROCESSED = [
    dict(repetition_penalty=1.3, frequency_penalty=0.4),
    dict(presence_penalty=1.5, logit_bias={17: 3.0, 40: -100}),
    dict(min_tokens=20, frequency_penalty=0.2, ignore_eos=False),
    dict(allowed_token_ids=list(range(5, 60)), repetition_penalty=0.8),
]


def processed_params(**kw):
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, max_tokens=24, **kw)


def reference_processed(model, prompt, p: SamplingParams, eos=frozenset({EOS, 0})) -> list[int]:
    """Plain greedy decoding with vLLM's logits processing written out directly, one token at a time."""
    ids, out = list(prompt), []
    for _ in range(p.max_tokens):
        h = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention([len(ids)])).hidden
        logits = model.compute_logits(h[-1:])[0].clone()
        if p.allowed_token_ids is not None:
            keep = torch.full_like(logits, float("-inf"))
            keep[p.allowed_token_ids] = 0
            logits += keep
        for t, v in (p.logit_bias or {}).items():
            logits[t] += v
        if len(out) < p.min_tokens:
            logits[list(set(p.stop_token_ids) | (set() if p.ignore_eos else eos))] = float("-inf")
        for w in p.bad_words_token_ids or []:  # vLLM's bad words: over the output so far
            if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]:
                logits[w[-1]] = float("-inf")
        for t in set(ids):
            if logits[t] > 0:
                logits[t] /= p.repetition_penalty
            else:
                logits[t] *= p.repetition_penalty
        for t in set(out):
            logits[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
        tok = int(logits.argmax())
        ids.append(tok)
        out.append(tok)
        if not p.ignore_eos and tok in eos:
            break
    return out


def test_processing_changes_plain_output_as_written(target_dir, plain):
    model = load_model(target_dir, dtype="float32")
    params = [processed_params(**kw) for kw in PROCESSED]
    outs = plain.generate(PROMPTS, params, use_tqdm=False)
    unprocessed = plain.generate(PROMPTS, processed_params(), use_tqdm=False)
    with torch.inference_mode():
        for prompt, p, out in zip(PROMPTS, params, outs):
            assert out.outputs[0].token_ids == reference_processed(model, prompt, p)
    assert any(a.token_ids != b.token_ids for a, b in zip(outs, unprocessed))
    assert 40 not in outs[1].token_ids and all(5 <= t < 60 for t in outs[3].token_ids)
    assert len(outs[2].token_ids) >= 20


def oracle_drafts(llm, continuations: dict[str, list[int]], k: int, corrupt_every: int = 3):
    """Makes the engine verify the true processed continuation as its drafts, one in `corrupt_every` rounds with a
    wrong draft, so rounds accept 0..K drafts and every verified row's processing is exercised."""
    real_execute = llm.engine.runner.execute
    rounds = iter(range(10 ** 6))

    def execute(seqs, drafts, st, draft=True, **kw):
        result = real_execute(seqs, drafts, st, draft, **kw)
        for i, seq in enumerate(seqs):
            full = continuations[seq.seq_id]
            oracle = (full[seq.num_tokens + len(result.output_tokens[i]):] + [0] * k)[:k]
            r = next(rounds)
            if r % corrupt_every == 0:
                oracle[r % k] = (oracle[r % k] + 1) % 300
            result.drafts[i] = oracle
        return result

    llm.engine.runner.execute = execute


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_speculative_greedy_equals_plain_greedy_with_processing(target_dir, heads, plain, method):
    params = [processed_params(**kw) for kw in PROCESSED]
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(target_dir, heads[method], method, k=3)
    oracle_drafts(llm, {str(i): p + w.token_ids for i, (p, w) in enumerate(zip(PROMPTS, want))}, k=3)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids
    # Every request had rounds accepting the last draft position, so rows 1..K decided tokens.
    assert all(len(o.metrics.accepted_per_position) == 3 and o.metrics.accepted_per_position[2] > 0 for o in got)


def test_row_history_counts_the_drafts_before_it():
    # One request, K = 2 drafts [5, 5]: row j has seen the output [3] plus drafts 0..j-1.
    v = 8
    logits = torch.zeros(3, v)
    proc = LogitsProcessing(torch.tensor([0]), None, None, None, torch.zeros(1, v).index_fill_(1, torch.tensor([3]), 1),
                            torch.zeros(1, v, dtype=torch.bool), torch.tensor([0.0]), torch.tensor([1.0]),
                            torch.tensor([1.0]))
    out = process_logits(logits, proc, torch.tensor([[5, 5]]), torch.tensor([2]), 3)
    assert out[:, 3].tolist() == [-1.0, -1.0, -1.0]
    assert out[:, 5].tolist() == [0.0, -1.0, -2.0]


def test_bad_word_bans_follow_each_rows_history():
    words = [[7], [4, 5], [4, 5, 6]]
    # outputs [1, 4], drafts [5, 4, 5]: row j follows the outputs and drafts 0..j-1
    assert bad_word_bans(words, [1, 4], [5, 4, 5], 4) == [[7, 5], [7, 6], [7, 5], [7, 6]]
    assert bad_word_bans(words, [], [], 1) == [[7]]  # a longer word needs its first tokens in the output
    assert bad_word_bans(None, [1], [2], 2) == [[], []]


def _holds(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_are_never_completed_and_speculation_keeps_them(target_dir, heads, plain):
    """Words taken from the unconstrained output (so the ban changes it) are never completed; the output equals
    greedy decoding with the bans written out, and speculative output equals it (EAGLE-3 and P-EAGLE)."""
    free = plain.generate([PROMPTS[0]], processed_params(), use_tqdm=False)[0].outputs[0].token_ids
    tokenizer = plain.engine.tokenizer
    words = [tokenizer.decode(free[2:3]), tokenizer.decode(free[6:8])]
    params = with_bad_words(processed_params(bad_words=words), tokenizer, plain.engine.model_config.vocab_size)
    banned = params.bad_words_token_ids
    assert banned and any(_holds(free, w) for w in banned), (words, banned)
    want = plain.generate([PROMPTS[0]], processed_params(bad_words=words), use_tqdm=False)[0].outputs[0].token_ids
    with torch.inference_mode():
        assert want == reference_processed(load_model(target_dir, dtype="float32"), PROMPTS[0], params)
    assert want != free and not any(_holds(want, w) for w in banned)
    for method in ("eagle3", "peagle"):
        llm = make_llm(target_dir, heads[method], method, k=3)
        oracle_drafts(llm, {"0": list(PROMPTS[0]) + want}, k=3)
        got = llm.generate([PROMPTS[0]], processed_params(bad_words=words), use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want, method
        assert got.metrics.accepted_per_position[2] > 0  # rows past the first decided tokens


def test_bad_words_are_checked():
    with pytest.raises(ValueError, match="^bad_words"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="^bad_words"):
        SamplingParams(bad_words="word")
    with pytest.raises(ValueError, match="tokenizer"):
        with_bad_words(SamplingParams(bad_words=["x"]), None, 10)


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_logprobs_are_the_targets_at_every_emitted_token(target_dir, heads, plain, method):
    llm = make_llm(target_dir, heads[method], method, k=3)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, presence_penalty=0.5)
    out = llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == plain.generate([PROMPTS[0]], p, use_tqdm=False)[0].token_ids
    assert len(out.logprobs) == len(out.token_ids)
    model = load_model(target_dir, dtype="float32")
    ids = list(PROMPTS[0]) + out.token_ids
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention([len(ids)])).hidden
        ref = torch.log_softmax(model.compute_logits(h), -1)[len(PROMPTS[0]) - 1:-1]  # [n, V]
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok in entry and 3 <= len(entry) <= 4
        assert math.isclose(entry[tok].logprob, float(ref[j, tok]), abs_tol=1e-4)
        assert entry[tok].rank == int((ref[j] > ref[j, tok]).sum()) + 1
        top = ref[j].topk(3)
        for rank, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert math.isclose(entry[t].logprob, lp, abs_tol=1e-4) and entry[t].rank == rank
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 99}, "tag": {"enum": ["red", "green", "blue"]}}, "required": ["ok", "n", "tag"],
          "additionalProperties": False}


def check_schema(text: str):
    obj = json.loads(text)
    assert set(obj) == {"ok", "n", "tag"} and isinstance(obj["ok"], bool)
    assert isinstance(obj["n"], int) and 0 <= obj["n"] <= 99 and obj["tag"] in ("red", "green", "blue")


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_json_schema_output_validates_and_speculation_keeps_it(target_dir, heads, plain, method):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMA}, repetition_penalty=1.2)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    for out in want:
        check_schema(out.outputs[0].text)
        assert out.finish_reason == "stop"  # the grammar, once complete, leaves only EOS
    llm = make_llm(target_dir, heads[method], method, k=3)
    # The oracle's corrupted drafts are mostly outside the grammar: each is rejected at its own row.
    oracle_drafts(llm, {str(i): p + w.token_ids for i, (p, w) in enumerate(zip(PROMPTS, want))}, k=3)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert sum(g.metrics.num_accepted_tokens for g in got) > 0


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_grammar_after_a_token_leaves_the_output_free_until_it(target_dir, heads, plain, method):
    # A reasoning parser's structured output: free text (the thinking) up to its end token, the schema after it.
    # The logit bias makes the end token come early on every prompt; the grammar masks it out afterwards.
    end, bias = 3, {3: 3.0}
    free = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, logit_bias=bias), use_tqdm=False)
    params = with_grammar(SamplingParams(temperature=0, max_tokens=60, logit_bias=bias, structured_outputs={
        "json": SCHEMA}), plain.engine.tokenizer, plain.engine.model_config.vocab_size, starts_after=end)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    for w, f in zip(want, free):
        i = w.token_ids.index(end)
        assert w.token_ids[:i + 1] == f.token_ids[:i + 1]  # unconstrained until the end token
        check_schema(plain.engine.tokenizer.decode(w.token_ids[i + 1:]))
        assert w.token_ids != f.token_ids and w.finish_reason == "stop"
    llm = make_llm(target_dir, heads[method], method, k=3)
    # The oracle's drafts hold the end token at every row of some step: the grammar starts mid-step there.
    oracle_drafts(llm, {str(i): p + w.token_ids for i, (p, w) in enumerate(zip(PROMPTS, want))}, k=3)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert sum(g.metrics.num_accepted_tokens for g in got) > 0


def test_choice_and_regex_constrain_sampled_output(plain):
    choice = SamplingParams(temperature=1.0, seed=5, max_tokens=10, guided_decoding={"choice": ["yes", "no"]})
    regex = SamplingParams(temperature=1.0, seed=5, max_tokens=10, structured_outputs={"regex": "[0-9]{3}"})
    outs = plain.generate([PROMPTS[0], PROMPTS[1]], [choice, regex], use_tqdm=False)
    assert outs[0].text in ("yes", "no")
    assert len(outs[1].text) == 3 and outs[1].text.isdigit()


def test_invalid_grammar_is_refused(plain):
    with pytest.raises(ValueError, match="structured_outputs"):
        plain.generate("Hi", SamplingParams(structured_outputs={"json": {"type": "objectx"}}), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"json": {}, "regex": "a"})
