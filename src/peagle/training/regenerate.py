"""Response regeneration: the target answers chat prompts itself, so the drafter learns the target's own outputs.

Prompts come from JSON Lines (`{"messages": [...]}` or `{"prompt": "..."}` per line, optionally gzip-compressed as
.gz) or a ShareGPT JSON file (a list of `{"id": ..., "conversations": [{"from": "human" | "gpt", "value": ...}]}`;
a truncated file is read up to its last complete record, and only the train split is used: see
peagle.datasets). Single-turn (the default): each prompt's messages up to its last user turn are the context
and the target writes one answer; ShareGPT gives its first human turn. Multi-turn (`multi_turn=True`): every user
turn is answered in order, each in the context of the target's OWN earlier answers (the recorded ones are dropped),
and the whole chat is one document whose loss mask covers exactly the target-written tokens. Completions
(`completions=True`, for a base model, which has no chat template and answers no chat): each user turn of a record
(at most `max_turns` of them) is a prompt of its own, raw text that the target continues; one document per prompt,
the loss on the continuation.

Throughput: all prompts stream through one engine whose batch is kept full (`Feeder`): requests are added in waves
whenever the batch falls below 7/8 of `max_num_seqs`, so prompt prefills bunch into few eager steps while the rest
are CUDA-graph decode steps, and no batch waits for its slowest answer. Every `batch_size` prompts become one
shard, written by a background thread in prompt order; the manifest lists finished shards, so an interrupted run
continues where it stopped.

Benchmark prompts never enter training data: a prompt file that overlaps a built-in benchmark set is refused (see
data_sources.BenchmarkGuard).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from tqdm import tqdm

from peagle.datasets import sharegpt_split_of
from peagle.models.config import ModelConfig
from peagle.models.loader import load_tokenizer
from peagle.models.tokenizer import Message, Tokenizer
from peagle.training.data import Document, Manifest, tokenizer_fingerprint, write_shard
from peagle.training.data_sources import BenchmarkGuard, open_text

logger = logging.getLogger(__name__)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# The batch is refilled when it falls below this share of max_num_seqs (see Feeder).
REFILL_BELOW = 7 / 8
# Tokens per prefill step: a refill wave of prompts prefills in one or two steps.
PREFILL_TOKENS = 32768

Record = tuple[str | None, list[Message]]  # (id, messages)


# ---- prompt files ----

def read_prompts(path: str | Path, multi_turn: bool = False) -> list[list[Message]]:
    """Conversations to answer: each ends with a user turn (multi-turn: system and user turns only)."""
    return [messages for _, messages in read_records(path, multi_turn)]


def read_records(path: str | Path, multi_turn: bool = False) -> list[Record]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    with open_text(path) as f:
        text = f.read()
    sharegpt = text.lstrip().startswith("[")
    records = _json_array_records(text, path) if sharegpt else _jsonl_records(text, path)
    if sharegpt:
        records = _train_split(records, path)
    convert = _to_turns if multi_turn else _to_messages
    prompts = [(_record_id(r), m) for r in records if (m := convert(r))]
    if not prompts:
        raise ValueError(f"{path} holds no usable prompts (JSON Lines with messages/prompt, or ShareGPT JSON)")
    return prompts


def _record_id(record: Any) -> str | None:
    """The record's id; a ShareGPT-shaped record's as `sharegpt-ID`, the form the held-out check reads."""
    if not isinstance(record, dict) or record.get("id") is None:
        return None
    return f"sharegpt-{record['id']}" if "conversations" in record else str(record["id"])


def _train_split(records: Iterator[dict], path: Path) -> Iterator[dict]:
    """A ShareGPT file's train split: its held-out conversations are benchmark prompts."""
    held_out = 0
    for record in records:
        if isinstance(record, dict) and "id" in record and sharegpt_split_of(str(record["id"])) == "test":
            held_out += 1
            continue
        yield record
    logger.info("%s: left out %d conversations of the held-out split", path.name, held_out)


def _jsonl_records(text: str, path: Path) -> Iterator[dict]:
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None


