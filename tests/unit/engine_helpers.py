"""What the engine's end-to-end CPU tests share: a tiny 4-layer llama target, random EAGLE-3 and P-EAGLE heads for
it, an fp32 CPU `LLM` over it (plain or speculative), greedy sampling, and greedy decoding recomputed from scratch.

The fixtures (`target_dir`, `heads`) are module-scoped: a test module imports them by name
(`from engine_helpers import heads, target_dir  # noqa: F401`).
"""

from __future__ import annotations

import pytest
import torch

from peagle import LLM, SamplingParams
from peagle.drafters import Drafter, save_drafter
from peagle.engine.draft_plan import PAD_DRAFT
from peagle.models.attention import DenseAttention


@pytest.fixture(scope="module")
def target_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("llama", num_layers=4)


def save_heads(target, tmp_path_factory, seed: int = 3) -> dict[str, str]:
    """A random head for `target` per method, saved: {"eagle3": one layer, "peagle": two layers} -> its directory."""
    out = {}
    for method, layers in (("eagle3", 1), ("peagle", 2)):
        d = tmp_path_factory.mktemp(method)
        save_drafter(Drafter.for_target(target, method, layers, seed=seed), d / "head")
        out[method] = str(d / "head")
    return out


@pytest.fixture(scope="module")
def heads(target_dir, tmp_path_factory):
    return save_heads(target_dir, tmp_path_factory)


def spec_config(head, k: int = 3, parallel: bool = False, **extra) -> dict | None:
    """The speculative_config of an EAGLE-3-format head (P-EAGLE's with parallel drafting); None without a head."""
    if head is None:
        return None
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, "parallel_drafting": parallel,
            **extra}


def cpu_llm(target, speculative_config: dict | None = None, **kw) -> LLM:
    """An fp32 LLM on the CPU over `target`, 96 positions; `kw` are the engine's other options."""
    return LLM(model=str(target), speculative_config=speculative_config, device="cpu", dtype="float32",
               max_model_len=96, **kw)


def make_llm(target, head=None, k: int = 3, parallel: bool = False, **kw) -> LLM:
    """`cpu_llm` with `head` drafting `k` tokens (plain decoding without one): 3 requests at a time, synchronous
    scheduling unless `kw` says otherwise."""
    kw.setdefault("max_num_seqs", 3)
    kw.setdefault("async_scheduling", False)  # the synchronous path; async tests ask for theirs
    return cpu_llm(target, spec_config(head, k, parallel), **kw)


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def recompute_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """`prompt` and `max_tokens` greedy tokens after it, each from a forward pass over the whole context (no cache)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        h = model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention([len(ids)])).hidden
        ids.append(int(model.compute_logits(h[-1:]).argmax()))
    return ids


def oracle_proposer(runner, reference: list[list[int]], rng, keep_cuts: bool = False) -> None:
    """Wraps the runner's proposer (still run) so that its drafts are the true continuation with a random corruption:
    rounds accept 0..K drafts. The request is recognised by its next token's position and id in one sequence of
    `reference` (prompt + greedy output). With `keep_cuts`, drafts the proposer left PAD_DRAFT (cut by confidence)
    stay PAD_DRAFT."""
    real = runner.propose
    by_key = {}
    for ref in reference:
        for p, token in enumerate(ref):
            by_key.setdefault((p, token), []).append(ref)

    def propose(x, aux, num_rejected, next_tokens, max_query_len, small_query_len=None, num_drafts=None):
        drafts = real(x, aux, num_rejected, next_tokens, max_query_len, small_query_len, num_drafts).clone()
        n = drafts.shape[1]  # the engine's K, or the adaptive policy's
        qsl, pos = x["query_start_loc"].tolist(), x["positions"].tolist()
        for b, token in enumerate(next_tokens.tolist()[:len(qsl) - 1]):
            if qsl[b + 1] == qsl[b]:
                continue  # padding
            p = pos[qsl[b + 1] - 1 - int(num_rejected[b])] + 1
            refs = by_key.get((p, token), [])
            if len(refs) == 1:
                oracle = (refs[0][p + 1:] + [0] * n)[:n]
                cut = rng.randrange(n + 1)
                if cut < n:
                    oracle[cut] = (oracle[cut] + 1) % 300
                oracle = torch.tensor(oracle)
                if keep_cuts:
                    oracle = torch.where(drafts[b] >= 0, oracle, torch.full_like(drafts[b], PAD_DRAFT))
                drafts[b] = oracle
        return drafts

    runner.propose = propose
