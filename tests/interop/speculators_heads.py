"""speculators' side of the interop check, run in the interop virtual environment (no peagle import).

    python speculators_heads.py load HEAD_DIR RESULT.json
        loads a head with speculators' SpeculatorModel.from_pretrained and writes what it reported:
        {"model_class", "speculators", "unexpected", "missing", "warnings"} (checkpoint tensors the model has no
        place for, model tensors the checkpoint lacks beyond those speculators fills itself, and the warnings
        transformers and Python logged while loading).
    python speculators_heads.py save METHOD TARGET_DIR OUT_DIR
        builds a head of METHOD ("eagle3" | "peagle") for the target with speculators' own config classes, fills its
        embedding and lm_head from the target as speculators' trainer does, seeds the rest, and save_pretrained()s it.
"""

import json
import logging
import sys
import warnings
from pathlib import Path


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load(head: str, result_file: str) -> None:
    import transformers
    from safetensors import safe_open
    from speculators import SpeculatorModel

    collect = Collect()
    transformers.logging.get_logger("transformers").addHandler(collect)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = SpeculatorModel.from_pretrained(head)
    with safe_open(str(Path(head) / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    expected = set(model.state_dict()) - set(model._keys_to_ignore_on_save or [])
    result = {
        "model_class": type(model).__name__,
        "speculators": model.config.speculators_version,
        "unexpected": sorted(stored - expected),
        "missing": sorted(expected - stored - set(model._keys_to_ignore_on_load_missing or [])),
        "warnings": collect.messages + [str(w.message) for w in caught],
    }
    Path(result_file).write_text(json.dumps(result))


def save(method: str, target: str, out: str) -> None:
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.peagle import PEagleSpeculatorConfig
    from speculators.models.peagle.core import PEagleDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    layer = AutoConfig.from_pretrained(target)
    layer.num_hidden_layers = 1 if method == "eagle3" else 2
    layer.tie_word_embeddings = False
    config_class, model_class, extra = {
        "eagle3": (Eagle3SpeculatorConfig, Eagle3DraftModel, {}),
        "peagle": (PEagleSpeculatorConfig, PEagleDraftModel, {"mask_token_id": 3}),
    }[method]
    config = config_class(
        transformer_layer_config=layer, draft_vocab_size=layer.vocab_size, eagle_aux_hidden_state_layer_ids=[2, 4, 5],
        speculators_config=SpeculatorsConfig(
            algorithm=method, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(target)),
        **extra,
    )
    torch.manual_seed(0)
    model = model_class(config)
    model.load_verifier_weights()  # embed_tokens and lm_head from the target, as speculators' trainer starts
    model.save_pretrained(out)


if __name__ == "__main__":
    {"load": load, "save": save}[sys.argv[1]](*sys.argv[2:])
