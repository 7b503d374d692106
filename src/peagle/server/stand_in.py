"""A stand-in engine: the server's view of an LLMEngine without a model, for measuring the server's own cost
(scripts/server_overhead.py) and for testing it on the CPU (the engine process killed mid-stream, clients that leave).

Each step sleeps `step_s` (the GIL released, as while a GPU runs) and gives every running request `tokens_per_step`
tokens of a fixed text until its max_tokens. KV blocks are counted as an engine counts them (prompt and output
tokens over the block size, freed when a request finishes or is aborted), so that a test can see a leak.
"""

from __future__ import annotations

import dataclasses
import time
import types

from peagle.engine.stats import EngineStats
from peagle.engine.outputs import RequestMetrics, StepOutput


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StandInConfig:
    """What the server reads of an EngineConfig, and the stand-in's pace."""

    tokenizer: str  # a directory with tokenizer.json
    step_s: float = 0.001
    tokens_per_step: int = 3
    max_num_seqs: int = 1024
    num_kv_blocks: int = 1 << 20
    block_size: int = 16
    k: int = 7  # the speculative tokens the metrics report positions for
    model: str = "stand-in"
    enable_prefix_caching: bool = False

    def __post_init__(self):
        if self.step_s < 0 or self.tokens_per_step < 1:
            raise ValueError(f"step_s must be >= 0 and tokens_per_step >= 1, got {self.step_s}, "
                             f"{self.tokens_per_step}")


class StandInEngine:
    """Steps of `config.step_s` seconds giving every request `config.tokens_per_step` tokens until its max_tokens."""

    def __init__(self, config: StandInConfig):
        from peagle.models.loader import load_tokenizer

        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.max_model_len = 1 << 16
        self.k = config.k
        self.model_config = types.SimpleNamespace(vocab_size=self.tokenizer.vocab_size)
        text = " ".join(f"Sentence {i} of a long answer, with words, numbers like {i * 37} and punctuation."
                        for i in range(2000))
        self.text_ids = [t for t in self.tokenizer.encode(text) if t not in self.eos_token_ids]
        self.requests: dict[str, list[int]] = {}  # id: [max_tokens, tokens given, prompt tokens, arrival]
        self.num_added = 0
        self.num_aborted = 0

    def add_request(self, request_id: str, prompt_ids: list[int], params):
        if any(not 0 <= t < self.tokenizer.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.tokenizer.vocab_size})")
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already running")
        self.requests[request_id] = [params.max_tokens, 0, len(prompt_ids), time.monotonic()]
        self.num_added += 1
        return types.SimpleNamespace(prompt_logprobs=None)

    def abort_request(self, request_id: str):
        if self.requests.pop(request_id, None) is not None:
            self.num_aborted += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        used = sum(-(-(p + n) // self.config.block_size) for _, n, p, _ in self.requests.values())
        return EngineStats(len(self.requests), 0, used, self.config.num_kv_blocks)

    def step(self) -> list[StepOutput]:
        time.sleep(self.config.step_s)
        per, now = self.config.tokens_per_step, time.monotonic()
        outputs, n_text = [], len(self.text_ids) - per
        for request_id, state in list(self.requests.items()):
            n = min(per, state[0] - state[1])
            start = state[1] % n_text
            state[1] += n
            done = state[1] >= state[0]
            metrics = None
            if done:
                rounds = -(-state[1] // per)
                metrics = RequestMetrics(rounds, rounds * self.k, state[1] - rounds, [], state[1], 0.0, 0.0,
                                         now - state[3])
                del self.requests[request_id]
            outputs.append(StepOutput(request_id, self.text_ids[start:start + n], done, "length" if done else None,
                                      metrics=metrics))
        return outputs
