"""Drafter heads (EAGLE-3 and P-EAGLE, one code path), draft vocabularies and their checkpoint formats."""

from peagle.drafters.checkpoint import (FORMATS, DrafterCheckpoint, DrafterMismatchError, check_fits, export_drafter,
                                        load_drafter, read_checkpoint, read_config, save_drafter, write_checkpoint)
from peagle.drafters.config import METHODS, DrafterConfig
from peagle.drafters.drafter import Drafter
from peagle.drafters.vocab import DraftVocab

__all__ = [
    "FORMATS", "METHODS", "Drafter", "DrafterCheckpoint", "DrafterConfig", "DrafterMismatchError", "DraftVocab",
    "check_fits", "export_drafter", "load_drafter", "read_checkpoint", "read_config", "save_drafter",
    "write_checkpoint",
]
