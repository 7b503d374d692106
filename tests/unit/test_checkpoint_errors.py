"""Each broken input gives a message a user can act on, and nothing half-written is left behind."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from peagle.cli import main as cli_main
from peagle.models.config import UnsupportedModelError
from peagle.models.gguf_convert import convert_gguf
from peagle.models.loader import load_model, load_tokenizer


def _listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def checkpoint(tiny_hf_checkpoint, tmp_path):
    """A private, damageable copy of the tiny llama checkpoint."""
    return shutil.copytree(tiny_hf_checkpoint("llama"), tmp_path / "ckpt")


@pytest.fixture
def sharded(tiny_hf_checkpoint, tmp_path):
    return shutil.copytree(tiny_hf_checkpoint("llama", max_shard_size="100KB"), tmp_path / "sharded")


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unsupported_architecture_lists_the_supported_ones(checkpoint):
    _edit_config(checkpoint, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    before = _listing(checkpoint)
    with pytest.raises(UnsupportedModelError, match=r"unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM.*"
                                                    r"Qwen3ForCausalLM"):
        load_model(checkpoint)
    assert _listing(checkpoint) == before


def test_unsupported_rope_scaling_is_refused_by_name(checkpoint):
    _edit_config(checkpoint, rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="unsupported rope_scaling type 'longrope'"):
        load_model(checkpoint)


def test_missing_shard_names_the_file_and_the_index(sharded):
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    before = _listing(sharded)
    with pytest.raises(FileNotFoundError, match=rf"{shard.name}.*model\.safetensors\.index\.json"):
        load_model(sharded)
    assert _listing(sharded) == before


def test_missing_tensors_are_listed(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"], tensors["model.norm.weight"]
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 2 tensor\(s\).*model.layers.3.mlp.up_proj.weight.*model.norm.weight"):
        load_model(checkpoint)


def test_shape_mismatch_names_tensor_and_both_shapes(checkpoint):
    _edit_config(checkpoint, intermediate_size=128)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight in model\.safetensors has shape "
                                         r"\[96, 64\], but config\.json implies \[128, 64\]"):
        load_model(checkpoint)


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_safetensors_names_the_file(checkpoint, keep):
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=rf"{file}.*not a readable safetensors file \(truncated or corrupted"):
        load_model(checkpoint)


def test_no_weights_at_all(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"holds no \*\.safetensors weights"):
        load_model(checkpoint)


def test_missing_tokenizer_json(checkpoint):
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer(checkpoint)


@pytest.mark.parametrize("damage", ["truncate", "garble"])
def test_corrupted_gguf_names_the_file_and_leaves_nothing(tiny_gguf, tmp_path, capsys, damage):
    data = tiny_gguf("llama").read_bytes()
    src = tmp_path / "broken.gguf"
    src.write_bytes(data[: len(data) * 2 // 3] if damage == "truncate" else data[:8] + b"\xff" * 64 + data[72:])
    with pytest.raises(ValueError, match=rf"{src}.*(not a readable GGUF file|truncated)"):
        convert_gguf(src, tmp_path / "out")
    assert cli_main(["convert", "gguf", str(src), str(tmp_path / "out")]) == 1
    assert f"peagle convert: error: {src}" in capsys.readouterr().err
    assert _listing(tmp_path) == ["broken.gguf"]


def test_unsupported_gguf_architecture_lists_supported_and_leaves_nothing(tiny_gguf, tmp_path):
    data = tiny_gguf("llama").read_bytes()
    # Same-length rename of general.architecture's value: "llama" -> "gemma".
    key = b"general.architecture"
    start = data.index(key) + len(key) + 4 + 8  # key, value type (u32), string length (u64)
    assert data[start:start + 5] == b"llama"
    src = tmp_path / "gemma.gguf"
    src.write_bytes(data[:start] + b"gemma" + data[start + 5:])
    with pytest.raises(UnsupportedModelError,
                       match=r"unsupported GGUF architecture 'gemma'.*'llama', 'qwen2', 'qwen3'"):
        convert_gguf(src, tmp_path / "out")
    assert _listing(tmp_path) == ["gemma.gguf"]


def test_failure_after_writing_started_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    # A failure late in the conversion (here: while writing the tokenizer files) removes the temporary directory.
    from peagle.models import gguf_convert

    def fail(self, out):
        assert (out / "model.safetensors").is_file()  # the weights were already written
        raise OSError("disk full")

    monkeypatch.setattr(gguf_convert.TokenizerFiles, "write", fail)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(tiny_gguf("llama"), tmp_path / "out")
    assert _listing(tmp_path) == []


def test_non_empty_output_is_refused_without_force_and_left_untouched(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=rf"{out} is not empty; pass --force"):
        convert_gguf(tiny_gguf("llama"), out)
    assert cli_main(["convert", "gguf", str(tiny_gguf("llama")), str(out)]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert _listing(tmp_path) == ["out", "out/notes.txt"] and (out / "notes.txt").read_text() == "keep me"


def test_force_never_deletes_the_directory_holding_the_source(tiny_gguf, tmp_path):
    src = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf("llama"), src)
    with pytest.raises(ValueError, match="contains the source file"):
        convert_gguf(src, tmp_path, force=True)
    assert _listing(tmp_path) == ["model.gguf"]


def test_failed_forced_conversion_keeps_the_old_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    src = tmp_path / "empty.gguf"
    src.write_bytes(b"")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        convert_gguf(src, out, force=True)
    assert _listing(tmp_path) == ["empty.gguf", "out", "out/config.json"]


HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _says_how_to_get_a_checkpoint(text: str, repo: str = "ORG/NAME") -> None:
    assert "peagle takes a local checkpoint directory (config.json, safetensors weights, tokenizer.json)" in text
    assert "downloads nothing from a hub" in text
    assert f"hf download {repo} --local-dir DIR" in text and "peagle convert gguf" in text


def test_a_hub_id_is_answered_with_how_to_download_it(tmp_path, monkeypatch, capsys):
    from peagle import LLM

    monkeypatch.chdir(tmp_path)  # the hub id is no directory here
    with pytest.raises(FileNotFoundError) as e:
        LLM(HUB_ID, device="cpu")
    assert str(e.value).startswith(f"{HUB_ID} is not a directory")
    _says_how_to_get_a_checkpoint(str(e.value), HUB_ID)
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(HUB_ID)
    _says_how_to_get_a_checkpoint(str(e.value), HUB_ID)
    assert cli_main(["serve", HUB_ID, "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"peagle serve: error: {HUB_ID} is not a directory")
    _says_how_to_get_a_checkpoint(err, HUB_ID)


def test_a_directory_without_config_json_or_a_gguf_file_says_what_peagle_takes(checkpoint, tmp_path):
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"{checkpoint} has no config.json") as e:
        load_model(checkpoint)
    _says_how_to_get_a_checkpoint(str(e.value))
    with pytest.raises(FileNotFoundError, match=r"model\.gguf is a GGUF file.*`peagle convert gguf .*model\.gguf DIR`"):
        load_model(tmp_path / "model.gguf")