def _json_array_records(text: str, path: Path) -> Iterator[dict]:
    """Records of a JSON array one at a time, stopping quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    pos, count = text.index("[") + 1, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            logger.warning("%s is truncated after %d complete records; using those", path, count)
            return
        count += 1
        yield record


def _to_messages(record: Any) -> list[Message] | None:
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record["prompt"]}]
    if isinstance(record.get("messages"), list):
        messages = [m for m in record["messages"] if isinstance(m, dict) and m.get("role") in ROLES.values()]
        while messages and messages[-1]["role"] != "user":
            messages.pop()  # the target writes the answer itself
        return messages or None
    if isinstance(record.get("conversations"), list):
        first = next((t for t in record["conversations"]
                      if isinstance(t, dict) and t.get("from") == "human" and isinstance(t.get("value"), str)
                      and t["value"].strip()), None)
        return [{"role": "user", "content": first["value"]}] if first else None
    return None


def _to_turns(record: Any) -> list[Message] | None:
    """A leading system turn (if any) and every non-empty user turn; recorded answers are dropped."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("prompt"), str):
        turns = [{"role": "user", "content": record["prompt"]}]
    elif isinstance(record.get("messages"), list):
        turns = [{"role": m["role"], "content": m["content"]} for m in record["messages"]
                 if isinstance(m, dict) and m.get("role") in ("system", "user") and isinstance(m.get("content"), str)]
    elif isinstance(record.get("conversations"), list):
        turns = [{"role": ROLES[t["from"]], "content": t["value"]} for t in record["conversations"]
                 if isinstance(t, dict) and ROLES.get(t.get("from")) in ("system", "user")
                 and isinstance(t.get("value"), str)]
    else:
        return None
    system = turns[:1] if turns and turns[0]["role"] == "system" else []
    users = [t for t in turns if t["role"] == "user" and t["content"].strip()]
    return system + users if users else None


# ---- the engine loop ----

class Feeder:
    """Drives an LLMEngine with a full batch: requests join in waves, finished ones may ask for a follow-up.

    Adding a request as soon as a slot frees would make nearly every step a mixed prefill + decode step, which
    runs eagerly (no CUDA graph) and costs several graph-replayed decode steps on a slow host. Refilling only when
    the batch has fallen below REFILL_BELOW of `max_num_seqs` keeps the batch nearly full and prefills a whole
    wave at once.
    """

    def __init__(self, engine, max_num_seqs: int, stop: Callable[[], bool] = lambda: False):
        self.engine = engine
        self.capacity = max_num_seqs
        self.low = max(1, int(max_num_seqs * REFILL_BELOW))
        self.stop = stop  # checked every step: True abandons the requests still running
        self._ids = itertools.count()

    def run(self, requests: Iterator[tuple[Any, list[int], Any]],
            finished: Callable[[Any, list[int], str | None], tuple[Any, list[int], Any] | None]) -> None:
        """Generate for every (key, prompt ids, SamplingParams) of `requests`.

        `finished(key, output ids, finish reason)` runs once per request and returns a follow-up request or None;
        follow-ups are added before new requests.
        """
        follow_ups: deque = deque()
        live: dict[str, tuple[Any, Any]] = {}  # engine request id -> (key, the engine's Sequence)
        engine = self.engine
        while True:
            if len(live) < self.low:
                while len(live) < self.capacity:
                    request = follow_ups.popleft() if follow_ups else next(requests, None)
                    if request is None:
                        break
                    key, prompt, params = request
                    rid = str(next(self._ids))
                    live[rid] = (key, engine.add_request(rid, prompt, params))
            if not live or self.stop():
                return
            # Per step only the finished requests cost Python work here: their tokens are read once, at the end.
            for out in engine.step():
                if out.finished:
                    key, seq = live.pop(out.request_id)
                    if out.error:
                        logger.warning("request %s failed: %s", key, out.error)
                    tokens = [] if out.error else seq.token_ids[seq.num_prompt_tokens:]
                    follow_up = finished(key, tokens, out.finish_reason)
                    if follow_up is not None:
                        follow_ups.append(follow_up)


