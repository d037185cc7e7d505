"""The shape of the source tree: no import circles in `nowait`, no file over 500 lines, and no
function of the gateway's app over 80 lines.

The import graph is read from the source with `ast`, nothing is imported. Its nodes are the
modules of src/nowait, a package's `__init__.py` being a node of its own under the package's
name (`nowait/model/__init__.py` is `nowait.model`). Its edges:

- every `import` and `from ... import` of a `nowait` module, at module level and inside
  functions alike (a function-level import still runs, only later);
- relative imports resolved against the importing module's package;
- `from pkg import name` goes to `pkg.name` when that is a submodule, else to `pkg` itself;
- an edge to `pkg.mod` goes to `pkg.mod` only. Python runs `pkg/__init__.py` first, but counting
  that as an edge to `pkg` would make every package whose `__init__` names one of its own modules
  look circular; a circle through an `__init__` shows when a module imports the package by name;
- imports under `if TYPE_CHECKING:` count too: they never run, but two modules that name each
  other's types still know each other, and a circle of type names is a circle of the design;
- a module importing itself is left out (it runs nothing twice).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "nowait"
MAX_FILE_LINES = 500
MAX_APP_FUNCTION_LINES = 80


# --- the import graph --------------------------------------------------------------------------


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py below the package directory `root`."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """`name`, or the longest prefix of it that is a module (`pkg.mod.attr` -> `pkg.mod`)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package tree it imports, by the rules of the module docstring."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        for statement in (node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)):
            targets: list[str | None] = []
            if isinstance(statement, ast.Import):
                targets = [_known(alias.name, modules) for alias in statement.names]
            else:
                if statement.level:
                    base = package.split(".")[: len(package.split(".")) - statement.level + 1]
                    source = ".".join([*base, *([statement.module] if statement.module else [])])
                else:
                    source = statement.module or ""
                for alias in statement.names:
                    submodule = f"{source}.{alias.name}"
                    targets.append(submodule if submodule in modules else _known(source, modules))
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph


# --- circles -----------------------------------------------------------------------------------


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the strongly connected components of `graph`, each sorted."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = lowest[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                lowest[node] = min(lowest[node], lowest[successor])
            elif successor in on_stack:
                lowest[node] = min(lowest[node], index[successor])
        if lowest[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _shortest_cycle_through(start: str, graph: dict[str, set[str]], within: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside one component (breadth first)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for successor in sorted(graph[node] & within):
            if successor == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if successor not in came_from:
                came_from[successor] = node
                queue.append(successor)
    raise AssertionError(f"{start} is on no cycle of its component")


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle as `a -> b -> a`: for each component of more than one module, the shortest
    cycle through each of its members (a component can hold more cycles than are worth listing;
    these name every module on a circle and every module it loops back through)."""
    cycles: set[tuple[str, ...]] = set()
    for component in strongly_connected_components(graph):
        if len(component) < 2:
            continue
        for member in component:
            cycle = _shortest_cycle_through(member, graph, set(component))[:-1]
            turn = cycle.index(min(cycle))  # one spelling per cycle, whatever member it was found from
            cycles.add(tuple(cycle[turn:] + cycle[:turn]))
    return sorted(" -> ".join([*cycle, cycle[0]]) for cycle in cycles)


# --- the checks on the tree --------------------------------------------------------------------


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph(SOURCE)
    assert len(graph) > 50 and any(graph.values()), "the import graph was not read"
    cycles = import_cycles(graph)
    assert not cycles, "import circles in src/nowait:\n" + "\n".join(cycles)


def test_no_source_file_is_over_500_lines() -> None:
    lengths = {path.relative_to(SOURCE.parent).as_posix(): len(path.read_text().splitlines())
               for path in sorted(SOURCE.rglob("*.py"))}
    assert lengths, "no source files found"
    offenders = [f"{path}: {lines} lines" for path, lines in lengths.items() if lines > MAX_FILE_LINES]
    assert not offenders, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(offenders)


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, nested ones included, with its qualified name."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}{child.name}", child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def test_no_function_of_the_gateway_app_is_over_80_lines() -> None:
    app = SOURCE / "gateway" / "app.py"
    files = [app] if app.exists() else sorted((SOURCE / "gateway" / "app").rglob("*.py"))
    assert files, "the gateway app is neither gateway/app.py nor a gateway/app package"
    offenders = []
    for path in files:
        for name, function in _functions(ast.parse(path.read_text())):
            lines = function.end_lineno - function.lineno + 1
            if lines > MAX_APP_FUNCTION_LINES:
                offenders.append(f"{path.relative_to(SOURCE.parent).as_posix()}: {name}: {lines} lines")
    assert not offenders, f"functions over {MAX_APP_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


# --- the cycle finder on trees made for it -----------------------------------------------------


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_graph_resolves_imports_by_the_documented_rules(tmp_path: Path) -> None:
    package = _write_tree(tmp_path, {
        "pkg/__init__.py": "from pkg.a import thing\n",
        "pkg/a.py": "import os\nfrom pkg import b\n",
        "pkg/b.py": "def later():\n    from . import a\n    return a\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nimport pkg.sub.e\n",
        "pkg/d.py": "from .sub import e, helper\nfrom pkg.sub.e import name\n",
        "pkg/sub/__init__.py": "helper = 1\n",
        "pkg/sub/e.py": "from .. import c\nfrom pkg.sub import e\n",
    })
    assert import_graph(package) == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},  # `from pkg import b`: the submodule, not the package's __init__
        "pkg.b": {"pkg.a"},  # function-level and relative
        "pkg.c": {"pkg.a", "pkg.sub.e"},  # a TYPE_CHECKING import counts; `import a.b.c` is a.b.c
        "pkg.d": {"pkg.sub", "pkg.sub.e"},  # `helper` is a name in pkg.sub's __init__
        "pkg.sub": set(),
        "pkg.sub.e": {"pkg.c"},  # `from .. import c` resolved; its import of itself left out
    }


def test_the_cycle_finder_names_a_circle_of_files(tmp_path: Path) -> None:
    package = _write_tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def later():\n    from . import a\n",
        "pkg/c.py": "from pkg import a\n",
    })
    assert import_cycles(import_graph(package)) == ["pkg.a -> pkg.b -> pkg.a"]


def test_the_cycle_finder_on_graphs() -> None:
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert import_cycles({"b": {"c"}, "c": {"a"}, "a": {"b"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    # Two circles sharing a module are one component; both are named.
    two = {"a": {"b", "c"}, "b": {"a"}, "c": {"a"}, "d": set()}
    assert import_cycles(two) == ["a -> b -> a", "a -> c -> a"]
    assert sorted(map(tuple, strongly_connected_components(two))) == [("a", "b", "c"), ("d",)]
