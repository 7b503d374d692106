"""`peagle convert gguf`: a GGUF file (llama, qwen2, qwen3, gemma3) -> a Hugging Face safetensors checkpoint directory.

What the conversion undoes or rebuilds:
- Quantized tensors (Q8_0, Q4_K, Q6_K, ...) are dequantized with the `gguf` library, then cast to the requested dtype.
- llama.cpp's llama converter permutes the rows of attn_q / attn_k per head so that its interleaved-pair RoPE
  equals the rotate-half RoPE of HF weights; the permutation is inverted here (qwen2/qwen3 files are not permuted).
- llama.cpp's gemma3 converter stores every norm weight as 1 + w (its RMSNorm has no +1); the 1 is taken off again,
  as transformers' GGUF loader does.
- config.json comes from the `<arch>.*` metadata (tie_word_embeddings when there is no output.weight; llama3 RoPE
  scaling recovered from the rope_freqs tensor; Gemma 3's sliding layers as llama.cpp lays them out);
  tokenizer.json / tokenizer_config.json / generation_config.json from the `tokenizer.*` metadata: byte-level BPE
  and Gemma's SentencePiece vocabulary rebuilt here (Gemma's as transformers 5.25 builds it: 5.17 builds another
  tokenizer from the same file), other SentencePiece vocabularies by transformers' GGUF tokenizer conversion.
Everything is written into a temporary directory beside OUT_DIR and renamed at the end, so a failure leaves nothing.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from tqdm import tqdm

from peagle.models.config import FAMILY_ARCHITECTURE, ModelConfig, UnsupportedModelError
from peagle.models.layers import rope_inv_freq
from peagle.models.loader import empty_model, parse_dtype
from peagle.models.weights import SafetensorsCheckpoint, check_checkpoint, save_safetensors

logger = logging.getLogger(__name__)

# GGUF general.architecture -> peagle family.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
# Architectures whose llama.cpp converter permutes Q/K rows for interleaved RoPE.
PERMUTED_QK = {"llama"}
# Architectures whose llama.cpp converter adds 1 to every norm weight.
SHIFTED_NORMS = {"gemma3"}

GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its four norms a layer after their places.
ARCH_LAYER_TENSORS = {"gemma3": {**LAYER_TENSORS, "post_attention_norm": "post_attention_layernorm",
                                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}}
ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling factors, folded into config.json instead
_REQUIRED = object()


def convert_gguf(src: str | Path, out: str | Path, dtype: str | torch.dtype = "bfloat16", force: bool = False) -> Path:
    """Converts SRC.gguf into the checkpoint directory OUT; returns OUT."""
    src, out = Path(src), Path(out)
    torch_dtype = parse_dtype(dtype)
    _check_paths(src, out, force)
    # Everything that only reads metadata comes first, so an unsupported file fails before any slow work.
    gguf = GGUFFile(src)
    cfg = gguf.model_config(torch_dtype)
    tokenizer = gguf.tokenizer()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        save_safetensors(gguf.hf_tensors(cfg, torch_dtype), tmp)
        check_checkpoint(SafetensorsCheckpoint(tmp), empty_model(cfg))
        _write_json(tmp / "config.json", cfg.to_hf_dict())
        tokenizer.write(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s -> %s (%s, %s)", src, out, cfg.architecture, torch_dtype)
    return out


def _check_paths(src: Path, out: Path, force: bool) -> None:
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {src} does not exist")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"output directory {out} is not empty; pass --force to replace its contents")
        if out.resolve() in src.resolve().parents:
            raise ValueError(f"refusing to replace {out}: it contains the source file {src}")


def _replace_dir(tmp: Path, out: Path) -> None:
    # mkdtemp made the directory private; the checkpoint should be as readable as any other directory.
    tmp.chmod(0o755)
    for file in tmp.iterdir():
        file.chmod(0o644)
    if not out.exists():
        tmp.rename(out)
        return
    # Move the old directory aside first so that OUT is never missing for longer than two renames.
    old = out.with_name(f".{out.name}.old-{tmp.name}")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old)


def _write_json(file: Path, obj: Any) -> None:
    file.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


class GGUFFile:
    """A GGUF file opened with gguf.GGUFReader (memory-mapped), validated up front."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = path
        try:
            self.reader = GGUFReader(path)
        except Exception as e:  # the reader fails with whatever numpy raises on a cut-off or garbled file
            raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupted?): {e}") from None
        for t in self.reader.tensors:
            if t.data.nbytes != int(t.n_bytes):
                raise ValueError(f"{path} is truncated: tensor {t.name} has {t.data.nbytes} of {t.n_bytes} bytes")
        self.arch = self.get("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path}: unsupported GGUF architecture {self.arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
            )
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ValueError(f"{self.path} lacks the metadata key {key!r}; is it a complete model GGUF?")
            return default
        return _field_value(field)

    def arch_get(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    # -- config -------------------------------------------------------------------------------------------------

    def model_config(self, dtype: torch.dtype) -> ModelConfig:
        hidden = self.arch_get("embedding_length")
        heads = self.arch_get("attention.head_count")
        theta = _clean_float(self.arch_get("rope.freq_base", 10000.0))
        head_dim = self.arch_get("attention.key_length", None) or self.arch_get("rope.dimension_count", None)
        head_dim = head_dim or hidden // heads
        d = {
            "architectures": [FAMILY_ARCHITECTURE[GGUF_ARCHITECTURES[self.arch]]],
            "vocab_size": int(self._shape("token_embd.weight")[0]),
            "hidden_size": hidden,
            "intermediate_size": self.arch_get("feed_forward_length"),
            "num_hidden_layers": self.arch_get("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.arch_get("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": _clean_float(self.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": theta,
            "rope_scaling": self._rope_scaling(head_dim, theta),
            "max_position_embeddings": self.arch_get("context_length", 4096),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.get("tokenizer.ggml.eos_token_id", None),
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if self.arch == "gemma3":
            d.update(self._gemma3_config(d))
        return ModelConfig.from_hf_dict(d)

    def _gemma3_config(self, d: dict[str, Any]) -> dict[str, Any]:
        """What llama.cpp's gemma3 model takes from elsewhere than the common keys (which it moves from `d`): every
        sixth layer global, the others sliding with a 10,000 RoPE base (unless the file says), scores scaled by
        head_dim ** -0.5 except in the 27B (62 layers: hidden / heads), which it recognises by its depth."""
        n, pattern = d["num_hidden_layers"], self.arch_get("attention.sliding_window_pattern", 6)
        sliding = pattern if isinstance(pattern, list) else [bool((i + 1) % pattern) for i in range(n)]
        scalar = d["hidden_size"] // d["num_attention_heads"] if n == 62 else d["head_dim"]
        full = {"rope_type": "default", **(d.pop("rope_scaling") or {}), "rope_theta": d.pop("rope_theta")}
        local = {"rope_type": "default", "rope_theta": _clean_float(self.arch_get("rope.freq_base_swa", 10000.0))}
        return {"rope_parameters": {"full_attention": full, "sliding_attention": local},
                "sliding_window": self.arch_get("attention.sliding_window"),
                "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
                "query_pre_attn_scalar": scalar,
                "final_logit_softcapping": self.arch_get("final_logit_softcapping", None),
                "attn_logit_softcapping": self.arch_get("attn_logit_softcapping", None)}

    def _shape(self, name: str) -> tuple[int, ...]:
        if name not in self.tensors:
            raise ValueError(f"{self.path} has no tensor {name!r}; is it a complete model GGUF?")
        return tuple(reversed([int(n) for n in self.tensors[name].shape]))  # GGUF lists dims innermost first

    def _rope_scaling(self, head_dim: int, theta: float) -> dict[str, Any] | None:
        scaling_type = self.arch_get("rope.scaling.type", "none")
        if scaling_type not in ("none", "linear", "llama3"):
            raise UnsupportedModelError(f"{self.path}: unsupported RoPE scaling {scaling_type!r}; supported: linear, "
                                        "llama3")
        if scaling_type == "linear":
            return {"rope_type": "linear", "factor": _clean_float(self.arch_get("rope.scaling.factor"))}
        return self._llama3_scaling(head_dim, theta)

    def _llama3_scaling(self, head_dim: int, theta: float) -> dict[str, Any] | None:
        """llama.cpp stores llama3 RoPE scaling as per-frequency divisors; recover the config that yields them."""
        if ROPE_FREQS not in self.tensors:
            return None
        stored = _dequantize(self.tensors[ROPE_FREQS]).reshape(-1)
        scaling = {
            "rope_type": "llama3",
            "factor": _clean_float(stored.max()),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": int(self.arch_get("rope.scaling.original_context_length", 8192)),
        }
        implied = (rope_inv_freq(head_dim, theta, None) / rope_inv_freq(head_dim, theta, scaling)).numpy()
        if implied.shape != stored.shape or not np.allclose(implied, stored, rtol=1e-3):
            raise UnsupportedModelError(
                f"{self.path}: its {ROPE_FREQS} matches no llama3 RoPE scaling with the usual low/high frequency "
                "factors (1, 4); convert the original Hugging Face checkpoint instead"
            )
        return scaling

    # -- tensors ------------------------------------------------------------------------------------------------

    def hf_tensors(self, cfg: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every weight, dequantized and un-permuted, with a progress bar."""
        for t in tqdm(self.reader.tensors, desc=f"converting {self.path.name}", unit="tensor", disable=None):
            if t.name == ROPE_FREQS:
                continue
            hf_name = hf_tensor_name(t.name, self.arch)
            if hf_name is None:
                raise ValueError(f"{self.path}: tensor {t.name!r} has no Hugging Face counterpart for {self.arch}")
            weights = torch.from_numpy(_dequantize(t).reshape(self._shape(t.name)))
            if self.arch in SHIFTED_NORMS and t.name.endswith("norm.weight"):
                weights = weights - 1
            if self.arch in PERMUTED_QK and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                weights = unpermute_qk(weights, cfg.num_attention_heads)
            elif self.arch in PERMUTED_QK and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                weights = unpermute_qk(weights, cfg.num_key_value_heads)
            yield hf_name, weights.to(dtype)

    # -- tokenizer ----------------------------------------------------------------------------------------------

    def tokenizer(self) -> "TokenizerFiles":
        meta = {key: self.get(key, None) for key in TOKENIZER_KEYS}
        files = build_tokenizer(meta, self.path, self.arch)
        files.tokenizer_config["model_max_length"] = self.arch_get("context_length", 4096)
        return files


TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
    "tokenizer.chat_template", "tokenizer.ggml.scores", "tokenizer.ggml.precompiled_charsmap",
    "tokenizer.ggml.add_space_prefix",
)


# -- tokenizer metadata -> tokenizer.json ------------------------------------------------------------------------

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # llama.cpp token types; control tokens are special, user-defined are not

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one `tokenizer.ggml.pre` value (see its llama-vocab.cpp)."""

    split: str | None = None  # a regex applied before byte mapping; None: the GPT-2 regex of ByteLevel itself
    individual_digits: bool = False
    nfc: bool = False
    ignore_merges: bool = False  # a word that is itself a token is taken whole
    add_bos: bool = False  # default when the file does not say

    def build(self):
        from tokenizers import Regex, normalizers, pre_tokenizers

        steps = [pre_tokenizers.Digits(individual_digits=True)] if self.individual_digits else []
        if self.split is not None:
            steps.append(pre_tokenizers.Split(Regex(self.split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=self.split is None))
        normalizer = normalizers.NFC() if self.nfc else None
        return normalizer, pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]


_GPT2 = PreTokenizer()
_DIGITS = PreTokenizer(individual_digits=True)
_LLAMA3 = PreTokenizer(split=_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer(split=_QWEN2_SPLIT, nfc=True)
PRE_TOKENIZERS = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2,
    "smollm": _DIGITS, "starcoder": _DIGITS, "refact": _DIGITS, "codeshell": _DIGITS,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    backend: Any  # tokenizers.Tokenizer
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]

    def write(self, out: Path) -> None:
        self.backend.save(str(out / "tokenizer.json"))
        _write_json(out / "tokenizer_config.json", self.tokenizer_config)
        _write_json(out / "generation_config.json", self.generation_config)


def build_tokenizer(meta: dict[str, Any], path: Path, arch: str = "llama") -> TokenizerFiles:
    """tokenizer.json, tokenizer_config.json and generation_config.json from a GGUF's `tokenizer.*` metadata."""
    kind = meta["tokenizer.ggml.model"]
    tokens = meta["tokenizer.ggml.tokens"]
    if not tokens:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens; it carries no usable tokenizer")
    if kind == "gpt2":
        backend, default_bos = _byte_level_backend(meta, path)
    elif kind == "llama":
        backend, default_bos = _sentencepiece_backend(meta, path, arch), True  # llama.cpp's default for these
    else:
        raise UnsupportedModelError(f"{path}: tokenizer model {kind!r} is not supported; supported: byte-level BPE "
                                    "(gpt2) and SentencePiece (llama)")

    def token(key):
        token_id = meta[f"tokenizer.ggml.{key}"]
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    add_bos = meta["tokenizer.ggml.add_bos_token"]
    add_bos = default_bos if add_bos is None else bool(add_bos)
    add_eos = bool(meta["tokenizer.ggml.add_eos_token"])
    bos, eos = token("bos_token_id"), token("eos_token_id")
    backend.post_processor = _post_processor(bos if add_bos else None, eos if add_eos else None, backend,
                                             byte_level=kind == "gpt2")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if meta["tokenizer.chat_template"]:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    eos_ids = [meta[f"tokenizer.ggml.{k}"] for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    if kind == "llama" and GEMMA_END_OF_TURN in tokens:
        eos_ids.append(tokens.index(GEMMA_END_OF_TURN))
    eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
    generation_config = {
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": meta["tokenizer.ggml.padding_token_id"],
    }
    return TokenizerFiles(backend, tokenizer_config, generation_config)


# Gemma's chat turns end with this token, which its GGUFs do not name (llama.cpp finds it by its text); the original
# generation_config.json stops at it as well as at <eos>.
GEMMA_END_OF_TURN = "<end_of_turn>"


def _byte_level_backend(meta: dict[str, Any], path: Path):
    """Byte-level BPE, split as llama.cpp splits for the file's `tokenizer.ggml.pre`; with whether that pre-tokenizer
    adds a BOS token when the file does not say."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    pre_name = meta["tokenizer.ggml.pre"] or "default"
    if pre_name not in PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"{path}: pre-tokenizer {pre_name!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}"
        )
    pre = PRE_TOKENIZERS[pre_name]
    tokens = meta["tokenizer.ggml.tokens"]
    if meta["tokenizer.ggml.merges"] is None:
        raise ValueError(f"{path} has no tokenizer.ggml.merges; it carries no usable BPE tokenizer")
    types = meta["tokenizer.ggml.token_type"] or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab=_byte_level_vocab(tokens, types, path), merges=merges,
                                   ignore_merges=pre.ignore_merges))
    backend.normalizer, backend.pre_tokenizer = pre.build()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == TOKEN_CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED])
    return backend, pre.add_bos


def _sentencepiece_backend(meta: dict[str, Any], path: Path, arch: str):
    """A SentencePiece vocabulary (tokens and scores, merges recovered from them) as transformers' GGUF loader builds
    it: the same tokens for the same text. Gemma's is built here (`_gemma_backend`)."""
    if arch == "gemma3":
        return _gemma_backend(meta)
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                           convert_gguf_tokenizer)
    except ImportError:
        raise UnsupportedModelError(f"{path}: its SentencePiece tokenizer is converted by transformers' GGUF "
                                    "tokenizer mapping (transformers.integrations.gguf), which this transformers "
                                    "lacks; upgrade transformers") from None

    if meta["tokenizer.ggml.scores"] is None and meta["tokenizer.ggml.merges"] is None:
        raise ValueError(f"{path} has neither tokenizer.ggml.scores nor merges; its SentencePiece tokenizer cannot be "
                         "rebuilt")
    names = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {names[key.removeprefix("tokenizer.")]: value for key, value in meta.items()
                      if key.removeprefix("tokenizer.") in names and value is not None}
    return convert_gguf_tokenizer(arch, tokenizer_dict)[0]


def _gemma_backend(meta: dict[str, Any]):
    """Gemma's SentencePiece vocabulary as transformers' GGUF loader builds it since its GemmaTokenizer became a BPE
    (5.25 checked; 5.17 builds another tokenizer from the same file, so it is built here, not by transformers): a BPE
    with byte fallback over the vocabulary, spaces written as "▁", its tokens of spaces alone respelled so (the file
    stores them as spaces), merges recovered from the vocabulary (`merges_in_list_order`), control tokens and
    <unk>, <bos>, <eos>, <pad>, <mask> special, user-defined ones matched whole."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    spelled = meta["tokenizer.ggml.tokens"]
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in spelled]
    types = meta["tokenizer.ggml.token_type"] or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges_in_list_order(vocab), fuse_unk=True, unk_token="<unk>",
                                   byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # special: the control tokens and those GemmaTokenizer names (one it names that the vocabulary lacks, as a tiny
    # test vocabulary's <mask>, transformers appends past the model's rows; not here)
    named = {"<unk>", "<bos>", "<eos>", "<pad>", "<mask>"}
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == TOKEN_CONTROL or t in named])
    # user-defined tokens matched whole, but not the respelled ones (transformers looks up the file's spelling)
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, s, k in zip(tokens, spelled, types) if k == TOKEN_USER_DEFINED and t == s])
    return backend


def merges_in_list_order(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges recovered from a vocabulary that lists none: every split of a token into two tokens, ranked by the
    token's place in the list (Gemma's scores do not follow its merge order; its list does), then by the longer
    pieces first; one token's splits in the order of their pieces' ids. As transformers' `generate_merges` with the
    negated list positions for scores.

    >>> merges_in_list_order({"a": 0, "b": 1, "ab": 2, "c": 3, "abc": 4, "bc": 5})
    [('a', 'b'), ('ab', 'c'), ('a', 'bc'), ('b', 'c')]
    """
    ranked = []
    for token, place in vocab.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        ranked += [(left, right, -place) for left, right in sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]]))]
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _byte_level_vocab(tokens: list[str], types: list[int], path: Path) -> dict[str, int]:
    # Normal tokens are spelled in GPT-2's byte alphabet; one that is not (a llama.cpp mislabel) is respelled from
    # its UTF-8 bytes. Control and user-defined tokens keep their literal text: they are matched whole.
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        if token in vocab:
            raise ValueError(f"{path}: token {token!r} appears twice in the vocabulary (ids {vocab[token]} and {i})")
        vocab[token] = i
    return vocab


