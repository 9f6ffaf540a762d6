"""Every `rollstream.` dotted path the README, ARCHITECTURE.md and docs/
name (in prose, in code, in `from ... import` lines) resolves: the longest
module prefix imports and the rest are attributes of it. A module that
moves breaks this test until the docs follow it."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = sorted(path for path in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md")]
                   if path.exists())

# A dotted path, not part of a file name or a longer word (`x.rollstream.y`, `rollstream-train.png`).
DOTTED = re.compile(r"(?<![\w./-])rollstream(?:\.[A-Za-z_]\w*)+")
# `from rollstream.x import a, b as c` or `from rollstream.x import (a,\n b)`: names a and b of rollstream.x.
FROM_IMPORT = re.compile(r"from\s+(rollstream(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]+)")


def named_paths(text: str) -> set[str]:
    """The dotted paths `text` names, the names its `from ... import` lines take included."""
    paths = set(DOTTED.findall(text))
    for module, names in FROM_IMPORT.findall(text):
        for name in names.strip("()").split(","):
            name = name.split("#")[0].split(" as ")[0].strip()
            if name:
                paths.add(f"{module}.{name}")
    return paths


def documented_paths() -> dict[str, list[str]]:
    """Each path, with the documents that name it."""
    found: dict[str, list[str]] = {}
    for document in DOCUMENTS:
        for path in named_paths(document.read_text()):
            found.setdefault(path, []).append(str(document.relative_to(ROOT)))
    return found


def resolve(path: str) -> object:
    """Import the longest module prefix of `path`, then look the rest up as attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            target = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and (module_name + ".").startswith(error.name + "."):
                continue  # no such module: a shorter prefix, and an attribute of it
            raise  # the module exists but something it imports does not
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise AssertionError(f"{path!r}: not even its first part imports")


PATHS = documented_paths()


def test_the_documents_name_paths_to_check():
    assert DOCUMENTS and len(PATHS) > 10, (DOCUMENTS, sorted(PATHS))


def test_named_paths_reads_prose_code_and_import_lines():
    text = ("The codec (`rollstream.common.codec`) ...\n"
            "from rollstream.consumer import Consumer, masked_log_probs as logp  # a comment\n"
            "from rollstream.producer import (\n    AsyncProducer,\n    Producer,\n)\n"
            "python -m rollstream.app.cli; rollstream-train.png; /etc/rollstream.d/x\n")
    assert named_paths(text) == {"rollstream.common.codec", "rollstream.consumer", "rollstream.consumer.Consumer",
                                 "rollstream.consumer.masked_log_probs", "rollstream.producer",
                                 "rollstream.producer.AsyncProducer", "rollstream.producer.Producer",
                                 "rollstream.app.cli"}


def test_resolve_fails_on_a_path_that_moved():
    assert resolve("rollstream.common.codec.decode") is importlib.import_module("rollstream.common.codec").decode
    with pytest.raises(AttributeError):
        resolve("rollstream.common.codec.no_such_name")
    with pytest.raises(AttributeError):
        resolve("rollstream.common.no_such_module")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_documented_path_resolves(path):
    try:
        resolve(path)
    except (ImportError, AttributeError) as error:
        raise AssertionError(f"{path!r}, named in {', '.join(PATHS[path])}, does not resolve: {error!r}") from error
