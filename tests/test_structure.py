"""The code's shape (issue 48): no import circle between the project's modules, and no module
over ``MAX_LINES`` lines.

Read from the source with :mod:`ast` alone (nothing is imported), so it runs without a framework.

Import graph. A node is a module of ``hvd_gradcomp``, ``torch_backend``, ``tf_backend`` or
``tests`` (a package is its ``__init__``). An edge ``a -> b`` is every import in ``a``, at module level
or inside a function or class (a function-level import is a circle all the same: it only moves
the failure to the first call):

- ``import p.q.m`` -> ``p.q.m``;
- ``from p.q import name`` -> ``p.q.name`` when that is a module, else ``p.q`` (its
  ``__init__`` when a package: the name is read from it);
- relative imports are resolved against ``a``'s package (``from .. import name`` in
  ``p/q/m.py`` is ``from p import name``);
- a module that calls ``importlib.import_module`` imports every project module that a string
  literal in it names (``"p.q.m"`` or ``"p.q.m:attr"``): a dynamic import is an import.

The parents' ``__init__`` that Python runs before ``p.q.m`` are no edge, nor is ``p.q`` in
``from p.q import m`` when ``m`` is a module: Python binds the submodule (from ``sys.modules``
if ``p.q`` is still initialising) without reading a name that ``p.q``'s ``__init__`` defines, so
``from . import sibling`` in a package whose ``__init__`` imports this module works in any
import order. A package ``__init__`` that imports its submodule ``m`` while ``m`` reads a name
from that ``__init__`` (``from p.q import SomeClass``) is an edge each way: a circle.
"""
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("hvd_gradcomp", "torch_backend", "tf_backend", "tests")
_MODULE_TEXT = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")
MAX_LINES = 550

# Test files (tests/**/test_*.py) over MAX_LINES when the check came, to be split by job as they
# are next edited; an entry that is short now, or gone, fails, so the list only shrinks. Every
# other module, test helpers (tests/core/triton_checks.py, tests/hvdrun.py, ...) included, is
# held to MAX_LINES.
LONG_TEST_FILES = set()


def _module_files():
    """``{dotted module name: path relative to ROOT}`` for every ``.py`` of ``PACKAGES``."""
    modules = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, package)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, name), ROOT)
                parts = rel[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = rel.replace(os.sep, "/")
    return modules


def _package_of(module, path):
    """The package a relative import in ``module`` starts from."""
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _edges(module, path, modules, source=None):
    """``[(imported module, line)]`` for the imports of one module (see the docstring); its
    ``source`` text, else read from ``path``."""
    if source is None:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            source = f.read()
    tree = ast.parse(source, filename=path)
    found = []

    def add(name, line):
        if name in modules and name != module:
            found.append((name, line))

    dynamic = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path).split(".")
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source,
                    node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            dynamic = True
    if dynamic:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and _MODULE_TEXT.match(node.value):
                add(node.value.partition(":")[0], node.lineno)
    return found


def import_graph():
    """``{module: {imported module: first line}}`` over the project's packages."""
    modules = _module_files()
    graph = {}
    for module, path in modules.items():
        graph[module] = {}
        for name, line in _edges(module, path, modules):
            graph[module].setdefault(name, line)
    return graph, modules


def _strongly_connected(graph):
    """Tarjan's components with more than one module (the graph has no self-edges)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _cycle_through(graph, component, start):
    """One shortest circle from ``start`` back to it inside ``component`` (breadth first)."""
    inside = set(component)
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w in inside and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return None


def import_circles(graph=None):
    """Each circle's modules and edges as text lines, ``[]`` when there is none.

    One line per strongly connected component (its members), then every edge inside it with the
    file and line of the import, then one shortest circle per member (so every circle's edges are
    named, though not every one of the possibly many elementary circles is spelled out).
    """
    if graph is None:
        graph, modules = import_graph()
    else:
        modules = {m: m for m in graph}
    lines = []
    for component in _strongly_connected(graph):
        lines.append("circle among: " + ", ".join(component))
        for v in component:
            for w, line in sorted(graph[v].items()):
                if w in component:
                    lines.append(f"    {modules[v]}:{line} imports {w}")
        seen = set()
        for v in component:
            cycle = _cycle_through(graph, component, v)
            if cycle and tuple(sorted(cycle[:-1])) not in seen:
                seen.add(tuple(sorted(cycle[:-1])))
                lines.append("    e.g. " + " -> ".join(cycle))
    return lines


def test_no_import_circle():
    lines = import_circles()
    assert not lines, "import circles (module- or function-level):\n" + "\n".join(lines)


def test_allow_lists_are_still_needed():
    _, modules = import_graph()
    paths = {path: module for module, path in modules.items()}
    for path in LONG_TEST_FILES:
        assert os.path.basename(path).startswith("test_"), f"{path}: only test files may be listed"
        assert path in paths and _count_lines(path) > MAX_LINES, \
            f"{path} is gone or short now: drop it from LONG_TEST_FILES"


def test_module_sizes():
    """Every module of the packages and of tests/ at most MAX_LINES lines (``wc -l``), but the
    listed test files (no module of ``hvd_gradcomp``, ``torch_backend`` or ``tf_backend`` is
    exempt)."""
    _, modules = import_graph()
    long = sorted(f"{path}: {_count_lines(path)} lines" for path in modules.values()
                  if path not in LONG_TEST_FILES and _count_lines(path) > MAX_LINES)
    assert not long, f"modules over {MAX_LINES} lines (split them by job):\n" + "\n".join(long)


def test_checker_finds_circles():
    """The checker itself: a chain is not a circle; a circle through a package ``__init__``, a
    function-level relative import and a dynamic import is found, edge by edge."""
    graph = {"p": {"p.a": 1}, "p.a": {"p.b": 2}, "p.b": {"p": 3},
             "q": {}, "q.x": {"q.y": 1}, "q.y": {}}
    lines = import_circles(graph)
    assert lines[0] == "circle among: p, p.a, p.b", lines
    assert "    e.g. p -> p.a -> p.b -> p" in lines, lines
    assert not any("q" in line.split(": ")[-1].split(", ") for line in lines if "circle" in line)

    modules = {"p": "p/__init__.py", "p.a": "p/a.py", "p.b": "p/b.py", "p.c": "p/c.py"}
    sources = {"p": "from .a import f\n",
               "p.a": "def f():\n    from . import b\n",
               "p.b": "from p import f\n",
               "p.c": "import importlib\nNAMES = ('p.a:f', 'p.zz')\n"}
    edges = {m: dict(_edges(m, path, modules, sources[m])) for m, path in modules.items()}
    assert edges["p.c"] == {}, edges  # strings name modules only beside importlib.import_module
    # dynamic: only a module that calls importlib.import_module; attribute name, not a module
    sources["p.c"] += "importlib.import_module(NAMES[0])\n"
    edges["p.c"] = dict(_edges("p.c", "p/c.py", modules, sources["p.c"]))
    assert edges == {"p": {"p.a": 1}, "p.a": {"p.b": 2}, "p.b": {"p": 1}, "p.c": {"p.a": 2}}, edges
    assert import_circles(edges)[0] == "circle among: p, p.a, p.b"


def _count_lines(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return sum(1 for _ in f)
