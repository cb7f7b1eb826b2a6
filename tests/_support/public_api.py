"""The public API of rlmetrics as text, and its comparison with the checked-in snapshot.

The public surface is: every module of the package that declares ``__all__`` and has no
private part in its dotted name (``rlmetrics._engine`` and ``_window_keys`` are left
out), each with the names of its ``__all__``; the entry points of ``pyproject.toml``;
and the command line's subcommands with their options. A function is written with its
``inspect.signature``; a class with its bases, its constructor's signature and every
public method, property and attribute that rlmetrics defines on it or on a base (methods
a class takes from torch, TRL or the standard library are theirs, not ours); a constant
with its type, and its value when that is a short literal.

The snapshot (``tests/unit/public_api.txt``) holds one section per module. A venv checks
the sections of the modules it can import: the core venv all but the ones that need
verl or TRL, which their own venvs check (``FRAMEWORK_MODULES``). With
``RLMETRICS_UPDATE_API=1`` a check rewrites its sections instead of comparing them
(``make api-snapshot`` runs the three).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import enum
import importlib
import inspect
import os
import re
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "rlmetrics"
SNAPSHOT = ROOT / "tests" / "unit" / "public_api.txt"
UPDATE_ENV = "RLMETRICS_UPDATE_API"

FRAMEWORK_MODULES = {
    "rlmetrics.integrations.verl": "verl",
    "rlmetrics.integrations.verl.dataproto": "verl",
    "rlmetrics.integrations.trl": "trl",
    "rlmetrics.integrations.skyrl": "skyrl",
}
"""Modules that import only next to their framework, checked in that framework's venv."""

ENTRY_POINTS = "entry points"
COMMAND_LINE = "command line"

HEADER = f"""\
# The public API of rlmetrics, one [section] per public module (tests/_support/public_api.py
# says what counts). tests/unit/test_public_api.py fails when the code and this file differ.
# A deliberate change: run `make api-snapshot` (or {UPDATE_ENV}=1 with the API tests in the
# core, verl and TRL venvs), review the diff, and name the change in CHANGELOG.md.
"""

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_LITERALS = (str, int, float, bool, type(None))


def public_modules() -> list[str]:
    """Every module under src/rlmetrics that declares ``__all__`` and has no private part
    in its name, found by reading the source (nothing is imported)."""
    names: set[str] = set()
    for path in sorted(SRC.rglob("*.py")):
        parts = ("rlmetrics", *path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts[1:]):
            continue
        if _declares_all(path):
            names.add(".".join(parts))
    return sorted(names)


def _declares_all(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        for node in tree.body
    )


def _clean(text: str) -> str:
    return _ADDRESS.sub("", text)