def make_engine(model: Path, *, speculative_config: dict | None, dtype: str, device: str | None,
                max_model_len: int, max_num_seqs: int, seed: int = 0, num_kv_blocks: int | None = None,
                gpu_memory_utilization: float = 0.9, async_scheduling: bool = True, prefill_cuda_graphs: bool = True):
    from peagle import LLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    k = int((speculative_config or {}).get("num_speculative_tokens", 0))
    llm = LLM(model=str(model), speculative_config=speculative_config, dtype=dtype, device=device,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed, num_kv_blocks=num_kv_blocks,
              gpu_memory_utilization=gpu_memory_utilization, async_scheduling=async_scheduling,
              prefill_cuda_graphs=prefill_cuda_graphs,
              max_num_batched_tokens=max(max_model_len, PREFILL_TOKENS, max_num_seqs * (k + 1)))
    return llm.engine


# ---- conversations ----

@dataclass(slots=True)
class _Chat:
    """One conversation being regenerated: the document so far and the turns still to answer."""

    messages: list[Message]  # context messages: system?, then user / assistant pairs so far
    pending: list[Message]  # user turns not yet asked
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    answers: int = 0


class ChatTurns:
    """Builds each turn's prompt ids from the document so far, so the target's own answer tokens stay as written.

    Turn t's prompt is the document (turns 1..t-1 with the target's answer tokens) followed by the chat template's
    text between the end of answer t-1 and the start of answer t (closing the assistant turn unless the target's
    own end-of-turn token already did, then the user turn and the assistant prefix).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.eos_text = {i: tokenizer.id_to_token(i) for i in tokenizer.eos_token_ids}

    def answered(self, chat: _Chat, prompt: list[int], answer: list[int]) -> None:
        chat.loss_mask += [False] * (len(prompt) - len(chat.token_ids)) + [True] * len(answer)
        chat.token_ids = prompt + answer
        chat.answers += 1
        if chat.pending:  # only a later turn needs the answer as text
            chat.messages.append({"role": "assistant", "content": self.tokenizer.decode(answer)})

    def next_prompt(self, chat: _Chat) -> list[int] | None:
        """The next turn's prompt ids, or None when the template does not show the turns verbatim."""
        user = chat.pending.pop(0)
        answer = chat.messages[-1]["content"]
        chat.messages.append(user)
        text = self.tokenizer.apply_chat_template(chat.messages)
        user_at = _span(text, user["content"], len(text))
        answer_at = _span(text, answer, user_at[0]) if user_at else None
        if answer_at is None:
            return None
        tail = text[answer_at[1]:]
        eos = self.eos_text.get(chat.token_ids[-1])
        if eos and tail.startswith(eos):
            tail = tail[len(eos):]  # the target closed its turn itself
        return chat.token_ids + self.tokenizer.encode(tail)

    @staticmethod
    def document(chat: _Chat) -> tuple[list[int], list[bool]] | None:
        return (chat.token_ids, chat.loss_mask) if chat.answers else None


def _span(text: str, needle: str, end: int) -> tuple[int, int] | None:
    """The last occurrence of `needle` in text[:end] (as written, else stripped: some templates trim turns)."""
    for n in dict.fromkeys((needle, needle.strip())):
        i = text.rfind(n, 0, end) if n else -1
        if i >= 0:
            return i, i + len(n)
    return None


# ---- shards ----

