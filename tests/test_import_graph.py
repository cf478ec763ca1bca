"""The import graph of radixcache and linear_state has no circle (issue 31, item 4: a start).

Every import counts, module level or inside a function (a deferred import is a dependency too);
only ``if TYPE_CHECKING:`` blocks are left out. Packages count by their ``__init__``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("radixcache", "linear_state"):
        for p in (ROOT / top).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = p
        # A compiled module (radixcache/core/_native.c) counts by its stub: `from . import _native`
        # imports it, not its package.
        for p in (ROOT / top).rglob("*.pyi"):
            if not p.with_suffix(".py").exists():
                out[".".join(p.relative_to(ROOT).with_suffix("").parts)] = p
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    deps: set[str] = set()

    def resolve(node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in known)
            return
        if node.level:
            base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join([*base, node.module] if node.module else base)
        else:
            mod = node.module or ""
        for a in node.names:
            sub = f"{mod}.{a.name}"
            deps.add(sub if sub in known else mod)

    def visit(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                continue
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                resolve(n)
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(n, field, None)
                if isinstance(sub, list):
                    visit(sub)

    visit(ast.parse(path.read_text()).body)
    return {d for d in deps if d in known and d != name}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_module_imports_itself_through_others() -> None:
    known = _modules()
    edges = {m: _imports(m, p, known) for m, p in known.items()}
    assert edges["linear_state.layout"] == {"linear_state.hf"}, "the graph is read (a known edge is seen)"
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _room(module: str) -> str:
    """A module's room: its subpackage of radixcache (``radixcache.core``), ``linear_state``, or
    ``radixcache`` for the package's own top-level modules (the CLI, the stress loop)."""
    parts = module.split(".")
    if parts[0] == "linear_state":
        return "linear_state"
    if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[0] / parts[1]).is_dir()):
        return ".".join(parts[:2])
    return "radixcache"


def _room_edges() -> dict[str, set[str]]:
    known = _modules()
    rooms: dict[str, set[str]] = {}
    for m, p in known.items():
        deps = rooms.setdefault(_room(m), set())
        deps.update(_room(d) for d in _imports(m, p, known) if _room(d) != _room(m))
    return rooms


def test_the_rooms_import_downward_only() -> None:
    """No circle between rooms (issue 31, items 3 and 4), in layers: linear_state; core (keys, tree,
    events, the policy interface) and forensics; the policies and the tiers on core; the manager
    on those; the hosts (SGLang backend, transformers glue, simulator, testing kit) on top, the
    transformers glue (hf) below the testing kit that runs it."""
    rooms = _room_edges()
    assert "radixcache.core" in rooms["radixcache.policies"], "the graph is read (a known edge is seen)"
    assert _cycles(rooms) == [], rooms
    assert rooms["radixcache.core"] <= {"linear_state"}, rooms["radixcache.core"]
    assert rooms["radixcache.forensics"] <= {"linear_state"}, rooms["radixcache.forensics"]
    assert rooms["radixcache.policies"] <= {"linear_state", "radixcache.core"}, rooms["radixcache.policies"]
    assert rooms["radixcache.tiers"] <= {"linear_state", "radixcache.core"}, rooms["radixcache.tiers"]
    below_hosts = {"linear_state", "radixcache.core", "radixcache.tiers", "radixcache.forensics"}
    assert rooms["radixcache.manager"] <= below_hosts, rooms["radixcache.manager"]
    assert "radixcache.testing" not in rooms["radixcache.hf"], rooms["radixcache.hf"]
    assert not any("radixcache" in deps for r, deps in rooms.items() if r != "radixcache"), "a room imports the root"
