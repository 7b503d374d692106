import json

import pytest

from peagle.datasets import (
    HUMANEVAL_TEMPLATE,
    Prompt,
    load_prompts,
    longcode_records,
    read_sharegpt,
    sharegpt_file,
    sharegpt_prompts,
    sharegpt_split_of,
)


def test_mtbench_has_80_first_turns():
    prompts = load_prompts("mtbench")
    assert len(prompts) == 80
    assert len({p.id for p in prompts}) == 80
    assert all(len(p.messages) == 1 and p.messages[0]["role"] == "user" for p in prompts)
    assert prompts[0].messages[0]["content"].startswith("Compose an engaging travel blog post")


def test_humaneval_has_164_wrapped_problems():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    text = prompts[0].messages[0]["content"]
    assert text.startswith("Complete the following Python function:\n```python\n")
    assert "def has_close_elements" in text and text.endswith("```")
    assert HUMANEVAL_TEMPLATE.format(prompt="x\n") == "Complete the following Python function:\n```python\nx\n```"


def test_completions_give_one_text_each_and_humaneval_as_its_code(tmp_path):
    """For a base model: HumanEval's problems unwrapped (the body is the continuation), MT-Bench's questions as they
    are; a chat of several messages is refused."""
    code = load_prompts("humaneval", completions=True, limit=3)
    assert code[0].id == "HumanEval/0" and code[0].text.startswith("from typing import List\n\n\ndef has_close_")
    assert code[0].text.endswith('"""\n') and "```" not in code[0].text and "Complete the" not in code[0].text
    assert [p.text for p in load_prompts("mtbench", completions=True, limit=2)] == [
        p.messages[0]["content"] for p in load_prompts("mtbench", limit=2)]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "hi"}]}) + "\n")
    assert load_prompts(str(path))[0].messages[-1]["content"] == "hi"
    with pytest.raises(ValueError, match=r"chat of 2 messages \(system, user\).*leave out --completions"):
        load_prompts(str(path), completions=True)


def test_longcode_prompt_lengths_in_range():
    records = longcode_records()
    assert len(records) == 32
    for r in records:
        assert 2048 <= r["num_tokens"] <= 8000, r["id"]
        # The measured token count must describe the stored text (code runs ~3-4.5 characters per token).
        assert 2.5 <= len(r["prompt"]) / r["num_tokens"] <= 5.0, r["id"]
        assert f"`{r['function']}`" in r["prompt"] and r["source"].startswith("cpython-")
    assert len(load_prompts("longcode", limit=5)) == 5


def test_benchmark_sets_refuse_a_train_split():
    with pytest.raises(ValueError, match="no train split"):
        load_prompts("mtbench", split="train")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_prompts("nosuchset")


def test_jsonl_prompts_and_messages(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"prompt": "hello"},
        {"id": "x", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    prompts = load_prompts(str(path))
    assert prompts[0] == Prompt.user("mine-1", "hello")
    assert prompts[1].id == "x" and prompts[1].messages[-1]["content"] == "hi"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    with pytest.raises(ValueError, match="must end with a user message"):
        load_prompts(str(path))
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="mine.jsonl:1"):
        load_prompts(str(path))
    with pytest.raises(FileNotFoundError):
        load_prompts(str(tmp_path / "missing.jsonl"))


def _conversation(cid: str, human: str) -> dict:
    return {"id": cid, "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": "answer é"}]}


def test_truncated_sharegpt_keeps_every_complete_record(tmp_path):
    records = [_conversation(f"c{i}_0", f"question {i} \u00e9\u4e2d") for i in range(50)]
    full = json.dumps(records, indent=2, ensure_ascii=False).encode("utf-8")
    path = tmp_path / "ShareGPT.json"
    # Cut inside record 41, in the middle of a multi-byte character: the packaged file ends like this.
    cut = full.index("question 41 \u00e9".encode()) + len("question 41 ".encode()) + 1
    path.write_bytes(full[:cut])
    decoded = read_sharegpt(path)
    assert decoded == records[:41]
    path.write_bytes(full)
    assert read_sharegpt(path) == records


def test_sharegpt_split_is_deterministic_and_disjoint(tmp_path):
    records = [_conversation(f"id{i}_{part}", f"q{i}") for i in range(400) for part in (0, 1)]
    test, train = sharegpt_prompts(records, "test"), sharegpt_prompts(records, "train")
    assert len(test) + len(train) == len(records)
    assert 0 < len(test) < len(train) / 5
    assert not {p.id for p in test} & {p.id for p in train}
    # Parts of one conversation share a split, so a held-out chat never leaks into training through its sibling.
    assert all(sharegpt_split_of(f"id{i}_0") == sharegpt_split_of(f"id{i}_1") for i in range(400))
    path = sharegpt_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(records))
    assert load_prompts("sharegpt", cache_dir=tmp_path) == test
    assert load_prompts("sharegpt", split="train", cache_dir=tmp_path, limit=3) == train[:3]


def test_sharegpt_missing_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="peagle testbed"):
        load_prompts("sharegpt", cache_dir=tmp_path)


def test_unit_tests_never_read_the_users_cache(monkeypatch):
    # The README runs `peagle quickstart` (filling ~/.cache/peagle/testbed) before the tests: a cached ShareGPT file
    # there made held-out prompts of a test's own data. Each test sees an empty cache and home of its own.
    import os
    from pathlib import Path

    from peagle.datasets import default_cache_dir, sharegpt_file

    for name in ("PEAGLE_CACHE", "HOME", "XDG_CACHE_HOME", "HF_HOME"):
        assert "user-paths" in os.environ[name] and not any(Path(os.environ[name]).iterdir())
    assert not sharegpt_file(default_cache_dir()).exists()
    monkeypatch.delenv("PEAGLE_CACHE")
    assert str(default_cache_dir()).startswith(os.environ["HOME"])
