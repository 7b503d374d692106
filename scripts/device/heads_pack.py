"""Trained heads in parts small enough to come back from the GPU machine and travel to a fresh one again.

What for: a look at the heads on the development machine, or the same heads on a new machine of the same session
(a machine goes back after 30 s idle). Not across sessions: a session starts from a fresh checkout, where the
parts (about 150 MB of tensors for the testbed's pair, deflated to some 60%) are gone, and they cannot be part of
the repository.

A head's frozen lm_head is the target's own rows of the draft vocabulary: it is left out (checked bit for bit) and
rebuilt from the target on unpacking. Its token embedding starts as the target's, and rows that training left as
they were (tokens never read, or all but P-EAGLE's MASK row with `--freeze-embeddings`) are left out too: only the
changed rows travel, with their indices. The other tensors are stored in bf16 (what the engine serves in) unless
--dtype keep. Each stored tensor is then deflated losslessly: the embedding's rows XORed with the target's rows they
started as (trained rows stay close to them, so sign and exponent bits mostly cancel), every tensor's bytes in byte
planes (all first bytes, then all second bytes, ...: the exponent bytes together), zlib. Each head's file is cut into
parts of at most --part-mib, listed with their checksums in manifest.json, with the checksum of every tensor that
unpack writes.

    python scripts/device/heads_pack.py pack --target MODEL --out DIR NAME=HEAD_DIR [NAME=HEAD_DIR ...]
    python scripts/device/heads_pack.py unpack --target MODEL --out DIR PARTS_DIR [PARTS_DIR ...]

unpack writes DIR/NAME (config.json, model.safetensors) for every head whose parts are all found in the PARTS_DIRs,
and refuses a part whose checksum differs or a head that cannot be rebuilt bit for bit from this target. It reads the
packs of the earlier format too (format 1: the stored tensors as they are, without the per-tensor checksums).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import zlib
from pathlib import Path

import numpy
import torch
from safetensors.torch import load, load_file, save, save_file

MANIFEST = "manifest.json"
FROM_TARGET = "lm_head.weight"  # the tensor rebuilt from the target's rows
EMBED = "embed_tokens.weight"  # rebuilt from the target's embedding and the rows training changed:
EMBED_ROWS, EMBED_CHANGED = f"{EMBED}@rows", f"{EMBED}@changed"  # their indices and values in the pack
FORMAT = 2  # 1: the stored tensors as they are; 2: each deflated (ENCODING), and the rebuilt tensors' checksums
ENCODING, XOR_ENCODING = "byteplanes+zlib", "xor-target+byteplanes+zlib"  # the latter the embedding's


def target_lm_head(target: Path) -> torch.Tensor:
    """The target's output projection [vocab, hidden] (its input embedding where the two are tied), as peagle reads
    it when it builds a head for the target."""
    from peagle.drafters.target import TargetParts

    return TargetParts.from_dir(target).output_weight


def target_embedding(target: Path) -> torch.Tensor:
    """The target's input embedding [vocab, hidden], which a head's embed_tokens starts as."""
    from peagle.drafters.target import TargetParts

    return TargetParts.from_dir(target).embedding


def draft_rows(tensors: dict[str, torch.Tensor], vocab: int) -> torch.Tensor:
    """The target ids of the draft vocabulary's rows: draft id + d2t (the whole vocabulary without d2t)."""
    if "d2t" in tensors:
        d2t = tensors["d2t"].long()
        return torch.arange(d2t.numel()) + d2t
    return torch.arange(vocab)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def stored(t: torch.Tensor, dtype: str) -> torch.Tensor:
    return t.to(torch.bfloat16) if dtype == "bfloat16" and t.is_floating_point() else t


