"""trainer/ has no import circles: issue 24's layering, held by reading every module's imports.

An import of `a.b.c` also runs the `__init__` of `a` and `a.b`, so it counts as importing those packages
too (a package that imports its submodules eagerly is how the last circle formed: trainer.batch ->
trainer.rollout's __init__ -> the transformers engine -> ... -> trainer.batch). Imports inside functions
count as well: deferring one hides a circle from Python, not from the reader.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def trainer_modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "trainer").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def packages_above(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the trainer modules loading it loads (its ancestors excluded: they load first)."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        loaded = set()
        for target in targets:
            loaded |= {target} | packages_above(target)
        graph[name] = {m for m in loaded if m in modules and m != name and m not in packages_above(name)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_trainer_package_has_no_import_circles():
    modules = trainer_modules()
    assert "trainer.loop" in modules and "trainer.rollout.builtin.engine" in modules
    assert circles(import_graph(modules)) == []


def test_the_circle_finder_finds_a_circle_through_a_package_init():
    graph = {
        "trainer.batch": {"trainer.rollout", "trainer.rollout.base"},
        "trainer.rollout": {"trainer.rollout.engine"},
        "trainer.rollout.base": set(),
        "trainer.rollout.engine": {"trainer.batch"},
        "trainer.loop": {"trainer.batch"},
    }
    assert circles(graph) == [["trainer.batch", "trainer.rollout", "trainer.rollout.engine"]]
    graph["trainer.rollout"] = set()
    assert circles(graph) == []
