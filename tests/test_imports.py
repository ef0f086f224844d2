"""The package's layers, as amdllm/__init__.py draws them, checked on the source: every import goes to
the module's own layer or a lower one, no import cycle exists, and imports sit at module top, except a
third-party one that a comment on its line justifies (a heavy or optional dependency)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "amdllm"
LAYERS = {  # module prefix -> layer (the longest matching prefix wins)
    "amdllm": 0, "amdllm.config": 0, "amdllm.files": 0, "amdllm.env": 0,
    "amdllm.model": 1,
    "amdllm.io": 2, "amdllm.parallel": 2, "amdllm.backends": 2,
    "amdllm.quant": 3, "amdllm.infer": 3,
    "amdllm.train": 4,
    "amdllm.course": 5, "amdllm.cli": 5,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def layer(mod: str) -> int:
    best = max((p for p in LAYERS if mod == p or mod.startswith(p + ".")), key=len)
    return LAYERS[best]


def imports(path: Path, known: dict[str, Path]):
    """(target module, line, local?) for every amdllm import in the file (`import a.b` -> a.b)."""
    tree = ast.parse(path.read_text())
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import x` runs pkg/__init__.py: an edge to pkg, and to pkg.x when x is a module
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                       if f"{node.module}.{a.name}" in known]
        else:
            continue
        for t in targets:
            yield t, node.lineno, id(node) in local, node


def graph():
    known = modules()
    edges = {m: set() for m in known}
    for m, p in known.items():
        for t, _, _, _ in imports(p, known):
            if t.startswith("amdllm") and t in known and t != m:
                edges[m].add(t)
    return edges


def test_no_upward_imports():
    bad = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
           for m, ts in graph().items() for t in ts if layer(t) > layer(m)]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = graph()
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                sccs.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not sccs, f"import cycles: {sccs}"


def justified(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, on another line of its block of imports, or just above the block."""
    i = lineno - 1
    while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")):
        i -= 1
    block = lines[max(i - 1, 0):lineno]
    j = lineno
    while j < len(lines) and lines[j].strip().startswith(("import ", "from ")):
        block.append(lines[j])
        j += 1
    return any("#" in line for line in block)


def test_imports_at_module_top():
    """amdllm modules are always imported at the top; a local third-party import needs a comment saying why."""
    known = modules()
    bad = []
    for m, p in known.items():
        lines = p.read_text().splitlines()
        for t, lineno, local, node in imports(p, known):
            if not local:
                continue
            if t.startswith("amdllm"):
                bad.append(f"{p.relative_to(PKG.parent)}:{lineno}: local import of {t}")
            elif not justified(lines, lineno):
                bad.append(f"{p.relative_to(PKG.parent)}:{lineno}: local import of {t} without a comment saying why")
    assert not bad, "\n".join(bad)


def test_layers_table_covers_every_module():
    for m in modules():
        assert layer(m) is not None, m
    doc = (PKG / "__init__.py").read_text()
    for prefix, n in LAYERS.items():
        if prefix != "amdllm":
            assert f"L{n}" in doc and prefix.split(".")[1] in doc, prefix  # the docstring draws the same layers


def test_only_the_seam_imports_a_backend():
    """A backend (amdllm.backends.cpu) is imported by its own folder and the seam (amdllm.backends) only: the
    core runs without it (AMDLLM_BACKEND=off) and never reaches past the seam."""
    known = modules()
    bad = [f"{m} imports {t}" for m, p in known.items() for t, _, _, _ in imports(p, known)
           if t.startswith("amdllm.backends.") and not m.startswith("amdllm.backends")]
    assert not bad, "\n".join(bad)
    tests = Path(__file__).resolve().parent
    users = sorted(p.name for p in tests.rglob("*.py") if "amdllm.backends.cpu" in p.read_text()
                   or "from amdllm.backends import cpu" in p.read_text())
    assert users == ["test_backend_cpu.py", "test_imports.py"], users  # the backend's own tests
