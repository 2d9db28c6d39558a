"""An import-linter contract type: no import cycle among the modules of each listed package.

A cycle is a strongly connected component of the import graph (grimp's, restricted to the package
and its descendants, a package's `__init__` included) that holds more than one module. Every import
counts: function-level ones and those under `if TYPE_CHECKING:` too, because each ties the two
modules together as much as a top-level one does.

import-linter's own `acyclic_siblings` works one level up: it also forbids two sibling *packages*
from importing each other in any way, which the engine library's layering allows on purpose (a low
unit of one subpackage may serve a high unit of another: tests/unit/test_layers.py). So this one looks
at modules. pyproject.toml registers it (`contract_types`, as `acyclic`); a contract of it names
`packages`.
"""

from __future__ import annotations

from collections import deque
from itertools import pairwise

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


class AcyclicContract(Contract):
    """No module of any of `packages` reaches itself through the imports of that package."""

    packages = fields.ListField(subfield=fields.ModuleField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        cycles = []
        for package in self.packages:  # type: ignore[attr-defined]
            name = package.name
            if name not in graph.modules:
                raise ValueError(f"{name}: no such package in the import graph")
            members = {name} | graph.find_descendants(name)
            for component in strongly_connected_components(graph, members):
                if len(component) > 1:
                    loop = shortest_loop(graph, min(component), set(component))
                    cycles.append({"package": name, "modules": sorted(component), "loop": loop})
        return ContractCheck(kept=not cycles, metadata={"cycles": cycles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata["cycles"]:
            modules = cycle["modules"]
            output.print_error(f"{cycle['package']}: {len(modules)} modules import each other in a cycle:")
            output.new_line()
            for importer, imported, line in cycle["loop"]:
                output.indent_cursor()
                output.print(f"{importer} -> {imported} (l.{line})")
            if len(modules) > len(cycle["loop"]):
                output.indent_cursor()
                output.print(f"(the cycle's modules: {', '.join(modules)})")
            output.new_line()


def strongly_connected_components(graph: ImportGraph, members: set[str]) -> list[list[str]]:
    """Tarjan's algorithm over the imports among `members`, iterative (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(members):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & members)))]
        while work:
            module, imports = work[-1]
            step = next(imports, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.find_modules_directly_imported_by(step) & members))))
                elif step in on_stack:
                    low[module] = min(low[module], index[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:  # the root of a component: the stack down to it
                components.append(_pop_component(stack, on_stack, module))
    return components


def _pop_component(stack: list[str], on_stack: set[str], root: str) -> list[str]:
    """Tarjan's component of `root`: the stack's modules down to it, popped."""
    component = []
    while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == root:
            return component


def shortest_loop(graph: ImportGraph, start: str, component: set[str]) -> list[tuple[str, str, int]]:
    """The shortest way from `start` back to itself inside its component, as (importer, imported,
    line of the first such import) steps: what a reader opens to break the cycle."""
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for imported in sorted(graph.find_modules_directly_imported_by(module) & component):
            if imported == start:
                path = [module]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                path.reverse()
                path.append(start)
                return [(a, b, _line(graph, a, b)) for a, b in pairwise(path)]
            if imported not in previous:
                previous[imported] = module
                queue.append(imported)
    return []


def _line(graph: ImportGraph, importer: str, imported: str) -> int:
    details = graph.get_import_details(importer=importer, imported=imported)
    return min((d["line_number"] for d in details), default=0)
