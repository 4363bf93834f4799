"""Imports run one way: no cycle among hrm_edge's modules, counting every import statement (module level and
inside functions). A module's `if __name__ == "__main__":` block is its script entry, not part of the module
(importing the module never runs it), so it is left out: `python -m hrm_edge.parity` wires the ARM64 gate in
there, which builds on hrm_edge.parity."""
import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "hrm_edge"


def is_script_entry(node) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__")


def imported_modules(path: Path, modules: set) -> set:
    tree = ast.parse(path.read_text())
    skip = {id(n) for top in tree.body if is_script_entry(top) for n in ast.walk(top)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("hrm_edge.")}
        elif isinstance(node, ast.ImportFrom) and node.module == "hrm_edge":
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hrm_edge."):
            found.add(node.module.split(".")[1])
    return found - {path.stem}


def import_graph() -> dict:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return {p.stem: imported_modules(p, modules) for p in PACKAGE.glob("*.py")}


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
    assert "parity" in graph["arm64"] and "arm64" not in graph["parity"]  # the one direction of issue 13
    assert "train" not in graph["parity"] and "checkpoint" in graph["parity"]


def test_the_check_finds_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: a function-level import that closes a loop is found; a script entry is not one."""
    pkg = tmp_path / "hrm_edge"
    pkg.mkdir()
    (pkg / "a.py").write_text("from hrm_edge.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from hrm_edge import a\n")
    (pkg / "c.py").write_text("import hrm_edge.b\nif __name__ == '__main__':\n    import hrm_edge.a\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    graph = import_graph()
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"b"}}
    assert find_cycles(graph) == [["a", "b", "a"]]