def as_bytes(t: torch.Tensor) -> numpy.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def xor(t: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """t's bit patterns XORed with reference's (in t's dtype): the same XOR undoes it."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return (t.view(ints) ^ reference.to(t.dtype).view(ints)).view(t.dtype)


def deflated(t: torch.Tensor) -> torch.Tensor:
    """t's bytes in byte planes, deflated. Z_RLE: the bytes of floats hardly ever repeat, so the default strategy's
    string matching gains nothing there (its output came out 1-5% larger, in 5-7 times the time); runs of equal
    bytes (the XOR's zeros) RLE still takes."""
    planes = as_bytes(t).reshape(-1, t.element_size()).T.copy()
    z = zlib.compressobj(6, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    return torch.frombuffer(bytearray(z.compress(planes) + z.flush()), dtype=torch.uint8)


def inflated(name: str, key: str, stream: torch.Tensor, spec: dict) -> torch.Tensor:
    """The tensor `deflated` made `stream` of, as `spec` (its manifest entry) describes it."""
    if spec["encoding"] not in (ENCODING, XOR_ENCODING):
        raise ValueError(f"{name}: {key}: unknown encoding {spec['encoding']!r} (packed by a later heads_pack?)")
    try:
        raw = zlib.decompress(stream.numpy())
    except zlib.error as e:
        raise ValueError(f"{name}: {key}: {e}") from e
    if len(raw) != spec["raw_bytes"]:
        raise ValueError(f"{name}: {key}: {len(raw)} bytes inflated, the manifest says {spec['raw_bytes']}")
    dtype = getattr(torch, spec["dtype"])
    planes = torch.from_numpy(numpy.frombuffer(bytearray(raw), dtype=numpy.uint8))  # numpy: an empty one too
    size = torch.empty(0, dtype=dtype).element_size()
    return planes.reshape(size, -1).T.reshape(-1).view(dtype).reshape(spec["shape"])


def rebuilt(tensors: dict[str, torch.Tensor], kept: dict[str, torch.Tensor], dtype: str) -> dict[str, str]:
    """The checksum of every tensor as unpack will write it: the frozen lm_head and the embedding rows left as the
    target's exact, the rest rounded to the stored dtype (and back)."""
    out = {key: t if key == FROM_TARGET and key not in kept else stored(t, dtype).to(t.dtype)
           for key, t in tensors.items()}
    if EMBED_ROWS in kept:
        out[EMBED] = tensors[EMBED].clone()
        out[EMBED][kept[EMBED_ROWS]] = kept[EMBED_CHANGED].to(out[EMBED].dtype)
    return {key: sha256(as_bytes(t)) for key, t in out.items()}


def pack(target: Path, heads: dict[str, Path], out: Path, part_mib: float, dtype: str) -> dict:
    lm_head, embedding = target_lm_head(target), target_embedding(target)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"format": FORMAT, "heads": {}}
    for name, head in heads.items():
        tensors = load_file(str(head / "model.safetensors"))
        kept, references = {}, {}  # references: the target's rows the embedding's stored rows started as
        for key, t in tensors.items():
            if key == FROM_TARGET:
                rows = lm_head[draft_rows(tensors, t.shape[0])].to(t.dtype)
                if t.shape == rows.shape and torch.equal(t, rows):
                    continue  # frozen: the target's rows, rebuilt on unpacking
            if key == EMBED and t.shape == embedding.shape:
                changed = (t != embedding.to(t.dtype)).any(dim=1).nonzero().flatten()
                if changed.numel() < t.shape[0]:  # the rows left as the target's are rebuilt on unpacking
                    kept[EMBED_ROWS], kept[EMBED_CHANGED] = changed, stored(t[changed], dtype)
                    references[EMBED_CHANGED] = embedding[changed]
                    continue
                references[EMBED] = embedding
            kept[key] = stored(t, dtype)
        packed = {key: {"encoding": XOR_ENCODING if key in references else ENCODING, "dtype": dtype_name(t),
                        "shape": list(t.shape), "raw_bytes": t.numel() * t.element_size()} for key, t in kept.items()}
        data = save({key: deflated(xor(t, references[key]) if key in references else t) for key, t in kept.items()})
        step = int(part_mib * 2**20)
        parts = []
        for i in range(0, len(data), step):
            part = out / f"{name}.part-{i // step:03d}"
            part.write_bytes(data[i:i + step])
            parts.append({"file": part.name, "sha256": sha256(data[i:i + step])})
        manifest["heads"][name] = {
            "config": json.loads((head / "config.json").read_text()), "parts": parts, "sha256": sha256(data),
            "dtype": {key: dtype_name(t) for key, t in tensors.items()},
            "from_target": FROM_TARGET not in kept and FROM_TARGET in tensors,
            "embedding_rows_changed": int(kept[EMBED_ROWS].numel()) if EMBED_ROWS in kept else None,
            "packed_bytes": len(data), "packed": packed, "rebuilt_sha256": rebuilt(tensors, kept, dtype),
        }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def started_as(name: str, embedding: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Refuses a target whose embedding the head's stored embedding (or rows of it) cannot have started as."""
    if EMBED_ROWS in tensors:
        rows, width = tensors[EMBED_ROWS], tensors[EMBED_CHANGED].shape[1]
        fits = embedding.shape[1] == width and bool((rows < embedding.shape[0]).all())
    else:
        fits, width = embedding.shape == tensors[EMBED].shape, tensors[EMBED].shape[1]
    if not fits:
        raise ValueError(f"{name}: the target's embedding is {tuple(embedding.shape)}, not one the head's "
                         f"({width} wide) started as")


def unpack(target: Path, parts_dirs: list[Path], out: Path) -> list[str]:
    """The heads whose parts are all present, rebuilt under out/NAME; returns their names."""
    manifests = [d / MANIFEST for d in parts_dirs if (d / MANIFEST).is_file()]
    if not manifests:
        raise FileNotFoundError(f"no {MANIFEST} in {', '.join(map(str, parts_dirs))}")
    manifest = json.loads(manifests[0].read_text())
    if manifest.get("format", 1) > FORMAT:
        raise ValueError(f"{manifests[0]}: format {manifest['format']}, this heads_pack reads up to {FORMAT}")
    where = {p.name: p for d in parts_dirs for p in d.glob("*.part-*")}
    lm_head = None
    done = []
    for name, head in manifest["heads"].items():
        missing = [p["file"] for p in head["parts"] if p["file"] not in where]
        if missing:
            print(f"{name}: {len(missing)} of {len(head['parts'])} parts not here yet ({missing[0]} ...)")
            continue
        data = b""
        for p in head["parts"]:
            chunk = where[p["file"]].read_bytes()
            if sha256(chunk) != p["sha256"]:
                raise ValueError(f"{where[p['file']]}: checksum differs from the manifest's")
            data += chunk
        if sha256(data) != head["sha256"]:
            raise ValueError(f"{name}: the joined parts' checksum differs from the manifest's")
        tensors = load(data)
        if "packed" in head:  # format 2: every tensor deflated (format 1: as they are)
            tensors = {key: inflated(name, key, tensors[key], spec) for key, spec in head["packed"].items()}
        xored = [key for key, spec in head.get("packed", {}).items() if spec["encoding"] == XOR_ENCODING]
        if EMBED_ROWS in tensors or xored:
            embedding = target_embedding(target)
            started_as(name, embedding, tensors)
            for key in xored:  # the same XOR again: the head's own bits
                tensors[key] = xor(tensors[key], embedding[tensors[EMBED_ROWS]] if key == EMBED_CHANGED else embedding)
        if EMBED_ROWS in tensors:
            rows, changed = tensors.pop(EMBED_ROWS), tensors.pop(EMBED_CHANGED)
            embedding = embedding.to(getattr(torch, head["dtype"][EMBED]))
            embedding[rows] = changed.to(embedding.dtype)
            tensors[EMBED] = embedding
        if head["from_target"]:
            lm_head = target_lm_head(target) if lm_head is None else lm_head
            vocab = head["config"].get("draft_vocab_size") or lm_head.shape[0]
            rows = lm_head[draft_rows(tensors, vocab)]
            hidden = tensors["embed_tokens.weight"].shape[1] if "embed_tokens.weight" in tensors else rows.shape[1]
            if rows.shape[1] != hidden:
                raise ValueError(f"{name}: the target's lm_head rows are {rows.shape[1]} wide, the head {hidden}")
            tensors[FROM_TARGET] = rows
        # Each tensor in its stored dtype again (bf16 rounding stays: the engine serves in bf16).
        tensors = {k: t.to(getattr(torch, head["dtype"].get(k, dtype_name(t)))).contiguous()
                   for k, t in tensors.items()}
        if "rebuilt_sha256" in head:  # format 2: bit for bit the head that was packed, or nothing written
            wrong = [k for k in sorted({*tensors, *head["rebuilt_sha256"]})
                     if k not in tensors or sha256(as_bytes(tensors[k])) != head["rebuilt_sha256"].get(k)]
            if wrong:
                raise ValueError(f"{name}: {', '.join(wrong)} rebuilt differ from the packed head's (packed against "
                                 f"another target?)")
        dest = out / name
        dest.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(dest / "model.safetensors"))
        (dest / "config.json").write_text(json.dumps(head["config"], indent=2) + "\n")
        done.append(name)
        print(f"{name}: {dest} ({len(tensors)} tensors)")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="heads into parts")
    p.add_argument("--target", type=Path, required=True, help="the target checkpoint the heads were trained for")
    p.add_argument("--out", type=Path, required=True, help="directory for the parts and manifest.json")
    p.add_argument("--part-mib", type=float, default=15.0, help="largest part in MiB (default 15)")
    p.add_argument("--dtype", choices=("bfloat16", "keep"), default="bfloat16",
                   help="the stored tensors' dtype (default bfloat16, the engine's)")
    p.add_argument("heads", nargs="+", metavar="NAME=HEAD_DIR")
    u = sub.add_parser("unpack", help="parts into heads")
    u.add_argument("--target", type=Path, required=True)
    u.add_argument("--out", type=Path, required=True, help="directory to write NAME/ heads into")
    u.add_argument("parts", nargs="+", type=Path, metavar="PARTS_DIR")
    args = parser.parse_args(argv)
    if args.command == "pack":
        heads = {}
        for item in args.heads:
            name, sep, path = item.partition("=")
            if not sep or not name:
                parser.error(f"{item!r}: expected NAME=HEAD_DIR")
            heads[name] = Path(path)
        manifest = pack(args.target, heads, args.out, args.part_mib, args.dtype)
        for name, head in manifest["heads"].items():
            rows = head["embedding_rows_changed"]
            stored_mb = sum(p["raw_bytes"] for p in head["packed"].values()) / 1e6
            print(f"{name}: {len(head['parts'])} parts ({head['packed_bytes'] / 1e6:.1f} MB deflated of "
                  f"{stored_mb:.1f} MB), lm_head {'from the target' if head['from_target'] else 'kept'}, "
                  f"embedding {'whole' if rows is None else f'{rows} changed rows'}")
        return 0
    return 0 if unpack(args.target, args.parts, args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
