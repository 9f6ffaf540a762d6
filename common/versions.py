"""Ordered policy versions: what staleness is counted in.

A turn's `weight_version` is text as its engine wrote it. A staleness
bound needs it ordered: the trainer's step that made those weights. The
rule is one: the text is an integer (`12`), or ends in one after a
non-digit (`step-12`, `v12`, `global_step_12`), and that integer is the
version. Text that holds none has no order; with a bound on, a turn that
carries such a version is refused naming this rule.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

ORDERED_RULE = "an ordered weight_version is an integer, or text ending in one after a non-digit (12, step-12, v12)"
_TRAILING_INTEGER = re.compile(r"(?:^|\D)(\d{1,18})$")


def ordered_version(text: str | None) -> int | None:
    """The integer version `text` holds (its trailing integer), or None."""
    if not text:
        return None
    found = _TRAILING_INTEGER.search(text)
    return None if found is None else int(found.group(1))


def oldest_version(texts: Iterable[str]) -> int | None:
    """The oldest ordered version among `texts` (those that hold one), or None."""
    versions = [v for v in map(ordered_version, texts) if v is not None]
    return min(versions, default=None)


def trajectory_version(trajectory) -> int | None:
    """A `Trajectory`'s version: the oldest its turns (and their weight-version spans) hold."""
    spans = (version for turn_spans in trajectory.weight_version_spans for version, _, _ in turn_spans)
    return oldest_version([*trajectory.weight_versions, *spans])


def delivery_version(fields) -> int | None:
    """A `deliver` message's trajectory version, from its `weight_versions`
    and their `weight_version_spans` (the oldest any holds)."""
    spans = (version for turn_spans in fields.get("weight_version_spans") or () for version, _, _ in turn_spans)
    return oldest_version([*fields.get("weight_versions", ()), *spans])
