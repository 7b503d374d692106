"""The walk against serving: do the trainer's held-out walk and the engine agree on the same documents?

For each document, its first response is served greedily from its prompt (max_tokens = the response's length) by the
engine with a head, and walked (`metrics.walk`) with the same head. On documents the target wrote greedily in the
same dtype, the served output is the document and, if training and serving see the same inputs, both make the same
drafts: the acceptance lengths agree. A gap between them is a train/serve mismatch (features, positions, the mask,
the vocabulary map), the class of bug that silently lowers acceptance. `scripts/device/walk_check.py` runs it on the
GPU with the trainer's held-out documents; the unit tests run it on a tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from peagle.drafters.checkpoint import load_drafter
from peagle.models.loader import load_model
from peagle.training.data import Document, Manifest, PackedSequence, read_documents
from peagle.training.metrics import leading_right, response_spans, walk
from peagle.training.objectives import Eagle3Objective, PEagleObjective, draft_to_target_ids
from peagle.training.teacher import run_target
from peagle.training.trainer import split_sources


def held_out_documents(data_dirs, tokenizer, vocab_size: int, eval_fraction: float, max_documents: int,
                       seed: int) -> list[Document]:
    """The documents to check: of training data directories, the trainer's held-out split (`split_sources` with the
    train run's --eval-fraction, --max-eval-documents and --seed); of an evaluation set (`peagle regenerate
    --eval-set`, which no trainer reads as training data), its first `max_documents` documents, all held out."""
    evaluation = [Path(d) for d in data_dirs if Manifest.read(Path(d)).source.get("evaluation_only")]
    training = [Path(d) for d in data_dirs if Path(d) not in evaluation]
    held = split_sources(training, tokenizer, vocab_size, eval_fraction, max_documents, seed)[1] if training else []
    for d in evaluation:
        held += read_documents(d, tokenizer, vocab_size)[:max_documents]
    return held


def first_turns(documents, max_tokens: int | None = None):
    """(prompt ids, response ids, document) of each document's first response, the response cut to max_tokens."""
    out = []
    for doc in documents:
        spans = response_spans(doc.loss_mask, torch.zeros_like(doc.token_ids))
        if not spans or spans[0][0] == 0 or spans[0][1] - spans[0][0] < 2:
            continue
        start, end = spans[0]
        end = end if max_tokens is None else min(end, start + max_tokens)
        out.append((doc.token_ids[:start].tolist(), doc.token_ids[start:end].tolist(),
                    PackedSequence.of([Document(doc.token_ids, doc.loss_mask)])))
    return out


@torch.no_grad()
def walked(target_dir: Path, head_dir: Path, turns, k: int, dtype: str, device: str | None = None
           ) -> list[tuple[int, int]]:
    """(accepted, rounds) of the walk over each first response, its drafts scored on the whole document (as the
    engine's last round is scored past max_tokens)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = load_model(target_dir, dtype, device)
    drafter = load_drafter(head_dir, target.config, dtype="float32", target=target).to(device).eval()
    objective = (PEagleObjective(k, 1.0, 1.0, 1, 4096) if drafter.config.method == "peagle"
                 else Eagle3Objective(k, 4096))
    vocab_map = draft_to_target_ids(drafter)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and dtype != "float32")
    result = []
    for prompt, response, seq in turns:
        teacher = run_target(target, seq, drafter.config.aux_layer_ids, device)
        with autocast:
            layout, _, correct = objective.score(drafter, target, teacher, vocab_map)
        lead, _ = leading_right(layout, correct, len(seq), k)
        span = (len(prompt), len(prompt) + len(response))
        result.append(walk(lead.tolist(), [span], k, cap=False))
    del target, drafter
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return result


def served(target_dir: Path, head_dir: Path, turns, k: int, dtype: str, device: str | None = None,
           ignore_eos: bool = False) -> list[tuple[int, int, bool]]:
    """(accepted, rounds, output == the document's response) of serving each document's first response
    (`ignore_eos` for documents that were generated past the end-of-sequence token)."""
    from peagle import LLM, SamplingParams
    method = json.loads((head_dir / "config.json").read_text()).get("speculators_model_type", "eagle3")
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": k,
            "parallel_drafting": method == "peagle"}
    llm = LLM(model=str(target_dir), speculative_config=spec, dtype=dtype, max_num_seqs=64,
              **({"device": device} if device else {}))
    outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in turns],
                        [SamplingParams(temperature=0.0, max_tokens=len(r), ignore_eos=ignore_eos) for _, r, _ in turns],
                        use_tqdm=False)
    rows = [(o.metrics.num_accepted_tokens, o.metrics.num_drafting_rounds, list(o.outputs[0].token_ids) == r)
            for o, (_, r, _) in zip(outs, turns)]
    del llm
    return rows


def al(pairs) -> float | None:
    """1 + accepted / rounds over (accepted, rounds, ...) rows."""
    accepted, rounds = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return round(1 + accepted / rounds, 4) if rounds else None
