"""A trajectory's facts named as the archive names them (docs/archive.md),
from the store's rows, without pyarrow: the archive's writer (archive.py,
which only `--archive` imports) and the admin `history` answer share these,
so a live broker's rows and the archive's say the same of one trajectory."""
from __future__ import annotations

import math
from typing import Any

import msgspec

from rollstream.common.jobs import job_of, wire_id
from rollstream.common.trajectory import Trajectory

from .engine import State
from .store import StoredTrajectory

# What a row the broker still holds reports (`rollstream export`, `history`): its state, an ended one as `queued`.
HELD_OUTCOMES = {State.OPEN: "open", State.SCORING: "scoring", State.ENDED: "queued", State.TRAINED: "trained",
                 State.DEAD: "dead", State.LEFT: "left"}
# The times a row gives, as Unix seconds here and as UTC timestamps in the archive.
TIMES = ("first_turn_at", "ended_at", "first_delivered_at", "committed_at", "dead_at")

_JSON = msgspec.json.Encoder(enc_hook=repr, order="sorted")  # what JSON cannot hold, as its repr


def left_as(dead_reason: str | None, trained_run: str | None) -> str:
    """How an archived trajectory left the broker: dead, trained at a step, or delivered (deleted on commit)."""
    if dead_reason is not None:
        return "dead"
    return "trained" if trained_run is not None else "delivered"


def outcome_of(stored: StoredTrajectory) -> str:
    """How an archiving row left the broker (`left_as`); a row still held reports its state."""
    if stored.state != State.ARCHIVING:
        return HELD_OUTCOMES[stored.state]
    return left_as(stored.dead_reason, None if stored.trained is None else stored.trained.run)


def as_json(value: Any) -> str | None:
    return None if value is None else _JSON.encode(value).decode()


def as_number(value: Any) -> float | None:
    """A reward as a number, where it is one (a structured reward stays in `reward_json`)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def fact_row(stored: StoredTrajectory) -> dict[str, Any]:
    """What the store's rows say of one trajectory, by the archive's column
    names (times as Unix seconds; its end's metadata aside, which the
    archive keeps and the history answer leaves out). The run is named as
    its job names it (its wire id)."""
    trained = stored.trained
    return {
        "trajectory_id": wire_id(stored.trajectory_id),
        "job": job_of(stored.trajectory_id),
        "run": None if trained is None else wire_id(trained.run),
        "lineage": None if trained is None else trained.lineage,
        "epoch": None if trained is None else trained.epoch,
        "step": None if trained is None else trained.step,
        "position": None if trained is None else trained.position,
        "group_id": None if stored.group_id is None else wire_id(stored.group_id),
        "group_size": stored.group_size,
        "sample_index": stored.sample_index,
        "producer": stored.producer,
        "outcome": outcome_of(stored),
        "dead_reason": stored.dead_reason,
        "gap_turn": None if stored.gap is None else stored.gap[0],
        "gap_field": None if stored.gap is None else stored.gap[1],
        "reward": as_number(stored.reward),
        "reward_json": as_json(stored.reward),
        "first_turn_at": stored.turns[0].at if stored.turns else None,
        "ended_at": stored.turns[-1].at if stored.turns else None,
        "first_delivered_at": stored.first_delivered_at,
        "committed_at": stored.committed_at,
        "dead_at": stored.dead_at,
        "deliveries": stored.deliveries,
    }


def history_row(stored: StoredTrajectory, merged: Trajectory | None) -> dict[str, Any]:
    """One held trajectory as the archive's columns (`fact_row`), with what
    its records hold (`merged`; None: it has no record, and those columns
    are None)."""
    return {
        **fact_row(stored),
        "status": None if merged is None else merged.status,
        "turns": None if merged is None else merged.turns,
        "response_length": None if merged is None else merged.response_length,
        "weight_version_spans": None if merged is None else [
            [{"version": v, "start": a, "end": b} for v, a, b in spans] for spans in merged.weight_version_spans],
    }
