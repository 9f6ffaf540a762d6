"""ARCHITECTURE.md names real code: every file path it names exists, and
every class (`BrokerCore`) and method (`Dispatcher.retract`) it names in
backticks is defined in the package. A rename or a move that forgets the
map breaks this test."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "producer", "broker", "consumer", "app", "deploy/ray")
MAP = (ROOT / "ARCHITECTURE.md").read_text()

FILE_PATH = re.compile(r"(?<![\w./-])((?:[a-z_]+/)+[a-z_]+\.(?:py|toml|md))\b")
CODE_NAME = re.compile(r"`([A-Z][A-Za-z]+)(?:\.([a-z_][a-z_0-9]*))?`")


def defined() -> tuple[set[str], set[str]]:
    """Every class (or module-level name, a type alias) of the package, and
    every `Class.method` (or attribute declared in its body) it defines."""
    classes, members = set(), set()
    for package in PACKAGES:
        for path in (ROOT / package).glob("*.py"):
            tree = ast.parse(path.read_text())
            classes.update(target.id for node in tree.body if isinstance(node, ast.Assign)
                           for target in node.targets if isinstance(target, ast.Name))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    classes.add(node.name)
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            members.add(f"{node.name}.{item.name}")
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            members.add(f"{node.name}.{item.target.id}")
    return classes, members


def test_every_file_path_the_map_names_exists():
    paths = set(FILE_PATH.findall(MAP))
    assert len(paths) > 20, sorted(paths)
    missing = sorted(path for path in paths if not (ROOT / path).exists())
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"


def test_every_class_and_method_the_map_names_is_defined():
    classes, members = defined()
    named = CODE_NAME.findall(MAP)
    assert len(named) > 30, named
    missing = sorted({f"{cls}.{member}" if member else cls for cls, member in named
                      if (f"{cls}.{member}" not in members if member else cls not in classes)})
    assert not missing, f"ARCHITECTURE.md names code that is not defined: {missing}"
