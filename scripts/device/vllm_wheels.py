#!/usr/bin/env python3
"""vLLM for the GPU machine, staged on this one: vLLM's wheel in checksummed parts and the wheels of the requirements
the GPU image lacks, packed into folders that one device call each can carry (scripts/device/stage_local.sh vllm runs
this; the vllm_part and vllm_stage stages of scripts/device/stages.py take them on the GPU machine).

    python3 scripts/device/vllm_wheels.py --budget BYTES [--version 0.25.0] [--dl DIR] [--into .]

The GPU machine runs Python 3.12 on Linux x86-64, and its image holds IMAGE (KINDS.md of the device tool; versions
where a session read them). From vllm==VERSION's Requires-Dist (extras left out), every requirement the image does not
meet is downloaded with `pip download --no-deps` at the newest version whose own requirements agree with the exact
versions known so far (vLLM's == pins, the image's versions, what was chosen before), and its requirements are
followed in turn. SKIP leaves out, with why, the GPU kernel and media packages that vLLM imports only on paths these
benchmarks do not take; the first device call (vllm_stage) names any requirement still unmet.

Leaves under --dl (default $TMPDIR/peagle-stage/vllm): the downloads and manifest.json (every wheel's name, version,
size and sha256; vLLM's parts and their sums; what the image meets; what was skipped and why; version conflicts). Under
--into: folders .vllm_a, .vllm_b, ... of at most --budget bytes each (what a call may carry beside the working tree):
one part of vLLM's wheel each, the other wheels in the room left, manifest.json in every folder.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

MIB = 1 << 20
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
# The GPU machine's markers: Python 3.12, Linux, x86-64.
MARKERS = {**default_environment(), "python_version": PYTHON, "python_full_version": f"{PYTHON}.3",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
# The GPU image's Python packages (KINDS.md, 2026-11-17), with the versions a session's pip list showed.
IMAGE_VERSIONS = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2", "torch": "2.11.0", "torchaudio": "2.11.0",
    "torchvision": "0.26.0", "transformers": "5.17.0", "triton": "3.6.0",
}
IMAGE = set(IMAGE_VERSIONS) | set("""
absl-py aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click
cloudpickle cmake colorama cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x einops filelock
frozenlist fsspec grpcio h11 h5py hf-xet httpcore httpx humanize idna imageio jinja2 joblib lightning-utilities
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict networkx ninja
numba nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx opencv-python-headless packaging pandas pillow pip protobuf
psutil py-cpuinfo pyarrow pybind11 pygments pyparsing python-dateutil pyyaml regex requests rich scipy setuptools
shellingham six sympy tqdm typer typing-extensions urllib3 uvloop wheel wrapt xxhash yarl zipp propcache
""".split())
# Requirements left out on purpose: GPU kernel libraries of backends that Hopper does not pick for a dense model
# (FLASH_ATTN leads vLLM's list there; FlashInfer, CuTe DSL, TileLang and MLA kernels come after it or serve other
# models), video and audio decoding, and optional loaders. The image's torch stack is never replaced.
SKIP = {
    "flashinfer-python": "FlashInfer attention and sampling: FLASH_ATTN leads on Hopper; greedy sampling is an argmax",
    "flashinfer-cubin": "FlashInfer's kernels (with flashinfer-python)",
    "tilelang": "TileLang kernels (sparse attention, MoE): not a dense model's path",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (FlashAttention 4 on Blackwell, GDN): not Hopper's dense path",
    "quack-kernels": "CuTe DSL kernels (with nvidia-cutlass-dsl)",
    "tokenspeed-mla": "MLA attention: not these models",
    "humming-kernels": "quantised GEMM kernels: these models are bf16",
    "pynvvideocodec": "video decoding",
    "torchcodec": "audio and video decoding",
    "nvidia-cudnn-frontend": "cuDNN attention: FLASH_ATTN leads on Hopper",
    "fastsafetensors": "an optional GPU-direct weight loader (load_format fastsafetensors)",
    "nvtx": "profiling ranges",
    "mistral-common": "Mistral's tokenizers (tokenizer_mode mistral); it also wants a numpy older than the image's",
    "anthropic": "the Anthropic-compatible API server",
    "mcp": "the server's tool calling over MCP",
    "opentelemetry-sdk": "request tracing (--otlp-traces-endpoint)",
    "opentelemetry-exporter-otlp": "request tracing (--otlp-traces-endpoint)",
    "opentelemetry-semantic-conventions-ai": "request tracing (--otlp-traces-endpoint)",
}
# vLLM's exact pins that are left loose, and why: the pin serves a skipped package, and keeping it costs a call.
LOOSE = {
    "apache-tvm-ffi": "pinned for FlashInfer and the CuTe DSL (skipped); xgrammar from 0.2.6 (1.3 MiB where 0.2.3, "
                      "the newest that takes 0.1.9 and transformers 5, is 43 MiB) wants 0.1.10 or later",
}
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*)$")  # the image's CUDA stack stays


def pip_download(spec: str, dest: Path) -> Path:
    """`pip download --no-deps` of one requirement for the GPU machine's Python and platform; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
           "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(dest), spec]
    done = subprocess.run(cmd, capture_output=True, text=True)
    saved = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", done.stdout)
    if done.returncode or not saved:
        raise RuntimeError(f"pip download {spec}: {(done.stderr.strip().splitlines() or ['no wheel saved'])[-1]}")
    return Path(saved[-1]).resolve()


