"""Ordered policy versions: what staleness is counted in, and which
lineage of the model sampled a trajectory.

A turn's `weight_version` is text as its engine wrote it. A staleness
bound needs it ordered: the trainer's step that made those weights. The
rule is one: the text is an integer (`12`), or ends in one after a
non-digit (`step-12`, `v12`, `global_step_12`), and that integer is the
step. Text that holds none has no order; with a bound on, a turn that
carries such a version is refused naming this rule.

A resumed trainer starts a new lineage epoch from its checkpoint's step,
so a version is (epoch, step). The text may name its epoch first
(`e1:12`, `e1:step-12`: `version_label` writes it); a version that names
none belongs to the epoch its job was in when the broker took it. Steps
go on counting across epochs, so staleness is counted in steps; the epoch
says whether the weights are in the surviving model's ancestry (`Ancestry`).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from rollstream.common.errors import InvalidInput

ORDERED_RULE = ("an ordered weight_version is an integer, or text ending in one after a non-digit (12, step-12, v12), "
                "optionally after a lineage epoch (e1:12)")
_TRAILING_INTEGER = re.compile(r"(?:^|\D)(\d{1,18})$")
_EPOCH = re.compile(r"e(\d{1,9}):")


class Version(NamedTuple):
    epoch: int | None  # None: the text names none
    step: int


@functools.lru_cache(maxsize=4096)  # a run's turns carry a handful of versions: each is read once
def parse_version(text: str | None) -> Version | None:
    """The (epoch, step) `text` holds, or None when it holds no step."""
    if not text:
        return None
    named = _EPOCH.match(text)
    found = _TRAILING_INTEGER.search(text[named.end():] if named else text)
    if found is None:
        return None
    return Version(None if named is None else int(named.group(1)), int(found.group(1)))


def version_label(step: int, epoch: int = 0) -> str:
    """The `weight_version` text of the weights a trainer made at `step` in
    lineage `epoch` (the epoch is left out while it is 0)."""
    return str(step) if epoch == 0 else f"e{epoch}:{step}"


def ordered_version(text: str | None) -> int | None:
    """The step `text` holds, or None."""
    version = parse_version(text)
    return None if version is None else version.step


def oldest_version(texts: Iterable[str]) -> int | None:
    """The oldest step among `texts` (those that hold one), or None."""
    versions = [v for v in map(ordered_version, texts) if v is not None]
    return min(versions, default=None)


def _trajectory_texts(trajectory) -> list[str]:
    spans = (version for turn_spans in trajectory.weight_version_spans for version, _, _ in turn_spans)
    return [*trajectory.weight_versions, *spans]


def trajectory_version(trajectory) -> int | None:
    """A `Trajectory`'s version: the oldest step its turns (and their weight-version spans) hold."""
    return oldest_version(_trajectory_texts(trajectory))


def delivery_version(fields) -> int | None:
    """A `deliver` message's trajectory version, from its `weight_versions`
    and their `weight_version_spans` (the oldest any holds)."""
    spans = (version for turn_spans in fields.get("weight_version_spans") or () for version, _, _ in turn_spans)
    return oldest_version([*fields.get("weight_versions", ()), *spans])


# What sampled a trajectory: for each lineage epoch, the newest step of its weights among the trajectory's turns
# (epochs ascending). It is what `Ancestry.abandoned` judges.
Sampled = tuple[tuple[int, int], ...]


def add_sampled(sampled: Sampled, versions: Iterable[Version], epoch: int) -> Sampled:
    """`sampled` with `versions` added; one that names no epoch is of `epoch`."""
    for version in versions:
        at = epoch if version.epoch is None else version.epoch
        for i, (known, step) in enumerate(sampled):
            if known == at:
                if version.step > step:
                    sampled = (*sampled[:i], (at, version.step), *sampled[i + 1:])
                break
        else:
            sampled = tuple(sorted((*sampled, (at, version.step))))
    return sampled


def trajectory_sampled(trajectory, epoch: int) -> Sampled:
    """A `Trajectory`'s `Sampled`, versions that name no epoch taken as `epoch`."""
    versions = [v for v in map(parse_version, _trajectory_texts(trajectory)) if v is not None]
    return add_sampled((), versions, epoch)


@dataclass(frozen=True, slots=True)
class Ancestry:
    """A run's ancestry as its current trainer knows it: its branches, one
    per resume, oldest first, each the lineage epoch the resume started and
    the step of the checkpoint it started from. Epoch 0 is the first start;
    each resume's epoch is higher than any before it."""

    branches: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, branches: Sequence[Sequence[int]] | None) -> Ancestry:
        """From the wire or the store: [[epoch, step], ...]; epochs must rise, each at least 1."""
        pairs = tuple(tuple(pair) for pair in branches or ())
        if not all(len(pair) == 2 and all(type(n) is int and n >= 0 for n in pair) for pair in pairs):
            raise InvalidInput(f"an ancestry is a list of [epoch, step] branches of integers >= 0, got {branches!r}")
        epochs = [epoch for epoch, _ in pairs]
        if any(e < 1 for e in epochs) or any(b <= a for a, b in zip(epochs, epochs[1:])):
            raise InvalidInput(f"rule 'lineage epochs rise from 1' violated: got epochs {epochs}")
        return cls(pairs)  # type: ignore[arg-type]

    @property
    def epoch(self) -> int:
        return self.branches[-1][0] if self.branches else 0

    @property
    def resumed_from(self) -> int | None:
        """The step the current epoch started from (None: no resume yet)."""
        return self.branches[-1][1] if self.branches else None

    def cut(self, epoch: int) -> int | None:
        """The newest step of `epoch` whose weights the current one descends
        from (None: all of them)."""
        return min((step for at, step in self.branches if at > epoch), default=None)

    def abandoned(self, sampled: Sampled) -> bool:
        """Whether weights an abandoned lineage made (newer than where a
        later epoch resumed from) sampled any of it."""
        for epoch, step in sampled:
            cut = self.cut(epoch)
            if cut is not None and step > cut:
                return True
        return False

    def to_wire(self) -> list[list[int]]:
        return [list(pair) for pair in self.branches]


Lineage = Ancestry  # the name before a lineage meant one start of a run only; a renamed public class keeps its old name
