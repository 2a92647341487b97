"""The package's structure, read from its source with ``ast`` (nothing is imported):

- no import cycles among ``linearize``'s modules, counting every ``import`` / ``from ... import`` at any level
  (inside functions too), relative ones resolved;
- an import inside a function carries a one-line reason (a comment on its line, or on the line above it or above
  the block of imports it belongs to): a heavy optional dependency or start-up time; every other import is at the top;
- the runtime bundled into checkpoints (:data:`linearize.bundle.BUNDLE`) imports only bundled modules, or names
  :data:`linearize.bundle.CONSTANTS` writes as values.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from linearize.bundle import BUNDLE, CONSTANTS

PACKAGE = Path(__file__).resolve().parents[1] / "linearize"
#: what a reason comment may not consist of alone
_MARKERS = re.compile(r"noqa(:\s*[A-Z]+\d+(,\s*[A-Z]+\d+)*)?|type:\s*ignore(\[[^\]]*\])?|pragma:\s*no cover")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    targets: tuple[str, ...]  # the linearize modules it imports
    names: tuple[str, ...]  # the names of a ``from`` import
    line: int
    in_function: bool
    reason: str  # the comment that gives the reason ("" if none)


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _comment(line: str) -> str:
    """The reason a source line's comment gives: its text without lint and coverage markers ("" if none)."""
    code, sep, comment = line.partition("#")
    if not sep or code.count('"') % 2 or code.count("'") % 2:  # no comment, or a '#' inside a string
        return ""
    text = _MARKERS.sub("", comment).strip(" -:()")
    return text if re.search(r"[A-Za-z]{3}", text) else ""


def _reason(lines: list[str], node: ast.stmt, import_lines: set[int]) -> str:
    """The comment on an import's lines, else on the line above it, or above the run of imports it belongs to."""
    for n in range(node.lineno, node.end_lineno + 1):
        if _comment(lines[n - 1]):
            return _comment(lines[n - 1])
    n = node.lineno - 1
    while n in import_lines or (n - 1 in import_lines and not lines[n - 1].strip()):  # the block of imports above
        n -= 1
    above = lines[n - 1].strip() if n >= 1 else ""
    return _comment(above) if above.startswith("#") else ""


def imports_of(module: str) -> list[Import]:
    """Every import statement of ``module`` that names a ``linearize`` module, at any level."""
    path = MODULES[module]
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes: list[tuple[ast.stmt, bool]] = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                nodes.append((child, in_function))
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    import_lines = {n for node, _ in nodes for n in range(node.lineno, node.end_lineno + 1)}
    out = []
    for node, in_function in nodes:
        if isinstance(node, ast.Import):
            targets = tuple(a.name for a in node.names if a.name.split(".")[0] == "linearize")
            names: tuple[str, ...] = ()
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source_module = ".".join(base + ([node.module] if node.module else []))
            else:
                source_module = node.module or ""
            names = tuple(a.name for a in node.names)
            if source_module.split(".")[0] != "linearize":
                targets = ()
            else:  # ``from pkg import submodule`` imports the submodule; ``from mod import name`` the module
                targets = tuple(dict.fromkeys(f"{source_module}.{n}" if f"{source_module}.{n}" in MODULES
                                              else source_module for n in names))
        out.append(Import(module, targets, names, node.lineno, in_function, _reason(lines, node, import_lines)))
    return out


def module_graph(skip_inside: str | None = None) -> dict[str, set[str]]:
    """Module -> the ``linearize`` modules it imports (an import of a package's submodule is an edge to the
    submodule; the implicit import of its parent packages is not counted). ``skip_inside``: drop the edges
    between two modules of that package."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for imp in imports_of(module):
            for target in imp.targets:
                inside = skip_inside and all(m == skip_inside or m.startswith(skip_inside + ".")
                                             for m in (module, target))
                if target in MODULES and target != module and not inside:
                    graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _unexplained(modules) -> list[str]:
    return [f"{MODULES[i.module].relative_to(PACKAGE.parent)}:{i.line}"
            for m in modules for i in imports_of(m) if i.in_function and not i.reason]


# ------------------------------------------------------------------------------------------------ the rules


def test_no_import_cycles():
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_inside_functions_give_a_reason():
    """Heavy optional dependencies and start-up time are reasons (``linearize --help`` and option errors answer
    fast because the commands import torch, transformers and the model code only when they run)."""
    bad = _unexplained(MODULES)
    assert not bad, "imports inside functions without a reason comment (move them to the top, or say why):\n" + \
        "\n".join(bad)


def test_bundled_runtime_imports_only_bundled_modules():
    bad = []
    for module in BUNDLE:
        for imp in imports_of(module):
            for target in imp.targets:
                constants = target in CONSTANTS and imp.names and set(imp.names) <= set(CONSTANTS[target])
                if target not in BUNDLE and not constants:
                    bad.append(f"{module}:{imp.line} imports {target}")
    assert not bad, "the bundled runtime imports modules a checkpoint does not carry:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------- the checks themselves


def test_a_cycle_is_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_a_reason_is_a_comment_with_words():
    assert _comment("    import torch  # heavy: only for the GPU path") == "heavy: only for the GPU path"
    assert _comment("    from . import modeling  # noqa: F401  (registers the Auto classes)") == \
        "registers the Auto classes"
    assert _comment("    import datasets  # noqa: PLC0415") == ""
    assert _comment('    x = "#not a comment"') == ""
    lines = ["def f():", "    # start-up time: torch", "    import torch", "", "    from . import a", "    x = 1",
             "    import b"]
    tree = ast.parse("\n".join(lines))
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    import_lines = {3, 5, 7}
    assert [_reason(lines, n, import_lines) for n in nodes] == ["start-up time: torch"] * 2 + [""]


def test_the_graph_sees_imports_at_every_level():
    """The command line imports the pipeline inside its command (start-up time): still an edge."""
    assert "linearize.convert.pipeline" in module_graph()["linearize.cli.convert"]
    inside = [i for i in imports_of("linearize.cli.convert") if i.in_function]
    assert inside and all(i.reason for i in inside)
