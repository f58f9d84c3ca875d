"""Imports flow one way (../shared/DESIGN.md, section 2), with no cycle at all.

atomic (all-or-nothing writes), runs (a run folder read back), graphs (a forward replayed as a
CUDA graph), packed (linear layers on packed CPU weights) and sampling (temperature, top-k, top-p) are the floor everyone may stand on; target and heads build on them; recipe checks head configs against HEADS; distill is pure
tensors; data uses recipe and target; layouts (the engines' folder layouts) build on heads and
artifacts reads through them; trainers use all of those; runtime drafts with heads; export and eval
use the runtime and read checkpoints through runs, never a trainer; cli uses everything.
Checked on the source: every draftsmith import of every module, at module level or inside a
function.
"""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "draftsmith"

# What each part may import from draftsmith (any import, lazy ones included).
FLOOR = {"atomic", "runs", "graphs", "packed", "sampling"}
ALLOWED = {
    "atomic": set(),
    "graphs": set(),
    "packed": set(),
    "sampling": set(),
    "runs": {"atomic"},
    "target": FLOOR,
    "heads": FLOOR | {"target"},
    "recipe": FLOOR | {"heads"},
    "distill": set(),
    "data": FLOOR | {"recipe", "target"},
    "layouts": FLOOR | {"target", "heads"},
    "artifacts": FLOOR | {"target", "heads", "recipe", "layouts"},
    "runtime": FLOOR | {"target", "heads", "artifacts"},
}
# What may never be imported, lazily or not, by a part.
FORBIDDEN = {"export": {"trainers", "cli"}, "eval": {"trainers", "cli"}}


def part_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path) -> list[tuple[str, bool]]:
    """(draftsmith part imported, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "draftsmith" and len(parts) > 1:
                found.append((parts[1], id(node) in top))
    return found


def graph(module_level_only: bool) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = part_of(path)
        for target, at_top in imports(path):
            if target != source and (at_top or not module_level_only):
                edges[source].add(target)
    return edges


def test_low_layers_import_only_what_they_may():
    edges = graph(module_level_only=False)
    assert edges, "found no imports: the scan is broken"
    for part, allowed in ALLOWED.items():
        extra = {t for t in edges.get(part, set()) if t not in allowed and t != "__init__"}
        assert not extra, f"draftsmith.{part} imports {sorted(extra)}"
    for part, forbidden in FORBIDDEN.items():
        assert not edges.get(part, set()) & forbidden, f"draftsmith.{part} imports {sorted(edges[part] & forbidden)}"


def test_nothing_imports_the_command_line():
    edges = graph(module_level_only=False)
    assert not [part for part, targets in edges.items() if "cli" in targets]


def test_imports_have_no_cycle_lazy_ones_included():
    edges = graph(module_level_only=False)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges.get(node, ()):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join(path + [node, nxt])}"
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in list(edges):
        if node not in state:
            visit(node, [])


def module_name(path: Path) -> str:
    """draftsmith's dotted name of a source file (a package is its __init__)."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["draftsmith", *parts])


def file_graph() -> dict[str, set[str]]:
    """Module -> the draftsmith modules it imports (lazily too). ``from package import name``
    points at the submodule when `name` is one, else at the package; importing a submodule is
    not counted as importing its package's __init__ (else every sibling import would close a loop
    through the __init__ that re-exports it)."""
    known = {module_name(p) for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module for alias in node.names]
            for target in targets:
                if target.startswith("draftsmith.") and target in known and target != source:
                    edges[source].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]):
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_no_two_files_import_each_other_even_inside_one_package():
    edges = file_graph()
    assert len(edges) > 20, "the file scan found too few modules"
    cycle = find_cycle(edges)
    assert cycle is None, f"import cycle between files: {' -> '.join(cycle)}"


def test_the_file_scan_sees_a_cycle_inside_a_package(tmp_path, monkeypatch):
    """Two modules of one package that import each other (one of them lazily) are caught."""
    fake = tmp_path / "draftsmith"
    (fake / "eval").mkdir(parents=True)
    (fake / "eval" / "__init__.py").write_text("")
    (fake / "eval" / "run.py").write_text("from draftsmith.eval.early_exit import sweep\n")
    (fake / "eval" / "early_exit.py").write_text("def sweep():\n    from draftsmith.eval import run\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    cycle = find_cycle(file_graph())
    assert cycle is not None and set(cycle) == {"draftsmith.eval.run", "draftsmith.eval.early_exit"}


def test_the_scan_sees_a_forbidden_import(tmp_path, monkeypatch):
    """The checks above can fail: a heads module importing the trainers is caught."""
    fake = tmp_path / "draftsmith"
    (fake / "heads").mkdir(parents=True)
    (fake / "heads" / "bad.py").write_text("from draftsmith.trainers import loop\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert graph(module_level_only=True) == {"heads": {"trainers"}}


def test_the_schema_names_exactly_the_registered_trainers():
    """recipe.py owns the trainer names (a closed set in the schema, with each trainer's rules);
    draftsmith.trainers owns the classes: both lists must agree."""
    import dataclasses
    import typing

    from draftsmith.recipe import TRAINER_RULES, Recipe
    from draftsmith.trainers import TRAINERS

    (field,) = [f for f in dataclasses.fields(Recipe) if f.name == "trainer"]
    names = set(typing.get_args(typing.get_type_hints(Recipe)["trainer"]))
    assert names == set(TRAINERS) == set(TRAINER_RULES), (names, set(TRAINERS), set(TRAINER_RULES))
    assert field.default in names
