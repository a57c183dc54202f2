"""The package's layering, checked from the source: no import from a lower layer to a higher one, no cycles.

Layers, lowest first (a module may import its own layer and those below):

====  ===========================================================================================
0     ``tilert`` itself, ``contracts``, ``auth``, ``netio``, ``cpus``, ``logs``, ``settings``,
      ``metric_conventions``: what every process shares
1     ``transports/`` (byte movers)
2     ``engines/`` (compute only), ``models/`` (checkpoint facts, tiny and block-FP8 checkpoints, in the engines'
      weight formats), ``plugins`` (finds transports and engines by entry point)
3     ``connector/`` (inside vLLM), ``decode/`` (the decode node)
4     ``router/``
5     ``stack``, ``cli``, ``demo``, ``pd_vllm/`` and ``models/preprocess/`` (the published commands'
      aliases), ``testing/`` (stand-ins shared by tests and benchmarks)
====  ===========================================================================================

Imports under ``if TYPE_CHECKING:`` are annotations only and do not count. An import inside a function counts
like any other (for layers and cycles) and is allowed only where the dependency is optional or costly to
import; the import line then says why in a trailing ``# lazy: <reason>`` comment.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tilert"

# (module prefix, layer): the longest matching prefix decides.
LAYERS: tuple[tuple[str, int], ...] = (
    ("tilert", 0),
    ("tilert.transports", 1),
    ("tilert.models", 2),
    ("tilert.engines", 2),
    ("tilert.plugins", 2),
    ("tilert.connector", 3),
    ("tilert.decode", 3),
    ("tilert.router", 4),
    ("tilert.stack", 5),
    ("tilert.cli", 5),
    ("tilert.demo", 5),
    ("tilert.pd_vllm", 5),
    ("tilert.models.preprocess", 5),
    ("tilert.testing", 5),
)
LAZY_MARK = "# lazy:"


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    inside_function: bool
    text: str


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The tilert module an imported name lives in (``tilert.a.b.func`` -> ``tilert.a.b``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
        return
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    yield base
    yield from (f"{base}.{a.name}" for a in node.names)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def edges() -> list[Edge]:
    known = modules()
    out: list[Edge] = []
    for module, path in known.items():
        source = path.read_text(encoding="utf-8")
        _collect(ast.parse(source), False, module, path.name == "__init__.py", source.splitlines(), known, out)
    return out


def _collect(
    node: ast.AST,
    in_function: bool,
    module: str,
    is_package: bool,
    lines: list[str],
    known: dict[str, Path],
    out: list[Edge],
) -> None:
    for child in ast.iter_child_nodes(node):
        if _is_type_checking(child):
            continue
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            targets = {_resolve(n, known) for n in _imported(child, module, is_package)}
            text = " ".join(lines[child.lineno - 1 : (child.end_lineno or child.lineno)])
            out.extend(
                Edge(module, t, child.lineno, inner, text) for t in sorted(x for x in targets if x and x != module)
            )
        _collect(child, inner, module, is_package, lines, known, out)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
    return found


def _package_parents(module: str) -> set[str]:
    """A module's enclosing packages: importing ``tilert.a.b`` runs ``tilert/a/__init__.py`` first, so an import
    of a parent package is not an arrow of its own (``tilert`` is every module's parent)."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in modules()}
    for e in edges():
        if e.target not in _package_parents(e.source):
            g[e.source].add(e.target)
    return g


def test_no_import_goes_up_a_layer() -> None:
    upward = [
        f"{e.source}:{e.line} (layer {layer(e.source)}) imports {e.target} (layer {layer(e.target)})"
        for e in edges()
        if layer(e.target) > layer(e.source)
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_product_never_imports_the_stand_ins() -> None:
    """``tilert.testing`` serves tests and benchmarks; no module of the product may depend on it."""
    users = [f"{e.source}:{e.line}" for e in edges() if layer_of_testing(e.target) and not layer_of_testing(e.source)]
    assert not users, f"the product imports tilert.testing: {users}"


def layer_of_testing(module: str) -> bool:
    return module == "tilert.testing" or module.startswith("tilert.testing.")


def test_no_import_cycles() -> None:
    found = cycles(graph())
    assert not found, f"import cycles inside tilert/ (imports inside functions count): {found}"


def test_imports_inside_functions_say_why() -> None:
    unexplained = sorted(
        {f"{e.source}:{e.line}: {e.text.strip()}" for e in edges() if e.inside_function and LAZY_MARK not in e.text}
    )
    assert not unexplained, (
        f"an import inside a function needs a trailing '{LAZY_MARK} <reason>' comment (optional or costly "
        "dependency), or belongs at the top of the module:\n" + "\n".join(unexplained)
    )


def test_the_checker_sees_what_it_must() -> None:
    """The checks above would pass vacuously if the walker found nothing: it must see the package's real
    arrows, and the cycle finder must find a planted cycle."""
    found = {(e.source, e.target) for e in edges()}
    assert ("tilert.router.app", "tilert.router.flow") in found
    assert ("tilert.decode.server", "tilert.decode.slots") in found
    assert layer("tilert.router.flow") == 4 and layer("tilert.models.preprocess.weight_converter") == 5
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(modules()))
def test_every_module_has_a_layer(module: str) -> None:
    assert 0 <= layer(module) <= 5
