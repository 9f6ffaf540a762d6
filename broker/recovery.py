"""Rebuilding broker state from its store: at start-up, after a failed
commit, and when a queued trajectory that was evicted from memory is about
to be delivered.

A trajectory is stored as its applied turn frames plus small state rows;
replaying the frames through `Trajectory.append_turn` (deterministic) and the
recorded gap gives back exactly the merged trajectory that was acked.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import NamedTuple

from rollstream.common.errors import LocalProtocolError
from rollstream.common.jobs import job_of
from rollstream.common.trajectory import Gap, Trajectory
from rollstream.common.versions import trajectory_sampled, trajectory_version
from rollstream.common.wire import turn_from_message

from .engine import ARCHIVING, OPEN, Entry, Producer, Run
from .staleness import Policy
from .store import Recovered, Store, StoreCorrupted, StoredTrajectory


def load_trajectory(store: Store, stored: StoredTrajectory) -> Trajectory:
    """Replay a stored trajectory's applied turns. A stored turn that the
    merge refuses is a `RemoteProtocolError`: the record read back breaks the
    rule, not a caller. A record that is not the turn its row names (another
    turn's, or a first turn without its prompt) is `StoreCorrupted`."""
    traj = None
    turn_at = {turn.location: turn.turn for turn in stored.turns if turn.location is not None}  # each applied turn's record
    for index, message in zip(turn_at.values(), store.read_turns(list(turn_at))):
        if message["turn"] != index:
            raise StoreCorrupted(f"trajectory {stored.trajectory_id!r}: the record of its turn {index} holds turn "
                                 f"{message['turn']}")
        if traj is None:
            prompt_tokens = message.arrays.get("prompt_tokens")
            if prompt_tokens is None:
                raise StoreCorrupted(f"trajectory {stored.trajectory_id!r}: the record of its first stored turn "
                                     f"({index}) carries no prompt_tokens")
            traj = Trajectory(
                stored.trajectory_id,
                prompt_tokens,
                group_id=stored.group_id,  # keyed as the broker keys it (the frame holds its job's own id)
                group_size=message.get("group_size"),
                sample_index=message.get("sample_index"),
                metadata=message.get("metadata"),
            )
        try:
            traj.append_turn(turn_from_message(message))
        except LocalProtocolError as error:
            raise error.as_remote() from None
    if traj is None:
        raise StoreCorrupted(f"trajectory {stored.trajectory_id!r} has no stored turns to replay")
    if stored.gap is not None:
        traj.cut_at_gap(Gap(*stored.gap))
    if stored.end_digest is not None:
        traj.reward = stored.reward
        traj.metadata = dict(stored.metadata or {})
    return traj


class Rebuilt(NamedTuple):
    """Broker state as the store holds it, for `MergeEngine.restore`."""

    entries: list[Entry]
    deliverable_groups: Collection[str]
    dedup: Mapping[str, float]
    order: Mapping[str, int]  # queue sequence of each trajectory (the store's `ready_seq`)
    runs: Mapping[str, Run]  # checkpointing trainers' runs
    policies: Mapping[str, Policy] = MappingProxyType({})  # each job's published policy (`Freshness`)
    pruned: Mapping[str, tuple[str, float]] = MappingProxyType({})  # dead letters pruned: id -> (reason, at)

    def engine_state(self) -> tuple:
        """What `MergeEngine.restore` takes."""
        return self.entries, self.deliverable_groups, self.dedup, self.order, self.runs, self.pruned


def rebuild(recovered: Recovered, store: Store) -> Rebuilt:
    """The engine's state from `recovered`: open trajectories replayed into
    memory; ended ones stay in the store until delivered. What sampled an
    open one is read from its turns, a version that names no epoch taken as
    its job's epoch now (when it came is not stored)."""
    epochs = {job: policy.ancestry.epoch for job, policy in recovered.policies.items()}
    entries = []
    for stored in recovered.trajectories:
        if stored.state == ARCHIVING:  # forgotten: only the archive still wants it
            continue
        trajectory = load_trajectory(store, stored) if stored.state == OPEN else None
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
            trained=stored.trained,
            stored_bytes=sum(t.location[2] for t in stored.turns if t.location is not None),
            trajectory=trajectory,
            version=stored.version if trajectory is None else trajectory_version(trajectory),
            sampled=(stored.sampled if trajectory is None
                     else trajectory_sampled(trajectory, epochs.get(job_of(stored.trajectory_id), 0))),
            reward=stored.reward,
            producer=None if stored.producer is None else Producer(stored.producer, stored.producer_key),
        )
        entries.append(entry)
    order = {t.trajectory_id: t.ready_seq or 0 for t in recovered.trajectories if t.state != ARCHIVING}
    return Rebuilt(entries, recovered.deliverable_groups, recovered.dedup, order, recovered.runs, recovered.policies,
                   recovered.pruned)
