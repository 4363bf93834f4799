"""Imports run one way: no cycle among hrm_edge's modules, counting every import statement (module level, inside
functions and in `if __name__ == "__main__":` blocks). Modules are named in full (hrm_edge.verify.parity); a
package's __init__ is the package's own name. The runtime layer imports no torch."""
import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "hrm_edge"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set) -> set:
    """The hrm_edge modules a file imports: `from hrm_edge.x import y` counts hrm_edge.x.y when that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hrm_edge.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hrm_edge"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= subs or {node.module}
    return {m for m in found if m in modules}


def import_graph(root: Path = PACKAGE) -> dict:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in files}
    graph = {module_name(p, root): imported_modules(p, modules) for p in files}
    # a package's __init__ importing its own modules is not a cycle with them; none of ours does
    return {m: deps - {m} for m, deps in graph.items()}


def find_cycles(graph: dict) -> list[list[str]]:
    done, cycles = set(), []

    def visit(module, path):
        for dep in sorted(graph[module]):
            if dep in path:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in done:
                visit(dep, path + [dep])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
    return cycles


def test_no_import_cycle():
    graph = import_graph()
    assert find_cycles(graph) == []
    assert "hrm_edge.verify.parity" in graph["hrm_edge.verify.arm64_gate"]
    emulation = {"hrm_edge.verify.arm64_gate", "hrm_edge.verify.arm64_worker", "hrm_edge.verify.arm64_toolchain"}
    assert not emulation & graph["hrm_edge.verify.parity"]  # the gate builds on the host gate only
    # what runs inside the emulated Python: the runtime side of parity, not the fetching or the gate
    assert graph["hrm_edge.verify.arm64_worker"] & emulation == set()
    assert "hrm_edge.verify.reference" not in graph["hrm_edge.verify.arm64_worker"]


def test_the_check_finds_a_cycle(tmp_path):
    """The check above can fail: a function-level import or a script entry that closes a loop is found."""
    pkg = tmp_path / "hrm_edge"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from hrm_edge.sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from hrm_edge.sub import a\n")
    (pkg / "c.py").write_text("import hrm_edge.sub.b\n")
    (pkg / "d.py").write_text("import hrm_edge.c\nif __name__ == '__main__':\n    from hrm_edge import e\n")
    (pkg / "e.py").write_text("from hrm_edge.d import x\n")
    graph = import_graph(pkg)
    assert graph["hrm_edge.sub.a"] == {"hrm_edge.sub.b"} and graph["hrm_edge.c"] == {"hrm_edge.sub.b"}
    assert sorted(sorted(set(c)) for c in find_cycles(graph)) == [["hrm_edge.d", "hrm_edge.e"],
                                                                  ["hrm_edge.sub.a", "hrm_edge.sub.b"]]


def test_runtime_layer_imports_no_torch():
    """Every module of hrm_edge.runtime, the runtime side of parity and the ARM64 worker import with torch made
    unimportable (a phone-side Python, the ARM64 ONNX path): torch is loaded only when a .pte is run."""
    modules = [module_name(p, PACKAGE) for p in sorted((PACKAGE / "runtime").glob("*.py"))]
    assert len(modules) >= 3
    modules += ["hrm_edge.verify.parity", "hrm_edge.verify.arm64_worker"]
    code = ("import sys; sys.modules['torch'] = None\n"
            + "".join(f"import {m}\n" for m in modules)
            + "assert 'torch' not in [k for k, v in sys.modules.items() if v is not None]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_torch_check_can_fail():
    code = "import sys; sys.modules['torch'] = None\nimport hrm_edge.model.lm\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0 and "torch" in proc.stderr
