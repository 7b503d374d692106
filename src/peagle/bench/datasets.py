"""The prompt sets moved to peagle.datasets (below both bench and training); this name stays for scripts under
scripts/device that still import it here."""

from peagle.datasets import (BUILTIN_DATASETS, HUMANEVAL_TEMPLATE, ROLES, SHAREGPT_FILENAME,  # noqa: F401
                             SHAREGPT_HELDOUT_PERCENT, SHAREGPT_MAX_PROMPT_CHARS, SPLITS, Message, Prompt, data_file,
                             default_cache_dir, load_humaneval, load_jsonl_prompts, load_longcode, load_mtbench,
                             load_prompts, load_sharegpt, longcode_records, read_sharegpt, sharegpt_file,
                             sharegpt_prompts, sharegpt_split_of)
