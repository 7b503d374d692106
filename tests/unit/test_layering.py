"""The packages of peagle form layers: a module imports its own package and those below it, never one above,
not even inside a function."""

import ast
import subprocess
import sys
from pathlib import Path

import peagle

# Lowest first. The package root (`import peagle`, its version) is open to all; its lazy names are the engine's.
LAYERS = ("datasets", "kernels", "models", "drafters", "engine", "server", "training", "bench", "cli")
ROOT_NAMES = {"LLM": "engine", "SamplingParams": "engine"}
SRC = Path(peagle.__file__).parent


def layer_of_module(parts: tuple[str, ...]) -> str | None:
    """The layer of `peagle.<parts>`: its package, or the module itself for one beside them; None for the root."""
    if not parts or parts == ("__init__",):
        return None
    return "cli" if parts[0] == "__main__" else parts[0]


def imported_layers(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, layer) of every peagle import in a module, function-local ones included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("peagle.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "peagle":
                continue
            if len(parts) > 1:
                found.append((node.lineno, parts[1]))
            else:  # from peagle import X: a package, a module beside them, or a lazy name of the root
                found += [(node.lineno, ROOT_NAMES.get(a.name, a.name)) for a in node.names]
    return found


def test_imports_point_only_downwards():
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        own = layer_of_module(parts)
        if own is None:
            continue
        assert own in LAYERS, f"{path}: add package {own!r} to LAYERS, in its place"
        for line, target in imported_layers(ast.parse(path.read_text(), str(path))):
            assert target in LAYERS, f"{path}:{line}: import of unknown package {target!r}"
            if LAYERS.index(target) > LAYERS.index(own):
                upward.append(f"{path.relative_to(SRC.parent)}:{line}: {own} imports {target}")
    assert not upward, "imports running up the layers:\n" + "\n".join(upward)


def test_the_engine_parses_a_speculative_config_without_bench_or_torch():
    code = ("import sys, peagle.engine.config; "
            "print(sorted(m for m in ('torch', 'peagle.bench', 'peagle.training') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
