"""The structure limits of the four packages, checked in CI (``.ci/run``; issue 45).

    python .ci/check_structure.py [PATH ...]     # default: inprocess checkpoint rerun straggler

Fails (exit 1, one line per finding, each naming the file, the unit and the limit) on:

- a module over 400 lines, a class over 250, a function over 50;
- ``# fmt: skip`` (it folds lines past the formatter);
- a direct ``time.time/monotonic/sleep/perf_counter`` call in ``inprocess/`` outside
  ``inprocess/clock.py`` and the process entry points (``__main__.py``): take a
  ``inprocess.clock.Clock`` instead, so timeouts can be driven by a fake clock;
- a store typed ``Any`` (a parameter or attribute whose name contains ``store``), a
  ``getattr``/``hasattr`` probe of a store, or ``__getattr__`` on a store class: type it
  ``inprocess.protocol.store.Store`` and call what the contract names;
- an import circle between modules (imports under ``TYPE_CHECKING`` and inside functions count);
- a private torch name (``torch._x``, ``from torch._x``) outside a ``_torch_private.py`` fence, or
  a private CPython name (``sys._x``, ``threading._x``, ...) outside a ``_cpython_private.py`` one.

Prints a JSON summary of the counts last (the figures quoted in issue 45's resolving note).
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("inprocess", "checkpoint", "rerun", "straggler")
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 400, 250, 50
_TIME_CALLS = {"time", "monotonic", "sleep", "perf_counter", "monotonic_ns", "time_ns"}
_CLOCK_OK = {"inprocess/clock.py"}
_CPYTHON_MODULES = {"sys", "threading", "gc", "ctypes", "builtins", "importlib", "signal"}


def _modules(roots: list[str]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for root in roots:
        for f in sorted(Path(root).rglob("*.py")):
            parts = f.with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def _sizes(f: Path, tree: ast.Module, text: str) -> Iterator[str]:
    lines = text.count("\n")
    if lines > MAX_MODULE:
        yield f"{f}: module of {lines} lines (limit {MAX_MODULE}): split it by job"
    if "fmt: skip" in text:
        yield f"{f}: '# fmt: skip' x{text.count('fmt: skip')}: let the formatter lay the lines out"
    for node in ast.walk(tree):
        size = (node.end_lineno or node.lineno) - node.lineno + 1 if hasattr(node, "lineno") else 0
        if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
            yield f"{f}:{node.lineno}: class {node.name} of {size} lines (limit {MAX_CLASS})"
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and size > MAX_FUNCTION:
            yield f"{f}:{node.lineno}: function {node.name} of {size} lines (limit {MAX_FUNCTION})"


def _is_any(annotation: ast.expr | None) -> bool:
    return annotation is not None and ast.unparse(annotation).strip("'\"") in {"Any", "typing.Any"}


def _store_contract(f: Path, tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and "store" in node.arg.lower() and _is_any(node.annotation):
            yield f"{f}:{node.lineno}: store parameter '{node.arg}' typed Any: type it Store"
        if isinstance(node, ast.AnnAssign) and _is_any(node.annotation):
            target = ast.unparse(node.target)
            if "store" in target.lower():
                yield f"{f}:{node.lineno}: store attribute '{target}' typed Any: type it Store"
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "hasattr"}
            and node.args
            and "store" in ast.unparse(node.args[0]).lower()
        ):
            yield f"{f}:{node.lineno}: {node.func.id}() probe of a store: call the Store contract"
        if isinstance(node, ast.ClassDef) and "store" in node.name.lower():
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__getattr__":
                    yield f"{f}:{item.lineno}: {node.name}.__getattr__ passes unknown names through"


def _direct_time(f: Path, tree: ast.Module) -> Iterator[str]:
    rel = f.as_posix()
    if not rel.startswith("inprocess/") or rel in _CLOCK_OK or f.name == "__main__.py":
        return
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "time"
            and node.attr in _TIME_CALLS
        ):
            yield f"{f}:{node.lineno}: time.{node.attr}: take an inprocess.clock.Clock instead"
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            yield f"{f}:{node.lineno}: 'from time import': take an inprocess.clock.Clock instead"


def _private_names(f: Path, tree: ast.Module) -> Iterator[str]:
    if f.name in {"_torch_private.py", "_cpython_private.py"}:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            base = ast.unparse(node.value)
            if base == "torch" or base.startswith("torch."):
                yield f"{f}:{node.lineno}: private torch name {base}.{node.attr} outside a fence"
            elif base in _CPYTHON_MODULES:
                yield f"{f}:{node.lineno}: private CPython name {base}.{node.attr} outside a fence"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            names = node.module.split(".") + [a.name for a in node.names]
            if any(n.startswith("_") and not n.startswith("__") for n in names):
                yield f"{f}:{node.lineno}: private torch import from {node.module} outside a fence"


def _imports(name: str, f: Path, tree: ast.Module, known: dict[str, Path]) -> set[str]:
    """Every module of ``known`` that ``name`` imports, anywhere in the file."""

    def closest(dotted: str) -> str | None:
        dotted = dotted.removeprefix("restartable.")  # the import root of the four packages
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if f.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(m for a in node.names if (m := closest(a.name)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                m = closest(f"{base}.{a.name}")  # a submodule, else the module it names from
                if m:
                    out.add(m)
    out.discard(name)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main(argv: list[str]) -> int:
    known = _modules(argv or list(PACKAGES))
    findings: dict[str, list[str]] = {k: [] for k in ("size", "store", "time", "private", "circle")}
    graph: dict[str, set[str]] = {}
    for name, f in known.items():
        text = f.read_text()
        tree = ast.parse(text, filename=str(f))
        findings["size"] += _sizes(f, tree, text)
        findings["store"] += _store_contract(f, tree)
        findings["time"] += _direct_time(f, tree)
        findings["private"] += _private_names(f, tree)
        graph[name] = _imports(name, f, tree, known)
    findings["circle"] = [f"import circle: {' <-> '.join(c)}" for c in _circles(graph)]
    for lines in findings.values():
        for line in lines:
            print(line)
    print(json.dumps({k: len(v) for k, v in findings.items()}))
    return 1 if any(findings.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