class _ShardWriter:
    """Collects finished documents per shard of `batch_size` prompts and writes complete shards in prompt order,
    on a background thread (the manifest is only touched there)."""

    def __init__(self, out: Path, manifest: Manifest, start: int, total: int, batch_size: int, progress):
        self.out, self.manifest, self.start, self.batch_size = out, manifest, start, batch_size
        self.sizes = [min(batch_size, total - first) for first in range(start, total, batch_size)]
        self.docs: list[dict[int, tuple]] = [{} for _ in self.sizes]
        self.done = [0] * len(self.sizes)
        self.next = 0  # first shard not yet handed to the thread
        self.progress = progress
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self.futures: list[Future] = []

    def finish(self, index: int, document: tuple[list[int], list[bool]] | None, turns: int = 1) -> None:
        shard = (index - self.start) // self.batch_size
        if document is not None:
            self.docs[shard][index] = (*document, turns)
        self.done[shard] += 1
        self.progress.update(1)
        while self.next < len(self.sizes) and self.done[self.next] == self.sizes[self.next]:
            first = self.start + self.next * self.batch_size
            docs = [self.docs[self.next][i] for i in sorted(self.docs[self.next])]
            self.futures.append(self.pool.submit(self._write, first, self.sizes[self.next], docs))
            self.docs[self.next] = {}
            self.next += 1
        for f in [f for f in self.futures if f.done()]:
            f.result()  # raise a write error here rather than at the end
            self.futures.remove(f)

    def _write(self, first: int, num_prompts: int, docs: list[tuple]) -> None:
        documents = [Document(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool))
                     for ids, mask, _ in docs]
        name = f"shard-{len(self.manifest.shards):05d}.safetensors"
        if documents:
            write_shard(self.out / name, documents)
        entry = {"file": name if documents else None, "first_prompt": first, "num_prompts": num_prompts,
                 "num_documents": len(documents), "num_tokens": sum(len(d) for d in documents),
                 "num_answers": sum(t for _, _, t in docs)}
        self.manifest.shards.append(entry)
        self.manifest.write(self.out)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for f in self.futures:
            f.result()


# ---- regenerate ----

