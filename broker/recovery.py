"""Rebuilding broker state from its store: at start-up, and when a ready
trajectory that was evicted from memory is about to be delivered.

A trajectory is stored as its applied turn frames plus small state rows;
replaying the frames through `Trajectory.append_turn` (deterministic) and the
recorded gap gives back exactly the merged trajectory that was acked.
"""
from __future__ import annotations

from rollstream.common.trajectory import Gap, Trajectory
from rollstream.common.wire import turn_from_message

from .engine import DEAD, ENDED, LEFT, OPEN, DeliveryUnit, Entry, Group, MergeEngine
from .store import Recovered, Store, StoreCorrupted, StoredTrajectory


def load_trajectory(store: Store, stored: StoredTrajectory) -> Trajectory:
    """Replay a stored trajectory's applied turns."""
    traj = None
    for message in store.read_turns([turn.location for turn in stored.turns if turn.location is not None]):
        if traj is None:
            traj = Trajectory(
                stored.trajectory_id,
                message.arrays["prompt_tokens"],
                group_id=message.get("group_id"),
                group_size=message.get("group_size"),
                sample_index=message.get("sample_index"),
                metadata=message.get("metadata"),
            )
        traj.append_turn(turn_from_message(message))
    if traj is None:
        raise StoreCorrupted(f"trajectory {stored.trajectory_id!r} has no stored turns to replay")
    if stored.gap is not None:
        traj.cut_at_gap(Gap(*stored.gap))
    if stored.end_digest is not None:
        traj.reward = stored.reward
        traj.metadata = dict(stored.metadata or {})
    return traj


def restore(engine: MergeEngine, recovered: Recovered, store: Store) -> list[DeliveryUnit]:
    """Fill an empty engine from `recovered`; returns the units to deliver,
    oldest first. Open trajectories are replayed into memory; ended ones
    stay in the store until delivered."""
    ready: list[tuple[int, DeliveryUnit]] = []
    for stored in recovered.trajectories:
        entry = Entry(
            stored.trajectory_id,
            stored.state,
            stored.group_id,
            stored.group_size,
            stored.sample_index,
            [(t.digest, t.applied, t.reason) for t in stored.turns],
            stored.end_digest,
            stored.updated_at,
            dead_reason=stored.dead_reason,
            dead_at=stored.dead_at,
        )
        if entry.state == OPEN:
            entry.trajectory = load_trajectory(store, stored)
        engine.entries[entry.trajectory_id] = entry
        if entry.group_id is not None:
            group = engine.groups.setdefault(entry.group_id, Group(entry.group_size))
            group.members[entry.trajectory_id] = LEFT if entry.state == DEAD else entry.state
            group.updated_at = max(group.updated_at, entry.updated_at)
    engine.remember(recovered.dedup)

    # Group releases commit atomically with the frame that completed the
    # group, so every complete group is in `released_groups`.
    ready_seq = {t.trajectory_id: t.ready_seq or 0 for t in recovered.trajectories}
    for group_id, group in engine.groups.items():
        if group_id in recovered.released_groups:
            ended = tuple(t for t, state in group.members.items() if state == ENDED)
            group.pending = set(ended)
            if ended:
                unit = DeliveryUnit(ended, group_id, group.size, group.size - len(ended))
                ready.append((min(ready_seq[t] for t in ended), unit))
    engine.reindex()
    for entry in engine.entries.values():
        if entry.state == ENDED and entry.group_id is None:
            ready.append((ready_seq[entry.trajectory_id], DeliveryUnit((entry.trajectory_id,))))
    return [unit for _, unit in sorted(ready, key=lambda pair: pair[0])]