def _signature(obj: Any) -> str:
    try:
        return _clean(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(<no signature>)"


def _value(value: Any) -> str:
    """A constant's type, with its value when that is a short literal (or a tuple or
    frozenset of literals)."""
    kind = type(value).__name__
    literal = isinstance(value, _LITERALS) or (
        isinstance(value, tuple | frozenset) and all(isinstance(v, _LITERALS) for v in value)
    )
    if isinstance(value, frozenset):
        text = "frozenset(" + repr(sorted(value, key=repr)) + ")"
    else:
        text = repr(value)
    if literal and len(text) <= 160:
        return f"{kind} = {_clean(text)}"
    if not isinstance(value, _LITERALS) and not callable(value):
        return _clean(repr(value)) if kind in ("GenericAlias", "UnionType") else kind
    return kind


def _ours(owner: type) -> bool:
    return owner.__module__.split(".")[0] == "rlmetrics"


def _class_lines(cls: type) -> list[str]:
    bases = ", ".join(f"{b.__module__}.{b.__qualname__}" for b in cls.__bases__)
    lines = [f"class {cls.__qualname__}({bases})"]
    if issubclass(cls, enum.Enum):
        return lines + [f"  member {m.name} = {_clean(repr(m.value))}" for m in cls]
    lines.append(f"  __init__{_signature(cls)}")
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = next((k for k in cls.__mro__ if name in k.__dict__), None)
        if owner is None or not _ours(owner):
            continue
        raw = owner.__dict__[name]
        where = "" if owner is cls else f"  [from {owner.__qualname__}]"
        if isinstance(raw, staticmethod):
            lines.append(f"  staticmethod {name}{_signature(raw.__func__)}{where}")
        elif isinstance(raw, classmethod):
            lines.append(f"  classmethod {name}{_signature(getattr(cls, name))}{where}")
        elif isinstance(raw, property):
            returns = inspect.signature(raw.fget).return_annotation if raw.fget else None
            shown = "" if returns in (None, inspect.Signature.empty) else f" -> {returns}"
            lines.append(f"  property {name}{shown}{where}")
        elif inspect.isfunction(raw):
            lines.append(f"  def {name}{_signature(raw)}{where}")
        elif isinstance(raw, type):
            lines.append(f"  class {name}{where}")
        else:
            lines.append(f"  attr {name}: {_value(raw)}{where}")
    return lines


def describe(name: str, obj: Any) -> list[str]:
    """The lines that stand for one public name."""
    if inspect.isclass(obj):
        lines = _class_lines(obj)
        lines[0] = lines[0].replace(f"class {obj.__qualname__}", f"class {name}", 1)
        return lines
    if type(obj).__module__ in ("types", "typing"):
        return [f"{name} = {_clean(repr(obj))}"]
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return [f"def {name}{_signature(obj)}"]
    if callable(obj):
        return [f"{name}: {type(obj).__name__}{_signature(obj)}"]
    if inspect.ismodule(obj):
        return [f"module {name} = {obj.__name__}"]
    return [f"{name}: {_value(obj)}"]


def module_section(module_name: str) -> list[str]:
    """One module's lines: each public name, sorted, with its signature."""
    module = importlib.import_module(module_name)
    lines: list[str] = []
    for name in sorted(module.__all__):
        lines += describe(name, getattr(module, name))
    return lines


def entry_points_section() -> list[str]:
    """The console scripts and plugin entry points ``pyproject.toml`` declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    return [
        f"{group}: {name} = {target}"
        for group, points in sorted(groups.items())
        for name, target in sorted(points.items())
    ]


def command_line_section() -> list[str]:
    """Each ``rlmetrics`` subcommand with its positional arguments and option strings."""
    from rlmetrics.cli import build_parser

    def options(parser: argparse.ArgumentParser) -> list[str]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            found.append(" / ".join(action.option_strings) or f"<{action.dest}>")
        return found

    lines = []
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in sorted(action.choices.items()):
                lines.append(f"rlmetrics {command}")
                lines += [f"  {option}" for option in options(sub)]
    return lines


def current(sections: Iterable[str]) -> dict[str, list[str]]:
    """The code's lines for each named section."""
    builders: dict[str, Callable[[], list[str]]] = {
        ENTRY_POINTS: entry_points_section,
        COMMAND_LINE: command_line_section,
    }
    return {s: builders[s]() if s in builders else module_section(s) for s in sections}


def read_snapshot(path: Path = SNAPSHOT) -> dict[str, list[str]]:
    """The snapshot's sections: ``[name]`` lines open them; ``#`` lines are comments."""
    sections: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.startswith("#") or not line.strip():
            continue
        if line.startswith("[") and line.endswith("]"):
            lines = sections.setdefault(line[1:-1], [])
        elif lines is not None:
            lines.append(line)
    return sections


def write_snapshot(sections: dict[str, list[str]], path: Path = SNAPSHOT) -> None:
    """Write the sections, modules in name order, entry points and command line last."""
    order = sorted(s for s in sections if s.startswith("rlmetrics"))
    order += [s for s in (ENTRY_POINTS, COMMAND_LINE) if s in sections]
    body = "".join(
        f"\n[{name}]\n" + "".join(f"{line}\n" for line in sections[name]) for name in order
    )
    path.write_text(HEADER + body)


def check(sections: Iterable[str], every_section: Iterable[str] | None = None) -> str:
    """Compare the named sections with the snapshot; return a readable diff, empty when
    they agree. ``every_section``: the sections the snapshot may hold at all (a section
    beyond them is a module that is gone). With ``RLMETRICS_UPDATE_API=1`` write the
    code's sections into the snapshot instead (the others kept, the gone ones dropped)
    and return an empty string."""
    sections = list(sections)
    code = current(sections)
    saved = read_snapshot()
    gone = sorted(set(saved) - set(every_section)) if every_section is not None else []
    if os.environ.get(UPDATE_ENV) == "1":
        kept = {name: lines for name, lines in saved.items() if name not in gone}
        write_snapshot({**kept, **code})
        return ""
    report = [f"--- snapshot [{name}]: no such public module any more" for name in gone]
    for name in sections:
        if saved.get(name) == code[name]:
            continue
        diff = difflib.unified_diff(
            saved.get(name, []),
            code[name],
            f"snapshot [{name}]",
            f"code [{name}]",
            lineterm="",
        )
        report.append("\n".join(diff))
    if not report:
        return ""
    return (
        "The public API differs from tests/unit/public_api.txt (- snapshot, + code):\n\n"
        + "\n\n".join(report)
        + f"\n\nIf the change is deliberate: `make api-snapshot` (or {UPDATE_ENV}=1 with this"
        " test), then name it in CHANGELOG.md."
    )
