"""The import graph of pdserve/: every module imports on its own, and no module imports itself
back through others.

Which imports count: every ``import``/``from … import`` statement in a module's source that
names a pdserve module — at module level, inside functions, and under ``if TYPE_CHECKING:``
alike. A function-level or type-only import still means "to read this module you must read
that one", and a cycle through it is still a knot for the reader (and an import-order trap the
day someone moves it to the top). ``from pkg import name`` counts as an edge to ``pkg.name``
when that is a module, else to ``pkg``. A package's ``__init__`` is a module like any other;
importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, but those implicit edges do
not count (they would make every package depend on its parent).

Isolation: one fresh interpreter imports every module in turn, dropping every pdserve module
from ``sys.modules`` before each, so each import starts from nothing of ours (third-party
packages stay loaded: a fresh interpreter per module spends minutes re-importing torch).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pdserve"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The pdserve modules `name` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package that holds `name`
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif base in known:
                    out.add(base)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, …, a], or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    for root in sorted(graph):
        if color[root] != WHITE:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        color[root] = GREY
        path = [root]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                color[node] = BLACK
                stack.pop()
                path.pop()
            elif color[child] == GREY:
                return path[path.index(child):] + [child]
            elif color[child] == WHITE:
                color[child] = GREY
                path.append(child)
                stack.append((child, iter(sorted(graph[child]))))
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles found one at a time, breaking each found one's last edge, so a test failure lists
    every knot rather than the first."""
    graph = {k: set(v) for k, v in graph.items()}
    found = []
    while (cycle := find_cycle(graph)) is not None:
        found.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
    return found


def test_the_import_graph_of_pdserve_has_no_cycle() -> None:
    cycles = all_cycles(import_graph())
    assert not cycles, "import cycles in pdserve/:\n" + "\n".join("  " + " → ".join(c) for c in cycles)


def test_find_cycle_reports_the_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


_IMPORT_EACH = """
import importlib, sys, traceback
ours = ("pdserve", "pdserve_kernels")
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except BaseException as e:
        print(f"{name}: {type(e).__name__}: {e}")
"""


def test_every_module_imports_on_its_own() -> None:
    """Each module is imported with no pdserve module loaded before it (they are dropped from
    sys.modules between two imports; third-party packages such as torch stay loaded, which is
    what keeps this fast), in one fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *sorted(modules())], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "", "modules that do not import on their own:\n" + proc.stdout


def test_the_worker_contract_and_the_router_stay_off_the_engine() -> None:
    """The router is another process than the engine (DESIGN: the router never imports the
    engine); the contract is what both sides import, so it is the lightest of all."""
    code = """
import sys
heavy = lambda: sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "fastapi")
                       or m.startswith(("pdserve.engine", "pdserve.scheduler", "pdserve.worker.")))
import pdserve.worker_api
print(heavy())
import pdserve.frontend.app
print([m for m in heavy() if not m.startswith("fastapi")])
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    contract, router = proc.stdout.splitlines()
    assert contract == "[]", f"pdserve.worker_api pulls in {contract}"
    assert router == "[]", f"the router app pulls in {router}"


def test_serve_and_router_parse_their_command_line_without_torch() -> None:
    """`pdserve serve` and `pdserve router` build only their own flags: the engine flags' defaults
    import torch (~3 s of start-up on a small machine), which only the workers need."""
    code = """
import sys
from pdserve.cli import build_parser
build_parser("serve").parse_args(["serve"])
build_parser("router").parse_args(["router"])
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"parsing serve's and router's flags imported {proc.stdout[:300]}"
