"""scripts/device/heads_pack.py: trained heads cut into parts and rebuilt from them and their target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, load_file, save, save_file

from peagle.bench.smoke_model import write_tiny_checkpoint
from peagle.drafters import Drafter, load_drafter, save_drafter
from peagle.drafters.target import TargetParts
from peagle.models.config import ModelConfig


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    texts = [f"a sentence number {i} about drafts, tokens and the verifier's cache" for i in range(200)]
    return write_tiny_checkpoint(tmp_path_factory.mktemp("target"), texts)


def trained_head(target, method: str, out, draft_vocab: int | None, seed: int, train_lm_head: bool = False,
                 embedding_rows: list[int] | None = None):
    """A head built for the target as `peagle train` builds it, its other tensors moved as training moves them
    (of the embedding only `embedding_rows`, when given: the rows of the tokens training read)."""
    parts = TargetParts.from_dir(target)
    corpus = [torch.randint(0, parts.config.vocab_size, (4000,), generator=torch.Generator().manual_seed(seed))]
    head = Drafter.for_target(parts, method, 2 if method == "peagle" else 1, draft_vocab=draft_vocab,
                              vocab_corpus=corpus if draft_vocab else None, seed=seed).float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name != "lm_head.weight" or train_lm_head:
                step = 0.01 * torch.randn(p.shape, generator=gen)
                if name == "embed_tokens.weight" and embedding_rows is not None:
                    p[embedding_rows] += step[embedding_rows]
                else:
                    p.add_(step)
    save_drafter(head, out)
    return out


def test_heads_come_back_from_their_parts_with_the_lm_head_from_the_target(target, tmp_path, repo_script):
    pack = repo_script("device/heads_pack")
    vocab = ModelConfig.from_dir(target).vocab_size
    heads = {"peagle": trained_head(target, "peagle", tmp_path / "p", vocab // 2, 0),
             "eagle3": trained_head(target, "eagle3", tmp_path / "e", None, 1),
             "trained-lm": trained_head(target, "peagle", tmp_path / "t", vocab // 2, 2, train_lm_head=True),
             "few-rows": trained_head(target, "peagle", tmp_path / "f", vocab // 2, 4, embedding_rows=[3, 17, 40]),
             "frozen-embedding": trained_head(target, "eagle3", tmp_path / "z", None, 5, embedding_rows=[])}
    moved_rows = {"few-rows": [3, 17, 40], "frozen-embedding": []}
    assert pack.main(["pack", "--target", str(target), "--out", str(tmp_path / "parts"), "--part-mib", "0.05",
                      *(f"{n}={d}" for n, d in heads.items())]) == 0
    manifest = json.loads((tmp_path / "parts" / "manifest.json").read_text())
    assert [manifest["heads"][n]["from_target"] for n in heads] == [True, True, False, True, True]
    # Only the embedding rows training changed travel (every row moved in the first three heads).
    assert [manifest["heads"][n]["embedding_rows_changed"] for n in heads] == [None, None, None, 3, 0]
    # Every stored tensor deflated in byte planes, the embedding's (whole, or its changed rows) XORed with the target's.
    assert manifest["format"] == 2
    for name, head in manifest["heads"].items():
        embedding = "embed_tokens.weight@changed" if name in moved_rows else "embed_tokens.weight"
        assert {k: s["encoding"] for k, s in head["packed"].items()} == {
            k: "xor-target+byteplanes+zlib" if k == embedding else "byteplanes+zlib" for k in head["packed"]}
    assert all(len(h["parts"]) > 1 for h in manifest["heads"].values())
    assert all(p.stat().st_size <= 0.05 * 2**20 for p in (tmp_path / "parts").glob("*.part-*"))
    # The parts travel in several folders; the heads are rebuilt once all their parts are found.
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    for i, p in enumerate(sorted((tmp_path / "parts").iterdir())):
        p.rename(tmp_path / ("a" if i % 2 else "b") / p.name)
    assert pack.main(["unpack", "--target", str(target), "--out", str(tmp_path / "heads"), str(tmp_path / "a"),
                      str(tmp_path / "b")]) == 0
    config = ModelConfig.from_dir(target)
    for name, original in heads.items():
        a = load_drafter(original, config)
        b = load_drafter(tmp_path / "heads" / name, config)
        assert a.config == b.config
        sa, sb = a.state_dict(), b.state_dict()
        assert list(sa) == list(sb)
        exact = {"lm_head.weight"} if manifest["heads"][name]["from_target"] else set()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, key
            # The frozen lm_head exact (the target's rows), every other float tensor rounded to bf16.
            rounded = sa[key].is_floating_point() and key not in exact
            expected = sa[key].to(torch.bfloat16).to(sa[key].dtype) if rounded else sa[key]
            if key == "embed_tokens.weight" and name in moved_rows:  # rows left as the target's: exact
                rows = moved_rows[name]
                expected = sa[key].clone()
                expected[rows] = sa[key][rows].to(torch.bfloat16).to(sa[key].dtype)
                assert not torch.equal(expected, sa[key].to(torch.bfloat16).to(sa[key].dtype))
            assert torch.equal(sb[key], expected), (name, key)
    assert "lm_head.weight" in load_file(str(tmp_path / "heads" / "peagle" / "model.safetensors"))


def test_a_missing_or_corrupt_part_is_never_unpacked(target, tmp_path, repo_script, capsys):
    pack = repo_script("device/heads_pack")
    head = trained_head(target, "eagle3", tmp_path / "e", None, 3)
    assert pack.main(["pack", "--target", str(target), "--out", str(tmp_path / "parts"), "--part-mib", "0.05",
                      f"eagle3={head}"]) == 0
    parts = sorted((tmp_path / "parts").glob("eagle3.part-*"))
    last = parts[-1].read_bytes()
    parts[-1].unlink()
    assert pack.main(["unpack", "--target", str(target), "--out", str(tmp_path / "heads"), str(tmp_path / "parts")]) == 1
    assert "parts not here yet" in capsys.readouterr().out and not (tmp_path / "heads" / "eagle3").exists()
    parts[-1].write_bytes(last[:-1] + bytes([last[-1] ^ 1]))
    with pytest.raises(ValueError, match="checksum differs"):
        pack.main(["unpack", "--target", str(target), "--out", str(tmp_path / "heads"), str(tmp_path / "parts")])
    assert not (tmp_path / "heads" / "eagle3").exists()


def joined(parts_dir, head: dict) -> bytes:
    return b"".join((parts_dir / p["file"]).read_bytes() for p in head["parts"])


def forge_checksums(parts_dir, manifest: dict, name: str) -> None:
    """The manifest's part checksums made those of the parts as they are now, so that only the decoding and the
    rebuilt tensors' checksums stand between a changed part and a wrong head."""
    import hashlib

    head = manifest["heads"][name]
    for p in head["parts"]:
        p["sha256"] = hashlib.sha256((parts_dir / p["file"]).read_bytes()).hexdigest()
    head["sha256"] = hashlib.sha256(joined(parts_dir, head)).hexdigest()
    (parts_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_corrupt_deflated_stream_or_another_target_is_refused_even_past_the_part_checksums(
        target, tmp_path, repo_script):
    pack = repo_script("device/heads_pack")
    parts = tmp_path / "parts"
    head = trained_head(target, "eagle3", tmp_path / "e", None, 3)
    assert pack.main(["pack", "--target", str(target), "--out", str(parts), f"eagle3={head}"]) == 0
    manifest = json.loads((parts / "manifest.json").read_text())
    original = {p["file"]: (parts / p["file"]).read_bytes() for p in manifest["heads"]["eagle3"]["parts"]}

    def unpack(against=target):
        return pack.main(["unpack", "--target", str(against), "--out", str(tmp_path / "heads"), str(parts)])

    # A byte changed inside the embedding's deflated stream: inflating it fails, or the rebuilt embedding differs.
    streams = load(joined(parts, manifest["heads"]["eagle3"]))
    assert len(manifest["heads"]["eagle3"]["parts"]) == 1
    (part,) = original
    data = bytearray(original[part])
    data[data.index(streams["embed_tokens.weight"].numpy().tobytes()) + 100] ^= 0x10
    (parts / part).write_bytes(bytes(data))
    forge_checksums(parts, manifest, "eagle3")
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        unpack()
    # The parts intact, but another target of the same shape: its embedding is not the one the head's XOR was
    # taken against (nor its lm_head the head's).
    (parts / part).write_bytes(original[part])
    forge_checksums(parts, manifest, "eagle3")
    texts = [f"a sentence number {i} about drafts, tokens and the verifier's cache" for i in range(200)]
    other = write_tiny_checkpoint(tmp_path / "other", texts, seed=1)
    with pytest.raises(ValueError, match="embed_tokens.weight, lm_head.weight rebuilt differ"):
        unpack(other)
    assert not (tmp_path / "heads" / "eagle3").exists()
    assert unpack() == 0


def test_an_embedding_moved_a_bit_in_every_row_travels_whole_and_its_xor_with_the_target_deflates_to_little(
        target, tmp_path, repo_script):
    pack = repo_script("device/heads_pack")
    head = trained_head(target, "eagle3", tmp_path / "e", None, 6)
    tensors = load_file(head / "model.safetensors")
    embedding = TargetParts.from_dir(target).embedding.float().clone()
    embedding.view(torch.int32)[:, 0] ^= 1 << 16  # the lowest bit bf16 keeps, in the first column of every row
    tensors["embed_tokens.weight"] = embedding
    save_file(tensors, head / "model.safetensors")
    parts = tmp_path / "parts"
    assert pack.main(["pack", "--target", str(target), "--out", str(parts), f"eagle3={head}"]) == 0
    manifest = json.loads((parts / "manifest.json").read_text())
    packed = manifest["heads"]["eagle3"]
    assert packed["embedding_rows_changed"] is None  # every row moved: the whole embedding travels
    stream = load(joined(parts, packed))["embed_tokens.weight"]
    # A few bytes of the XOR differ from 0 in each row of 64 bf16 (128 bytes): a few percent of them travel.
    assert stream.numel() < 0.1 * packed["packed"]["embed_tokens.weight"]["raw_bytes"]
    assert pack.main(["unpack", "--target", str(target), "--out", str(tmp_path / "heads"), str(parts)]) == 0
    back = load_file(tmp_path / "heads" / "eagle3" / "model.safetensors")
    assert torch.equal(back["embed_tokens.weight"], embedding.to(torch.bfloat16).float())


def test_a_pack_of_the_first_format_unpacks_and_a_later_format_is_refused(target, tmp_path, repo_script):
    # Format 1 (no "format" key): the stored tensors as they are, in one safetensors file cut into parts; the frozen
    # lm_head left out, of the embedding only the changed rows with their indices.
    import hashlib

    pack = repo_script("device/heads_pack")
    vocab = ModelConfig.from_dir(target).vocab_size
    head = trained_head(target, "peagle", tmp_path / "p", vocab // 2, 7, embedding_rows=[3, 17, 40])
    tensors = load_file(head / "model.safetensors")
    kept = {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in tensors.items()
            if k not in ("lm_head.weight", "embed_tokens.weight")}
    rows = torch.tensor([3, 17, 40])
    kept["embed_tokens.weight@rows"] = rows
    kept["embed_tokens.weight@changed"] = tensors["embed_tokens.weight"][rows].to(torch.bfloat16)
    data = save(kept)
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "peagle.part-000").write_bytes(data)
    manifest = {"heads": {"peagle": {
        "config": json.loads((head / "config.json").read_text()),
        "parts": [{"file": "peagle.part-000", "sha256": hashlib.sha256(data).hexdigest()}],
        "sha256": hashlib.sha256(data).hexdigest(),
        "dtype": {k: str(t.dtype).removeprefix("torch.") for k, t in tensors.items()},
        "from_target": True, "embedding_rows_changed": 3}}}
    (parts / "manifest.json").write_text(json.dumps(manifest))
    assert pack.main(["unpack", "--target", str(target), "--out", str(tmp_path / "heads"), str(parts)]) == 0
    back = load_file(tmp_path / "heads" / "peagle" / "model.safetensors")
    assert set(back) == set(tensors)
    for key, t in tensors.items():
        expected = t if key == "lm_head.weight" else t.to(torch.bfloat16).to(t.dtype)
        if key == "embed_tokens.weight":  # the rows left as the target's exact
            expected = t.clone()
            expected[rows] = t[rows].to(torch.bfloat16).to(t.dtype)
        assert torch.equal(back[key], expected), key
    manifest["format"] = 3
    (parts / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="format 3, this heads_pack reads up to 2"):
        pack.main(["unpack", "--target", str(target), "--out", str(tmp_path / "again"), str(parts)])


def test_heads_out_takes_the_testbeds_heads_once_their_training_has_logged_its_end(target, tmp_path):
    # run.sh heads_out beside the testbed's served step (the heads are final, the testbed still runs): refused with
    # exit 5 while the heads step has not logged its end, then the parts of both heads, which unpack to the heads.
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    work, cwd = tmp_path / "work", tmp_path / "cwd"
    cwd.mkdir()
    for d in ("scripts", "src"):  # run.sh runs from the repository root; no .whl here, so nothing to install
        (cwd / d).symlink_to(repo / d)
    shutil.copytree(target, work / "tb" / "model")
    for i, m in enumerate(("peagle", "eagle3")):
        trained_head(work / "tb" / "model", m, work / "tb" / "heads" / "h200" / m / "final", None, i)
    log = ("2026-12-05 17:24:16,012 INFO peagle.bench.testbed: training eagle3 and peagle side by side for 13.47 "
           "minutes\n")
    (work / "testbed.log").write_text(log)
    env = {**os.environ, "PEAGLE_WORK": str(work), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}

    def heads_out():
        return subprocess.run(["bash", "scripts/device/run.sh", "heads_out"], cwd=cwd, env=env, text=True,
                              capture_output=True, timeout=600)

    r = heads_out()
    assert r.returncode == 5 and "still training" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
    (work / "testbed.log").write_text(log + "2026-12-05 17:38:11,273 INFO peagle.bench.testbed: testbed [13/14] "
                                            "heads: 835.2 s of its 858 s limit: eagle3: 1 layer\n")
    r = heads_out()
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert set(manifest["heads"]) == {"peagle", "eagle3"}
    pack = subprocess.run([sys.executable, "scripts/device/heads_pack.py", "unpack", "--target",
                           str(work / "tb" / "model"), "--out", str(tmp_path / "back"), str(tmp_path / "out")],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    assert pack.returncode == 0, pack.stdout + pack.stderr
    for m in ("peagle", "eagle3"):
        want = load_file(work / "tb" / "heads" / "h200" / m / "final" / "model.safetensors")
        got = load_file(tmp_path / "back" / m / "model.safetensors")
        assert set(got) == set(want)
        for name, t in want.items():  # the frozen lm_head exact (the target's rows), the rest rounded to bf16
            expected = t if name == "lm_head.weight" else t.to(torch.bfloat16).to(t.dtype)
            assert torch.equal(got[name], expected), (m, name)