def _post_processor(bos: str | None, eos: str | None, backend, byte_level: bool):
    from tokenizers import processors

    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    pre, post = ([f"{bos}:0"] if bos else []), ([f"{eos}:0"] if eos else [])
    template = processors.TemplateProcessing(
        single=" ".join([*pre, "$A:0", *post]),
        pair=" ".join([*pre, "$A:0", *post, *[p.replace(":0", ":1") for p in pre], "$B:1",
                       *[p.replace(":0", ":1") for p in post]]),
        special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)],
    )
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), template]) if byte_level else template


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """GGUF tensor name -> HF name in a file of architecture `arch`, or None when it has none.

    e.g. blk.3.ffn_up.weight -> model.layers.3.mlp.up_proj.weight
    """
    stem, _, kind = gguf_name.rpartition(".")
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    layer_tensors = ARCH_LAYER_TENSORS.get(arch, LAYER_TENSORS)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{kind}"
    return None


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverts llama.cpp's `permute`: within each head, rows (pairs interleaved) -> (first halves, second halves).

    w: [num_heads * head_dim, ...] (weight or bias) -> same shape.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ValueError(
            f"tensor {tensor.name} uses quantization {tensor.tensor_type.name}, which this version of the gguf "
            "library cannot dequantize; upgrade gguf or convert a differently quantized file"
        ) from None


def _clean_float(x: float) -> float:
    # GGUF stores float32; print it at float32 precision so 1e-5 stays 1e-5 instead of 9.999999747378752e-06.
    return float(str(np.float32(x)))


def _field_value(field) -> Any:
    from gguf import GGUFValueType

    def scalar(part, vtype):
        return bytes(part).decode("utf-8") if vtype == GGUFValueType.STRING else part[0].item()

    if field.types[0] == GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])
