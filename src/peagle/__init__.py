"""peagle: parallel speculative decoding (P-EAGLE) for Llama/Qwen-family models."""

__version__ = "0.1.0"


def __getattr__(name):
    # The engine pulls in torch and triton; keep `import peagle` cheap for the CLI and host-side code.
    if name in ("LLM", "SamplingParams"):
        from peagle.engine import llm, sampling_params

        return {"LLM": llm.LLM, "SamplingParams": sampling_params.SamplingParams}[name]
    raise AttributeError(f"module 'peagle' has no attribute {name!r}")
