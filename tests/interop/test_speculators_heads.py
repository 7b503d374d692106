"""speculators (the training library of vLLM's ecosystem) and peagle read each other's heads: speculators loads
peagle's trained heads with nothing unexpected, missing or warned about, and heads written by speculators' own
save_pretrained load in peagle tensor for tensor and serve with unchanged greedy output."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import SPECULATIVE_CONFIGS, run_interop

MODEL_CLASSES = {"eagle3": "Eagle3DraftModel", "peagle": "PEagleDraftModel"}


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_speculators_loads_peagle_heads_without_a_warning(method, interop_python, workdir, trained_heads):
    result = workdir / f"speculators-load-{method}.json"
    run_interop(interop_python, workdir, f"speculators-load-{method}.log", "speculators_heads.py", "load",
                str(trained_heads[method]), str(result))
    report = json.loads(result.read_text())
    assert report["model_class"] == MODEL_CLASSES[method]
    assert (report["unexpected"], report["missing"], report["warnings"]) == ([], [], [])


@pytest.mark.parametrize("method", ["eagle3", "peagle"])
def test_speculators_own_heads_load_and_serve_in_peagle(method, interop_python, workdir, target, plain,
                                                        peagle_generate):
    from peagle.drafters import load_drafter, read_checkpoint
    from peagle.models.config import ModelConfig

    head = workdir / f"speculators-{method}"
    run_interop(interop_python, workdir, f"speculators-save-{method}.log", "speculators_heads.py", "save", method,
                str(target), str(head))
    stored = load_file(head / "model.safetensors")
    assert not {"d2t", "t2d"} & set(stored)
    ckpt = read_checkpoint(head)
    assert all(torch.equal(ckpt.tensors[name], t) for name, t in stored.items())
    drafter = load_drafter(head, ModelConfig.from_dir(target))
    cfg = drafter.config
    assert (cfg.method, cfg.num_layers, cfg.aux_layer_ids) == (method, 1 if method == "eagle3" else 2, (2, 4, 5))
    assert cfg.mask_token_id == (3 if method == "peagle" else None)
    assert torch.equal(drafter.fc.weight, stored["fc.weight"])
    served = peagle_generate({**SPECULATIVE_CONFIGS[method], "model": str(head)})
    assert served["outputs"] == plain["peagle"]["outputs"]
    assert served["spec_decode"]["num_drafts"] > 0
