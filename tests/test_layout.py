"""The package's layers: every import of its own modules points down the map, and no modules form a circle.

Read from the source (every `import`, in functions and type-checking blocks too), not from what
happens to be imported at run time. The map is the one `mlx_dflash/__init__.py` draws for readers.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from helpers.paths import REPO

# Top to bottom: a part may import the parts below it, never one above it or beside it.
TIERS = [
    {"cli"},
    {"server"},  # app.py, runner.py: the routes and the process
    {"server.apis"},
    {"server.reply"},
    {"server.http"},
    {"server.worker"},
    {"bench", "train"},
    {"(package face)"},  # mlx_dflash/__init__.py
    {"(public API)"},  # generate.py, chat.py, doctor.py and the documented re-exports
    {"batching"},
    {"auto"},
    {"decoding"},
    {"loading"},
    {"convert"},
    {"proposers"},
    {"drafters"},
    {"targets"},
    {"distributed"},
    {"kernels"},
    {"platform"},
    {"errors", "version"},
]
TIER = {part: i for i, tier in enumerate(TIERS) for part in tier}
# Installed as subpackages of mlx_dflash, kept at the top of the repository.
SOURCES = {"mlx_dflash": "mlx_dflash", "cli": "mlx_dflash.cli", "convert": "mlx_dflash.convert"}


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for folder, package in SOURCES.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            init = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if init else parts)])
            out[name] = (path, init)
    return out


def imports(name: str, path: Path, init: bool, known: set[str]) -> set[str]:
    """The package's own modules that `name` imports anywhere in its file."""
    package = name.split(".") if init else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "mlx_dflash"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "mlx_dflash":
                base = node.module
            else:
                continue
            for alias in node.names:  # `from package import module` names a module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def part(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "(package face)"
    if parts[0] in ("generate", "chat", "doctor", "session", "policy", "calibration"):
        return "(public API)"
    if parts[0] == "server" and len(parts) > 1 and parts[1] in ("apis", "reply", "http", "worker"):
        return f"server.{parts[1]}"
    return parts[0]


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, init, set(found)) for name, (path, init) in found.items()}


def test_every_module_belongs_to_a_tier():
    assert {part(m) for m in graph()} <= set(TIER)


def test_imports_only_point_down_the_map():
    upward = defaultdict(list)
    for module, targets in graph().items():
        for target in targets:
            a, b = part(module), part(target)
            if a != b and TIER[b] <= TIER[a]:
                upward[f"{a} -> {b}"].append(f"{module} imports {target}")
    assert not upward, dict(upward)


def test_no_modules_import_each_other_in_a_circle():
    edges = graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_readers_map_lists_the_subpackages_in_the_tiers_order():
    doc = ast.get_docstring(ast.parse((REPO / "mlx_dflash" / "__init__.py").read_text()))
    rows = [re.match(r"((?:\w+/\s+)+)", line.strip() + " ") for line in doc.splitlines() if line.startswith("    ")]
    drawn = [name for row in rows if row for name in re.findall(r"(\w+)/", row.group(1))]
    packages = {p for p in TIER if "." not in p and "(" not in p} - {"cli", "errors", "version"}
    assert sorted(drawn) == sorted(packages)
    assert drawn == sorted(drawn, key=lambda p: (TIER[p], drawn.index(p)))


def test_every_subpackage_is_installed():
    """pyproject.toml lists the packages a wheel carries; an editable install finds any folder, so
    only this catches a new subpackage left out of a real install."""
    setuptools = (REPO / "pyproject.toml").read_text().split("[tool.setuptools]", 1)[1]
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", setuptools, re.M | re.S).group(1)))
    packages = {name for name, (_, init) in modules().items() if init}
    assert listed == packages
