"""Rules of the package's layout that a test keeps true."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "rlmetrics"


def _class_names(path: Path) -> list[tuple[str, int]]:
    """The classes a module defines (at any depth) and its module-level type aliases
    (a capitalised name assigned a subscripted type, ``Name = tuple[...]``)."""
    tree = ast.parse(path.read_text(), str(path))
    names = [(n.name, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if (
            isinstance(target, ast.Name)
            and target.id[:1].isupper()
            and not target.id.isupper()
            and isinstance(value, ast.Subscript | ast.BinOp)
        ):
            names.append((target.id, node.lineno))
    return names


def test_no_two_classes_in_src_share_a_name() -> None:
    """A class name (or type alias) means one thing in the whole package, so a reader
    (and a grep) never has to ask which one an import brings in."""
    where: defaultdict[str, list[str]] = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        for name, line in _class_names(path):
            where[name].append(f"{path.relative_to(SRC)}:{line}")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, f"class names defined more than once: {shared}"
