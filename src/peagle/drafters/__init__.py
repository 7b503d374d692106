"""Drafter heads (EAGLE-3 and P-EAGLE, one code path), draft vocabularies and their checkpoint formats."""

import importlib

# Name -> submodule, imported on first use: the engine's config parsing reads drafters.policy without torch.
_EXPORTS = {
    **dict.fromkeys(("FORMATS", "DrafterCheckpoint", "DrafterMismatchError", "check_fits", "export_drafter",
                     "load_drafter", "read_checkpoint", "read_config", "save_drafter", "write_checkpoint"),
                    "checkpoint"),
    "METHODS": "config", "DrafterConfig": "config", "Drafter": "drafter", "DraftVocab": "vocab",
}

__all__ = [
    "FORMATS", "METHODS", "Drafter", "DrafterCheckpoint", "DrafterConfig", "DrafterMismatchError", "DraftVocab",
    "check_fits", "export_drafter", "load_drafter", "read_checkpoint", "read_config", "save_drafter",
    "write_checkpoint",
]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"peagle.drafters.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'peagle.drafters' has no attribute {name!r}")
