"""The stand-in's TokensPrompt: a prompt given as token ids (vllm/__init__.py says what the stand-in is)."""


def TokensPrompt(prompt_token_ids: list[int]) -> dict:  # noqa: N802 - vLLM's name (a TypedDict there)
    return {"prompt_token_ids": list(prompt_token_ids)}