def regenerate(
    model: str | Path,
    prompts: str | Path,
    out: str | Path,
    *,
    max_tokens: int = 1024,
    batch_size: int = 256,
    limit: int | None = None,
    speculative_config: dict | None = None,
    dtype: str = "bfloat16",
    device: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 512,
    multi_turn: bool = False,
    max_turns: int | None = None,
    exclude_overlap: bool = False,
    part: tuple[int, int] | None = None,
    num_kv_blocks: int | None = None,
    gpu_memory_utilization: float = 0.9,
    async_scheduling: bool = True,
    prefill_cuda_graphs: bool = True,
    eval_set: bool = False,
    completions: bool = False,
) -> Manifest:
    """Answers the prompts with the target and writes shards + manifest to `out`; resumes a previous run there.

    `part=(i, n)` answers only the i-th of n equal contiguous parts of the prompts (0-based), so that n processes
    can share one GPU (each its own --out; `peagle train --data` mixes the directories). The engine's per-step
    host work grows with the batch, so on a host slower than the GPU several processes finish sooner than one
    with a larger batch; give each a fixed --num-kv-blocks, as a second engine cannot measure free memory fairly.

    `eval_set=True` writes an evaluation set for `peagle train --eval-data`: ShareGPT's held-out prompts are
    allowed (benchmark prompts are not), and the manifest says `evaluation_only`, which `peagle train --data`
    refuses.

    `completions=True` continues raw text instead of answering chats (a base model's data: it has no chat template):
    each user turn of a record, up to `max_turns` of them, is a prompt of its own, tokenized as the model's tokenizer
    does plain text (its BOS included).
    """
    if max_tokens < 1 or batch_size < 1 or max_num_seqs < 1:
        raise ValueError(f"--max-tokens, --batch-size and --max-num-seqs must be positive, got {max_tokens}, "
                         f"{batch_size} and {max_num_seqs}")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"--max-turns must be positive, got {max_turns}")
    if part is not None and not 0 <= part[0] < part[1]:
        raise ValueError(f"--part I/N needs 0 <= I < N, got {part[0]}/{part[1]}")
    if completions and multi_turn:
        raise ValueError("--completions continues each user turn as raw text, a prompt of its own: there is no chat "
                         "to answer turn by turn; drop --multi-turn")
    model, out = Path(model), Path(out)
    tokenizer = load_tokenizer(model)
    if not completions and not tokenizer.chat_template:
        raise ValueError(f"{model} has no chat template (a base model?): give --completions to let it continue the "
                         "prompts as raw text")
    records = read_records(prompts, multi_turn or completions)
    keep = BenchmarkGuard.builtin().check(
        [(rid, [m["content"] for m in messages if m["role"] == "user"]) for rid, messages in records],
        str(prompts), drop=exclude_overlap, allow_held_out=eval_set)
    conversations = [records[i][1] for i in keep][:limit]
    source = {"prompts": Path(prompts).name, "max_tokens": max_tokens}
    if eval_set:
        source["evaluation_only"] = True
    if multi_turn:
        source.update(multi_turn=True, max_turns=max_turns)
    if completions:
        texts = completion_prompts(conversations, max_turns)
        source.update(completions=True, max_turns=max_turns)
        logger.info("completions: %d prompts, each user turn of %d records (at most %s a record), continued as raw "
                    "text without a chat template; the loss on the continuation", len(texts), len(conversations),
                    max_turns or "all")
        conversations = texts
    if part is not None:
        i, n = part
        conversations = conversations[i * len(conversations) // n:(i + 1) * len(conversations) // n]
        source["part"] = f"{i}/{n}"
    manifest = _open_manifest(out, model, tokenizer, source)
    start = manifest.prompts_done
    if start >= len(conversations):
        logger.info("all %d prompts are already answered in %s", len(conversations), out)
        return manifest
    max_model_len = max_model_len or ModelConfig.from_dir(model).max_position_embeddings
    engine = make_engine(model, speculative_config=speculative_config, dtype=dtype, device=device,
                         max_model_len=max_model_len, max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks,
                         gpu_memory_utilization=gpu_memory_utilization, async_scheduling=async_scheduling,
                         prefill_cuda_graphs=prefill_cuda_graphs)
    progress = tqdm(total=len(conversations), initial=start, desc="regenerating", unit=" prompts",
                    disable=None)
    writer = _ShardWriter(out, manifest, start, len(conversations), batch_size, progress)
    job = _Regeneration(tokenizer, writer, max_tokens, max_model_len, max_turns, completions)
    began = time.perf_counter()
    with stop_on_sigterm() as stopped:
        try:
            job.run(Feeder(engine, max_num_seqs, stop=lambda: stopped.is_set()), conversations, start, multi_turn)
        finally:
            writer.close()
            progress.close()
    seconds = time.perf_counter() - began
    done = manifest.prompts_done - start
    logger.info("%s: %d prompts in %d shards (%d answers, %d answer tokens in all) in %.1f s after engine "
                "start-up: %.1f prompts/s, %.1f answers/s, %.0f answer tokens/s; %.0f%% of the answer tokens repeat "
                "an earlier 8-gram of their answer (loops)",
                "stopped by SIGTERM; rerun to resume" if stopped.is_set() else "regenerated", done,
                len(manifest.shards), job.answers, job.answer_tokens, seconds, done / seconds,
                job.answers / seconds, job.answer_tokens / seconds,
                100 * job.repeated_tokens / max(job.answer_tokens, 1))
    return manifest


def completion_prompts(conversations: list[list[Message]], max_turns: int | None = None) -> list[list[Message]]:
    """Each user turn (the first `max_turns` of a conversation) as a prompt of its own; system turns dropped.

    >>> completion_prompts([[{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
    ...                      {"role": "user", "content": "b"}]], max_turns=1)
    [[{'role': 'user', 'content': 'a'}]]
    """
    return [[turn] for messages in conversations for turn in [m for m in messages if m["role"] == "user"][:max_turns]]


def repeated_ngrams(ids: Sequence[int], n: int = 8) -> list[bool]:
    """Per token of `ids`: whether its n-gram (ending at it) occurred earlier in `ids`. Inside a degenerate loop,
    every token's does.

    >>> repeated_ngrams([1, 2, 3, 1, 2, 3, 1, 2], n=3)  # 3-grams 123 231 312 123 231 312: the last three repeat
    [False, False, False, False, False, True, True, True]
    """
    seen, flags = set(), [False] * min(n - 1, len(ids))
    for t in range(n - 1, len(ids)):
        gram = tuple(ids[t - n + 1:t + 1])
        flags.append(gram in seen)
        seen.add(gram)
    return flags


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[threading.Event]:
    """SIGTERM (e.g. `timeout`) sets the event instead of killing the process, so finished shards are written."""
    stopped = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Regeneration:
    def __init__(self, tokenizer: Tokenizer, writer: _ShardWriter, max_tokens: int, max_model_len: int,
                 max_turns: int | None, completions: bool = False):
        from peagle import SamplingParams

        self.turns = ChatTurns(tokenizer)
        self.completions = completions  # prompts are raw text (a user turn's content), with the tokenizer's BOS
        self.writer = writer
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.room = max_model_len - max_tokens  # the longest prompt that leaves room for a full answer
        self.max_turns = max_turns
        self.chats: dict[int, tuple[_Chat, list[int]]] = {}
        self.too_long = 0
        self.answers = self.answer_tokens = self.repeated_tokens = 0

    def run(self, feeder: Feeder, conversations: list[list[Message]], start: int, multi_turn: bool) -> None:
        feeder.run(self._requests(conversations, start, multi_turn), self._finished)
        if self.too_long:
            logger.warning("skipped %d prompts longer than %d tokens (max model length - max tokens)",
                           self.too_long, self.room)

    def _requests(self, conversations: list[list[Message]], start: int, multi_turn: bool) -> Iterator[tuple]:
        tokenizer = self.turns.tokenizer
        step = self.writer.batch_size
        for first in range(start, len(conversations), step):
            chats = []
            for messages in conversations[first:first + step]:
                if multi_turn:
                    system = messages[:1] if messages[0]["role"] == "system" else []
                    users = messages[len(system):]
                    later = users[1:] if self.max_turns is None else users[1:self.max_turns]
                    chats.append(_Chat(system + users[:1], list(later)))
                else:
                    chats.append(_Chat(list(messages), []))
            if self.completions:
                texts = [c.messages[-1]["content"] for c in chats]
            else:
                texts = [tokenizer.apply_chat_template(c.messages) for c in chats]
            # One call tokenises the whole shard's prompts on the tokenizer's own threads; a chat template writes
            # its special tokens itself, raw text gets the tokenizer's (a BOS).
            encoded = tokenizer.backend.encode_batch(texts, add_special_tokens=self.completions)
            for i, (chat, enc) in enumerate(zip(chats, encoded), first):
                if len(enc.ids) > self.room:
                    self.too_long += 1
                    self.writer.finish(i, None, 0)
                    continue
                self.chats[i] = (chat, enc.ids)
                yield i, enc.ids, self.params

    def _finished(self, i: int, answer: list[int], reason: str | None) -> tuple | None:
        chat, prompt = self.chats.pop(i)
        if answer:
            self.answers += 1
            self.answer_tokens += len(answer)
            self.repeated_tokens += sum(repeated_ngrams(answer))
            self.turns.answered(chat, prompt, answer)
            if chat.pending:
                nxt = self.turns.next_prompt(chat)
                if nxt is not None and len(nxt) <= self.room:
                    self.chats[i] = (chat, nxt)
                    return i, nxt, self.params
        self.writer.finish(i, ChatTurns.document(chat), chat.answers)
        return None


def _open_manifest(out: Path, model: Path, tokenizer: Tokenizer, source: dict) -> Manifest:
    fingerprint = tokenizer_fingerprint(tokenizer)
    if (out / "manifest.json").is_file():
        manifest = Manifest.read(out)
        if manifest.tokenizer_fingerprint != fingerprint or manifest.source != source:
            raise ValueError(
                f"{out} holds data regenerated by another model or from other prompts/settings "
                f"({manifest.model}, {manifest.source}); choose a new --out to start afresh"
            )
        logger.info("resuming: %d prompts already answered in %s", manifest.prompts_done, out)
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = ModelConfig.from_dir(model).vocab_size
    manifest = Manifest(fingerprint, vocab_size, str(model.name), source)
    manifest.write(out)
    return manifest
