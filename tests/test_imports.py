"""Imports run downhill: no cycle between strata modules, and the layering rules hold.

Every import of every module under strata/ is read from its source (ast: module level, inside
functions, under `if TYPE_CHECKING`), without importing anything, so a cycle hidden in a function
body or a type-only import counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "strata"

# (importing package, imported package): packages that must never import the other. The
# engine drives the model and the experts, so neither reaches up into it; kernels sit below
# all of them
FORBIDDEN = [
    *(("strata.kernels", p) for p in ("strata.model", "strata.engine", "strata.experts",
                                      "strata.server", "strata.cli")),
    # the device primitives (KV cache, bounded waits) sit below everything that runs a model
    *(("strata.runtime", p) for p in ("strata.model", "strata.engine", "strata.experts",
                                      "strata.kernels", "strata.server", "strata.cli")),
    ("strata.tokenizer", "strata.engine"),
    ("strata.model", "strata.engine"),
    ("strata.experts", "strata.engine"),
]
# edges that break the rules today while they are being moved (importer package, imported
# module); none now: strata.runtime holds the KV cache and the waits
KNOWN_UPHILL: list[tuple[str, str]] = []


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The strata modules that `name` imports anywhere in its source: `from pkg import sub`
    names the submodule where one exists, else the package."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "strata"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of `name`
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "strata":
                continue
            subs = {f"{mod}.{a.name}" for a in node.names} & known
            out |= subs or {mod}
    out.discard(name)
    return {m for m in out if m in known}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_no_import_cycles() -> None:
    """No strata module reaches itself through imports (a package's __init__ importing its own
    submodules is not an edge back: importing `pkg.sub` runs `pkg` first by design)."""
    graph = {m: {d for d in deps if d not in _ancestors(m)} for m, deps in _graph().items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_layering() -> None:
    """Kernels import no model, engine, experts, server or CLI module; the tokenizer, the model
    and the experts no engine module; the runtime nothing above it (KNOWN_UPHILL: edges still
    being moved)."""
    bad = []
    for m, deps in _graph().items():
        for d in sorted(deps):
            if any(_within(m, a) and _within(d, b) for a, b in FORBIDDEN) and not any(
                    _within(m, a) and d == b for a, b in KNOWN_UPHILL):
                bad.append(f"{m} imports {d}")
    assert not bad, "\n".join(bad)


def test_known_uphill_edges_still_exist() -> None:
    """Each KNOWN_UPHILL line names an edge that is still there (delete it once it is gone)."""
    graph = _graph()
    gone = [f"{a} -> {b}" for a, b in KNOWN_UPHILL
            if not any(_within(m, a) and b in deps for m, deps in graph.items())]
    assert not gone, f"no longer imported, delete from KNOWN_UPHILL: {gone}"


def test_the_reader_sees_function_level_and_type_only_imports(tmp_path: Path) -> None:
    """_imports counts an import inside a function and one under TYPE_CHECKING."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from strata.tokenizer.vocab import Tokenizer\n"
                   "def f():\n    from strata.kernels import tuning\n    import strata.units\n")
    known = {"strata.tokenizer.vocab", "strata.kernels", "strata.kernels.tuning", "strata.units"}
    assert _imports("strata.x", src, known) == {"strata.tokenizer.vocab",
                                                "strata.kernels.tuning", "strata.units"}
