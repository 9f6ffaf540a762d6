"""A source's prompt cursor: which prompts it issued, under which ids, and
which samples of them it finished, kept in the spool directory so that a
restarted daemon issues every prompt exactly once however often it dies.

Prompt `p`'s sample `j` is the trajectory `{stem}-{p}-{j}` (its group
`{stem}-{p}`), where the stem is the producer id and a run token drawn
when the cursor is made and kept with it: ids follow from the prompt, the
same across restarts, and a new spool (a new run) never reuses one.

The file, `CURSOR` in the spool directory, is JSON lines: a header (the
run token, what the prompts are, the group size, the next sample to
issue and the samples issued and not finished when it was written), then
one line per sample issued (`{"i": [p, j]}`) and finished (`{"d": [p,
j]}`). A sample is recorded issued before its first frame is sent and
finished before its `end` or final `abort` is, so a crash in between
leaves it issued: the broker then still holds it (handed back), or never
saw it (issued again). When the lines outgrow what is outstanding the
file is written anew (a temporary file, renamed). A torn last line (a
crash mid-write) is ignored; anything else unreadable refuses the start.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from rollstream.common.errors import InvalidInput

FILE = "CURSOR"
_REWRITE_FROM_LINES = 4096  # lines past the header before the file is written anew (or twice what is outstanding)

Sample = tuple[int, int]  # (prompt, sample index)


class CursorError(InvalidInput):
    """The cursor cannot be used with these settings or is damaged; the
    message names the file and the rule."""


class PromptCursor:
    """The prompts a source issued and finished (see the module doc). With
    no directory nothing is kept: every start is a first one."""

    def __init__(self, directory: str | os.PathLike | None, producer_id: str, *, prompts: str, group_size: int,
                 fsync: bool = False):
        self.path = None if directory is None else Path(directory) / FILE
        self.fsync = fsync
        self.group_size = group_size
        self.next: Sample = (0, 0)  # the next sample never issued
        self.outstanding: set[Sample] = set()  # issued, not finished
        self.restored = False  # an earlier run's cursor was read
        run = secrets.token_hex(4)
        if self.path is not None and self.path.exists():
            run = self._read(prompts)
            self.restored = True
        self.stem = f"{producer_id}-{run}"
        self._run, self._prompts = run, prompts
        self._lines = 0
        self._file: Any = None
        if self.path is not None:
            self._rewrite()

    def trajectory_id(self, sample: Sample) -> str:
        return f"{self.stem}-{sample[0]}-{sample[1]}"

    def group_id(self, prompt: int) -> str:
        return f"{self.stem}-{prompt}"

    def sample_of(self, trajectory_id: str) -> Sample | None:
        """The (prompt, sample) trajectory `trajectory_id` stands for, or
        None when it is not one of this cursor's ids."""
        stem, _, rest = trajectory_id.rpartition("-")
        stem, _, prompt = stem.rpartition("-")
        if stem != self.stem or not (prompt.isascii() and prompt.isdigit() and rest.isascii() and rest.isdigit()):
            return None
        sample = (int(prompt), int(rest))
        return sample if self.trajectory_id(sample) == trajectory_id else None  # as it writes them: no leading zeros

    def after(self, sample: Sample) -> Sample:
        prompt, index = sample
        return (prompt, index + 1) if index + 1 < self.group_size else (prompt + 1, 0)

    # -- recording ---------------------------------------------------------------
    def issued(self, sample: Sample) -> None:
        """`sample` is about to send its first frame."""
        self._issue(sample)
        self._append({"i": list(sample)})

    def _issue(self, sample: Sample) -> None:
        self.outstanding.add(sample)
        self.next = max(self.next, self.after(sample))

    def finished(self, sample: Sample) -> None:
        """`sample` is about to send its `end` (or gives up): it is not issued again."""
        self.outstanding.discard(sample)
        self._append({"d": list(sample)})

    def _append(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self._lines += 1
        if self._lines > max(_REWRITE_FROM_LINES, 2 * len(self.outstanding)):
            self._rewrite()

    def _rewrite(self) -> None:
        assert self.path is not None  # only a kept cursor is written
        if self._file is not None:
            self._file.close()
        header = {"run": self._run, "prompts": self._prompts, "group_size": self.group_size, "next": list(self.next),
                  "outstanding": sorted(map(list, self.outstanding))}
        temporary = self.path.with_name(FILE + ".new")
        with temporary.open("w", encoding="utf-8") as out:
            out.write(json.dumps(header, separators=(",", ":")) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.path)
        if self.fsync:
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        self._file = self.path.open("a", encoding="utf-8")
        self._lines = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- restoring ---------------------------------------------------------------
    def _read(self, prompts: str) -> str:
        assert self.path is not None
        lines = self.path.read_bytes().split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        records = []
        for number, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line.decode("utf-8")))
            except ValueError:  # (a UnicodeDecodeError is one)
                if number == len(lines):  # torn by a crash mid-write: never acted on
                    break
                raise CursorError(f"{self.path}:{number}: rule 'every line is a JSON record' not met: got {line[:80]!r}; "
                                  "the cursor is damaged (move it away to start the prompts over)") from None
        if not records or not isinstance(records[0], dict) or \
                not {"run", "prompts", "group_size", "next", "outstanding"} <= set(records[0]):
            raise CursorError(f"{self.path}: rule 'the first line is the cursor's header' not met: got "
                              f"{records[0] if records else 'an empty file'!r:.120}")
        header = records[0]
        if not isinstance(header["run"], str) or not header["run"]:
            raise CursorError(f"{self.path}:1: rule 'the run token is a non-empty string' not met: got {header['run']!r:.80}")
        for name, want in (("prompts", prompts), ("group_size", self.group_size)):
            if header[name] != want:
                raise CursorError(f"{self.path}: the prompt cursor was kept for {name} {header[name]!r}, this run has "
                                  f"{want!r}: expected the same prompts and group size to go on from it (use a new "
                                  "spool directory for a new run)")
        self.next = _sample(header["next"], self.path, 1)
        if not isinstance(header["outstanding"], list):
            raise CursorError(f"{self.path}:1: rule 'outstanding is a list of samples' not met: got "
                              f"{header['outstanding']!r:.80}")
        self.outstanding = {_sample(sample, self.path, 1) for sample in header["outstanding"]}
        for number, record in enumerate(records[1:], 2):
            if not isinstance(record, dict) or len(record) != 1 or not {"i", "d"} >= set(record):
                raise CursorError(f"{self.path}:{number}: rule 'a line after the header is {{\"i\": [p, j]}} or "
                                  f"{{\"d\": [p, j]}}' not met: got {record!r:.80}")
            ((kind, value),) = record.items()
            sample = _sample(value, self.path, number)
            if kind == "i":
                self._issue(sample)
            else:
                self.outstanding.discard(sample)
        return str(header["run"])


def _sample(value: Any, path: Path, line: int) -> Sample:
    """A (prompt, sample) pair read from the cursor file, or `CursorError`."""
    if not (isinstance(value, list) and len(value) == 2 and all(type(n) is int and n >= 0 for n in value)):
        raise CursorError(f"{path}:{line}: rule 'a sample is [prompt, sample], two non-negative integers' not met: "
                          f"got {value!r:.80}")
    return value[0], value[1]
