"""The scripts in examples/ run, and the snippets the docs show are excerpts of them.

Each ```python block of README.md follows a marker naming its example,
`<!-- excerpt of examples/NAME.py -->`; a block in docs/ with a marker is
held to its example the same way. A snippet is an excerpt when its lines,
stripped of indentation, appear in the example in the same order (blank
lines aside; a line `...` stands for lines left out). Every example runs to
its end here, as a user would run it, and prints a last line `ok: ...`.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*excerpt of (examples/[\w.-]+\.py)\s*-->")
# Examples that need an optional extra: skipped, saying so, where it is not installed.
EXTRAS = {"ray_driver.py": "ray"}
# Seconds an example may take before it counts as hung: only reached when one hangs (Ray and torch start slowly
# on a busy machine).
PATIENCE = 600


@dataclass(frozen=True)
class Snippet:
    document: Path
    line: int  # of its opening fence, from 1
    example: str | None  # the marker's path, relative to the repository
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def python_snippets(document: Path) -> list[Snippet]:
    """Every ```python block of `document`, with the example named on the
    last non-blank line before it (None when that line is no marker)."""
    lines = document.read_text().splitlines()
    found = []
    for number, line in enumerate(lines):
        if line.strip() != "```python":
            continue
        before = next((lines[k] for k in range(number - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.search(before)
        end = next(k for k in range(number + 1, len(lines)) if lines[k].strip() == "```")
        found.append(Snippet(document, number + 1, marker and marker.group(1), tuple(lines[number + 1 : end])))
    return found


def first_missing(snippet: tuple[str, ...], example: list[str]) -> str | None:
    """The first line of `snippet` that `example` lacks after the lines the
    snippet's earlier lines matched; None when every line is there in order."""
    remaining = iter(line.strip() for line in example)
    for line in snippet:
        wanted = line.strip()
        if wanted in ("", "..."):
            continue
        if not any(have == wanted for have in remaining):
            return wanted
    return None


MARKED = [snippet for document in DOCUMENTS for snippet in python_snippets(document)
          if snippet.example is not None or document == README]


def test_first_missing_names_a_changed_or_reordered_line():
    example = ["import torch", "", "def train():", "    x = 1", "    y = 2", "    return x + y"]
    assert first_missing(("import torch", "x = 1", "...", "return x + y"), example) is None
    assert first_missing(("x = 1", "y = 3"), example) == "y = 3"
    assert first_missing(("y = 2", "x = 1"), example) == "x = 1"


def test_every_readme_snippet_names_an_example_that_exists():
    readme = [snippet for snippet in MARKED if snippet.document == README]
    assert len(readme) >= 4, readme
    for snippet in readme:
        assert snippet.example is not None, f"{snippet}: a python snippet must follow <!-- excerpt of examples/NAME.py -->"
        assert (ROOT / snippet.example).is_file(), f"{snippet}: {snippet.example} does not exist"


def test_the_readme_names_every_example():
    text = re.sub(r"<!--.*?-->", "", README.read_text(), flags=re.S)  # where a reader sees it, not in a marker
    assert EXAMPLES
    missing = [path.name for path in EXAMPLES if f"examples/{path.name}" not in text]
    assert not missing, f"README.md does not name {missing}"


@pytest.mark.parametrize("snippet", MARKED, ids=str)
def test_each_snippet_is_an_excerpt_of_its_example(snippet):
    assert snippet.example is not None, f"{snippet}: a python snippet must follow <!-- excerpt of examples/NAME.py -->"
    example = (ROOT / snippet.example).read_text().splitlines()
    missing = first_missing(snippet.lines, example)
    assert missing is None, (f"{snippet}: the snippet's line {missing!r} is not in {snippet.example} "
                             f"(after the lines before it in the snippet)")


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_each_example_runs_to_its_end(example, tmp_path):
    extra = EXTRAS.get(example.name)
    if extra is not None and importlib.util.find_spec(extra) is None:
        pytest.skip(f"{example.name} needs the optional extra {extra!r}: pip install 'rollstream[{extra}]'")
    done = subprocess.run([sys.executable, str(example)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=PATIENCE)
    said = done.stdout.strip().splitlines()
    tail = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{example.name} must exit with 0, got {done.returncode}\n{tail}"
    assert said and said[-1].startswith("ok: "), f"{example.name} must end by printing 'ok: ...'\n{tail}"
