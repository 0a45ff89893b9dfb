"""The import order of docs/architecture.md, read from llamarl's own imports with `ast`.

llamarl's packages (and its top-level modules) sit on floors; a module may import from its own
package and from lower floors only. Two packages on one floor (trainer and generator) never
import each other. An import inside a function that runs upward is allowed only where
docs/architecture.md names it (ALLOWED_UPWARD below, each with its reason there), and no file
may take part in an import cycle, counting every import, function-local ones included.
"""

from __future__ import annotations

import ast
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llamarl"

# Bottom floor first. A name is a subpackage of llamarl or a top-level module (without .py).
FLOORS: list[set[str]] = [
    {"errors", "imports", "timeline"},
    {"registry"},  # name tables: algorithms, rollout sources, environments, models
    {"config"},  # the recipe schema and its validation
    {"runtime"},  # the job's services: store, watchdog, roster, layout, placement, setup
    {"parallel"},  # groups on the store, the communication plan, FSDP2, the weight sync
    {"buffer"},  # the rollout record and its channels
    {"algorithms"},
    {"tiny"},  # the embedded tiny model and its tasks
    {"models"},  # models by name, their cache
    {"data"},
    {"rewards"},
    {"gateway"},  # the OpenAI-style HTTP front of an engine
    {"rollout"},  # rollout sources, episode runners
    {"envs"},  # the built-in environments and agents
    {"trainer", "generator"},  # the two roles
    {"service"},  # the Tinker-compatible service: tenants on the trainer's model, its HTTP API
    {"launch", "export", "plot", "model_check", "__init__"},  # entry points
]

# (importing module, imported module): function-local imports that run upward on purpose,
# each named with its reason in docs/architecture.md ("Upward imports").
ALLOWED_UPWARD = {
    ("llamarl.config", "llamarl.data.sources"),
    ("llamarl.config", "llamarl.models.precision"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _room(module: str) -> str:
    """The floor-plan name of a module: its subpackage, or its top-level module's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _in_type_checking(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _local(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
    return False


def read_imports(source: str, module: str, known: set[str]) -> list[tuple[str, bool, int]]:
    """(imported llamarl module, function-local, line) for every import of `source`; `from
    llamarl.x import y` names module llamarl.x.y when that module exists, else llamarl.x."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if _in_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[:-node.level] if not module.endswith("__init__") \
                    else module.split(".")[:-node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            targets = [f"{name}.{a.name}" if f"{name}.{a.name}" in known else name
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target == "llamarl" or target.startswith("llamarl."):
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                out.append((target, _local(node, parents), node.lineno))
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, list[tuple[str, bool, int]]]:
    files = {_module_name(p): p for p in sorted(package.rglob("*.py"))}
    known = set(files)
    return {m: read_imports(p.read_text(), m, known) for m, p in files.items()}


def floor_of(room: str) -> int:
    for i, rooms in enumerate(FLOORS):
        if room in rooms:
            return i
    raise AssertionError(f"llamarl/{room} is on no floor of tests/test_layers.py: add it to "
                         "FLOORS and to docs/architecture.md's map")


def upward_imports(graph) -> list[tuple[str, str, bool, int]]:
    """(importer, imported, function-local, line) for every import that does not go down a
    floor or stay in its own room; same-floor rooms (trainer, generator) count as upward."""
    out = []
    for module, imports in graph.items():
        room = _room(module)
        for target, local, line in imports:
            other = _room(target)
            if other == room:
                continue
            if floor_of(other) >= floor_of(room):
                out.append((module, target, local, line))
    return out


def file_cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), every import
    counted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _, _ in graph.get(v, []):
            if w == v or w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_graph(graph) -> dict[str, set[str]]:
    edges = defaultdict(set)
    for module, imports in graph.items():
        for target, _, _ in imports:
            if _room(target) != _room(module):
                edges[_room(module)].add(_room(target))
    return edges


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_room_is_on_a_floor(graph):
    for module in graph:
        floor_of(_room(module))


def test_no_import_runs_upward(graph):
    bad = sorted({f"{a}:{line} imports {b}" + (" (in a function)" if local else "")
                  for a, b, local, line in upward_imports(graph) if (a, b) not in ALLOWED_UPWARD})
    assert not bad, "imports that run upward (docs/architecture.md):\n" + "\n".join(bad)


def test_the_allowed_upward_imports_are_local_and_named_in_the_docs(graph):
    upward = {(a, b): local for a, b, local, _ in upward_imports(graph)}
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert len(ALLOWED_UPWARD) <= 3
    for a, b in ALLOWED_UPWARD:
        assert upward.get((a, b)) is True, f"{a} -> {b}: no longer a function-local import"
        assert f"`{a}` -> `{b}`" in doc, f"docs/architecture.md does not justify {a} -> {b}"


def test_no_file_cycles(graph):
    assert file_cycles(graph) == []


def test_the_package_graph_has_no_cycle(graph):
    """Once the allowed upward imports are left out (they are the documented exceptions)."""
    allowed = {(_room(a), _room(b)) for a, b in ALLOWED_UPWARD}
    edges = {room: {t for t in targets if (room, t) not in allowed}
             for room, targets in package_graph(graph).items()}
    cycles = file_cycles({room: [(t, False, 0) for t in targets] for room, targets in
                          edges.items()})
    assert cycles == [], cycles


def test_the_check_fails_on_a_planted_upward_import(tmp_path):
    """The same functions on a copy of llamarl with one import planted: buffer/record.py
    importing the trainer at module level is reported, and so is a file cycle."""
    import shutil

    copy = tmp_path / "llamarl"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    record = copy / "buffer" / "record.py"
    record.write_text(record.read_text() + textwrap.dedent("""
        from llamarl.trainer.policy import pad_rollouts  # planted
    """))
    planted = {_module_name_in(copy, p): p for p in copy.rglob("*.py")}
    known = set(planted)
    graph = {m: read_imports(p.read_text(), m, known) for m, p in planted.items()}
    upward = [(a, b) for a, b, local, _ in upward_imports(graph) if not local]
    assert ("llamarl.buffer.record", "llamarl.trainer.policy") in upward
    assert any("llamarl.buffer.record" in c for c in file_cycles(graph))  # policy imports it


def _module_name_in(root: Path, path: Path) -> str:
    parts = ["llamarl", *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)