def requirements(wheel: Path) -> list[Requirement]:
    """A wheel's Requires-Dist that hold on the GPU machine, extras left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({**MARKERS, "extra": ""}):
                out.append(req)
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


class Resolver:
    """vLLM's missing requirements, breadth first from vLLM's own (module docstring)."""

    def __init__(self, dest: Path):
        self.dest = dest
        self.known: dict[str, Version] = {n: Version(v) for n, v in IMAGE_VERSIONS.items()}  # exact versions
        self.chosen: dict[str, dict] = {}
        self.met: dict[str, str] = {}
        self.skipped: dict[str, dict] = {}
        self.conflicts: list[str] = []

    def resolve(self, roots: list[Requirement]) -> None:
        roots = [Requirement(req.name) if canonicalize_name(req.name) in LOOSE else req for req in roots]
        for req in roots:  # vLLM's exact pins bind before anything else is chosen
            pinned = [s for s in req.specifier if s.operator == "=="]
            if pinned and canonicalize_name(req.name) not in self.known:
                self.known[canonicalize_name(req.name)] = Version(pinned[0].version)
        queue = [(req, "vllm") for req in roots]
        while queue:
            req, parent = queue.pop(0)
            for dep in self.take(req, parent):
                queue.append((dep, canonicalize_name(req.name)))

    def take(self, req: Requirement, parent: str) -> list[Requirement]:
        """The requirements of what `req` brought in (none when the image, a skip or an earlier choice meets it)."""
        name = canonicalize_name(req.name)
        if name in SKIP:
            self.skipped.setdefault(name, {"spec": str(req), "why": SKIP[name], "required_by": parent})
            return []
        if name in IMAGE or NEVER.match(name):  # never replaced: the image's torch stack is built against them
            have = IMAGE_VERSIONS.get(name)
            if have is not None and not req.specifier.contains(have, prereleases=True):
                self.conflicts.append(f"{parent} needs {req}; the image has {have}")
            self.met.setdefault(name, have or "(version not read)")
            return []
        if name in self.chosen:
            version = self.chosen[name]["version"]
            if not req.specifier.contains(version, prereleases=True):
                self.conflicts.append(f"{parent} needs {req}; {name} {version} was chosen")
            return []
        wheel, deps = self.newest_agreeing(req)
        version = str(parse_wheel_filename(wheel.name)[1])
        self.chosen[name] = {"name": name, "version": version, "file": wheel.name, "size": wheel.stat().st_size,
                             "sha256": sha256(wheel), "required_by": parent}
        self.known.setdefault(name, Version(version))
        return deps

    def newest_agreeing(self, req: Requirement, tries: int = 12) -> tuple[Path, list[Requirement]]:
        """The newest wheel meeting `req` whose own requirements allow every exact version known so far; when none
        does (say, a numpy older than the image's), the newest one, its clashes recorded as conflicts."""
        name, excluded, newest = canonicalize_name(req.name), [], None
        for _ in range(tries):
            spec = ",".join([str(req.specifier)] * bool(str(req.specifier)) + [f"!={v}" for v in excluded])
            try:
                wheel = pip_download(f"{name}{spec}", self.dest)
            except RuntimeError:
                if newest is None:
                    raise
                break
            deps = requirements(wheel)
            clash = [d for d in deps if canonicalize_name(d.name) in self.known
                     and not d.specifier.contains(self.known[canonicalize_name(d.name)], prereleases=True)]
            if not clash:
                return wheel, deps
            newest = newest or (wheel, deps, clash)
            excluded.append(str(parse_wheel_filename(wheel.name)[1]))
        wheel, deps, clash = newest
        version = parse_wheel_filename(wheel.name)[1]
        self.conflicts += [f"{name} {version} needs {d}; {canonicalize_name(d.name)} "
                           f"{self.known[canonicalize_name(d.name)]} is what the machine has" for d in clash]
        return pip_download(f"{name}=={version}", self.dest), deps


def cut(wheel: Path, part_bytes: int, dest: Path) -> list[dict]:
    """WHEEL cut into parts of at most PART_BYTES in DEST (vllm.whl.part-00, ...), each with its sha256."""
    parts = []
    with open(wheel, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            path = dest / f"vllm.whl.part-{i:02d}"
            path.write_bytes(block)
            parts.append({"file": path.name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    return parts


def pack(manifest: dict, dl: Path, into: Path, budget: int) -> list[Path]:
    """The folders .vllm_a, .vllm_b, ...: a part of vLLM's wheel each, then the other wheels, largest first, where
    the most room is left; more folders only when a wheel fits nowhere."""
    for old in into.glob(".vllm_*"):
        shutil.rmtree(old)
    text = json.dumps(manifest, indent=1)
    room = budget - len(text)
    files = [(p["file"], p["size"]) for p in manifest["vllm"]["parts"]]
    if max(size for _, size in files) > room:
        raise SystemExit(f"a part of {max(s for _, s in files)} bytes does not fit a call's {room}: lower --part-mib")
    folders: list[tuple[list[str], int]] = [([name], room - size) for name, size in files]
    for dep in sorted(manifest["deps"], key=lambda d: -d["size"]):
        best = max(range(len(folders)), key=lambda i: folders[i][1])
        if folders[best][1] < dep["size"]:
            folders.append(([], room))
            best = len(folders) - 1
        folders[best][0].append(dep["file"])
        folders[best] = (folders[best][0], folders[best][1] - dep["size"])
    out = []
    for i, (names, _) in enumerate(folders):
        folder = into / f".vllm_{chr(97 + i)}"
        folder.mkdir()
        (folder / "manifest.json").write_text(text)
        for name in names:
            shutil.copy(dl / name, folder / name)
        out.append(folder)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default="0.25.0", help="vLLM's version (default 0.25.0: the newest for torch 2.11)")
    ap.add_argument("--budget", type=int, required=True, help="bytes one call may carry beside the working tree")
    ap.add_argument("--part-mib", type=float, help="the most a part of vLLM's wheel holds (default: the budget less "
                    "1 MiB); the parts are of equal size")
    ap.add_argument("--dl", type=Path, default=Path(os.environ.get("TMPDIR") or "/tmp") / "peagle-stage" / "vllm")
    ap.add_argument("--into", type=Path, default=Path("."), help="where the .vllm_* folders go (the checkout)")
    args = ap.parse_args(argv)
    args.dl.mkdir(parents=True, exist_ok=True)
    wheel = pip_download(f"vllm=={args.version}", args.dl)
    resolver = Resolver(args.dl)
    resolver.resolve(requirements(wheel))
    size = wheel.stat().st_size
    most = int(args.part_mib * MIB) if args.part_mib else args.budget - MIB
    part_bytes = -(-size // -(-size // most))  # as few parts as fit, of equal size: the room left goes to the rest
    manifest = {
        "vllm": {"version": args.version, "file": wheel.name, "size": wheel.stat().st_size, "sha256": sha256(wheel),
                 "parts": cut(wheel, part_bytes, args.dl)},
        "deps": sorted(resolver.chosen.values(), key=lambda d: d["name"]),
        "met_by_image": dict(sorted(resolver.met.items())),
        "skipped": dict(sorted(resolver.skipped.items())),
        "loose": LOOSE,
        "conflicts": resolver.conflicts,
    }
    (args.dl / "manifest.json").write_text(json.dumps(manifest, indent=1))
    folders = pack(manifest, args.dl, args.into, args.budget)
    deps_mib = sum(d["size"] for d in manifest["deps"]) / MIB
    print(f"vllm {args.version}: {manifest['vllm']['size'] / MIB:.1f} MiB in {len(manifest['vllm']['parts'])} parts; "
          f"{len(manifest['deps'])} other wheels, {deps_mib:.1f} MiB; {len(manifest['skipped'])} skipped; "
          f"{len(folders)} folders ({', '.join(f.name for f in folders)}), one a call")
    for line in resolver.conflicts:
        print(f"conflict: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
