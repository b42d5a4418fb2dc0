"""The structure docs/architecture.md describes, checked on the source: no import circle (every import counted,
inside functions too), eaglet's own imports at module level, imports only downwards through the layers, thin
tasks, and no branch on a draft architecture outside eaglet/drafts/. Reads files only: no engine, no flow."""

from __future__ import annotations

import ast
from pathlib import Path

from eaglet.drafts import registry

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("eaglet", "tasks", "flows", "deployments", "bench", "scripts")

# docs/architecture.md "Layers": lowest first. A module may import its own layer and those below it.
LAYERS = [
    ["eaglet.errors", "eaglet.store"],
    ["eaglet.config"],
    ["eaglet.verifier", "eaglet.data"],
    ["eaglet.vllm", "eaglet.drafts", "eaglet.drafts.base", "eaglet.drafts.checkpoint"],  # the package imports nothing
    ["eaglet.evaluate"],  # the package imports nothing; smoke, suites, serving
    ["eaglet.capture"],
    ["eaglet.train"],
    ["eaglet.drafts.eagle3", "eaglet.drafts.dflash", "eaglet.drafts.registry"],
    ["eaglet.report"],
    ["eaglet.keys"],
    ["tasks"],
    ["flows"],
    ["deployments", "bench", "scripts"],
]


def _modules() -> dict[str, Path]:
    mods = {}
    for top in SHIPPED:
        for f in (ROOT / top).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


MODULES = _modules()


def _known(name: str) -> str | None:
    """The shipped module an import name lands in (a name imported from a module is that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _packages(module: str) -> list[str]:
    """The module and the shipped packages above it, innermost first, without a top-level package."""
    parts = module.split(".")
    return [n for n in (".".join(parts[:i]) for i in range(len(parts), 1, -1)) if n in MODULES]


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported shipped module, line, inside a function) for every import statement of a module."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in child.names]
            for name in names:
                target = _known(name)
                # importing a module runs its packages' __init__ first: they count as imported too (but the root
                # package's, and the importer's own packages, which are already running)
                for pkg in _packages(target) if target else []:
                    if pkg != module and not (module + ".").startswith(pkg + "."):
                        found.append((pkg, child.lineno, inner))
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in {t for t, _, _ in GRAPH[v]}:
            if w not in index:
                strong(w)
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

    for v in GRAPH:
        if v not in index:
            strong(v)
    return out


def _layer(module: str) -> int:
    best, best_len = None, -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best is None and module == "eaglet":
        return 0
    assert best is not None, f"{module} is in no layer of docs/architecture.md"
    return best


def test_no_import_circle():
    assert _cycles() == []


def test_imports_go_down_the_layers():
    upward = [f"{m}:{line} imports {t}" for m, edges in GRAPH.items() for t, line, _ in edges
              if _layer(t) > _layer(m)]
    assert upward == []


def test_own_imports_are_at_module_level():
    """Inside eaglet/, tasks/ and flows/ every import of a shipped module is at module level (a heavy third-party
    dependency may still be imported where it is used)."""
    inside = [f"{m}:{line} imports {t}" for m, edges in GRAPH.items() for t, line, in_function in edges
              if in_function and m.split(".")[0] in ("eaglet", "tasks", "flows")]
    assert inside == []


def test_thin_tasks_and_a_small_package():
    task_files = sorted((ROOT / "tasks").glob("*.py"))
    assert sum(len(f.read_text().splitlines()) for f in task_files) <= 450
    long_tasks = []
    for f in task_files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    "task" in ast.unparse(d).split("(")[0] for d in node.decorator_list):
                if node.end_lineno - node.lineno + 1 > 30:
                    long_tasks.append(f"{f.name}:{node.name} {node.end_lineno - node.lineno + 1} lines")
    assert long_tasks == []
    top = [p.name for p in (ROOT / "eaglet").iterdir()
           if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").is_file())]
    assert len(top) <= 12, sorted(top)


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_nothing_outside_drafts_names_an_architecture():
    """No code outside eaglet/drafts/ compares with, looks up or imports a registered architecture by name; the
    config's defaults and descriptions may name them."""
    names = set(registry.ARCHITECTURES)
    found = []
    for module, path in MODULES.items():
        if module.startswith("eaglet.drafts") or module == "eaglet.config":
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docs:
                found.append(f"{module}:{node.lineno} {node.value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in names:
                found.append(f"{module}:{node.lineno} .{node.attr}")
        found += [f"{module}:{line} imports {t}" for t, line, _ in GRAPH[module]
                  if any(t == f"eaglet.drafts.{n}" or t.startswith(f"eaglet.drafts.{n}.") for n in names)]
    assert found == []


ISOLATED_IMPORTS = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for m in [m for m in sys.modules if m.split(".")[0] in ("eaglet", "tasks", "flows")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except ImportError as e:
        failed.append(f"{name}: {e}")
print("\\n".join(failed))
"""


def test_every_module_imports_first():
    """Whichever module is imported first, it imports: a package's __init__ runs before its modules, so a circle
    through one (which the graph above does not count) fails here. One process; eaglet's modules dropped between
    imports, the third-party ones kept."""
    import subprocess
    import sys

    names = sorted(m for m in MODULES if m.split(".")[0] in ("eaglet", "tasks", "flows"))
    out = subprocess.run([sys.executable, "-c", ISOLATED_IMPORTS, *names], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == ""
