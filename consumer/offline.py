"""Offline replay: a run's trained data handed to a trainer again, from a
dataset `rollstream export` wrote, as the same `Batch` objects a live run
gave it (docs/archive.md, "Training on it again").

It is a second shell over `ConsumerCore` (consumer/core.py), as the core
was built for: the core decides as it does against brokers (validation,
batches, commits, `state_dict`, resume), and where the `Consumer` shell
has sockets, this one has an `ArchiveServer`, which answers the core's
messages as one broker would, from the dataset. Every batch is handed out
the way a live resume hands back what a run trained after its checkpoint:
the core asks (`resume`) and the server answers with each batch's step and
trajectories in order, then delivers them (`replay: true`), a few steps
ahead of the trainer. So a batch holds exactly the trajectories it lists,
in their order, whatever the batch size; a trainer resumed from an offline
replay's own `state_dict` gets the batches after its checkpoint, the same
ones again.

`order="as_trained"` gives the recorded batches, step by step; `"shuffled"`
deals the selected trajectories (whole groups) into new batches of
`batch_size`, in an order `seed` fixes, each once. The selected rows are
read into memory (Arrow, columnar): select steps to bound it. pyarrow is
imported here only (the archive extra).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rollstream.common.clock import Clock
from rollstream.common.codec import decode
from rollstream.common.contract import ARRAYS, CONTEXT_REPLAY_ARRAYS, SUPPORT_LOG_PROB_ARRAYS, TOKEN_LOG_PROB_ARRAYS
from rollstream.common.errors import ExtraMissing, InvalidInput
from rollstream.common.jobs import DEFAULT_JOB
from rollstream.common.messages import BROKER_TO_CONSUMER
from rollstream.common.trajectory import Gap, Trajectory
from rollstream.common.wire import encode_deliver

from .client import Consumer
from .core import ConsumerClosed, Form
from .position import STATE_FORMAT

ORDERS = ("as_trained", "shuffled")
_ARRAY_COLUMNS = ("prompt_tokens", "tokens", "log_probs", "loss_mask", "mask_ids", "mask_offsets",
                  *CONTEXT_REPLAY_ARRAYS, *TOKEN_LOG_PROB_ARRAYS, *SUPPORT_LOG_PROB_ARRAYS)
# Columns a dataset of an older schema version lacks: version 1 the per-token log-probs, 1 and 2 the per-support-id ones.
_LATER_COLUMNS = (*TOKEN_LOG_PROB_ARRAYS, *SUPPORT_LOG_PROB_ARRAYS)
_COLUMNS = ("trajectory_id", "job", "run", "epoch", "step", "position", "group_id", "group_size", "sample_index", "status",
            "turns", "gap_turn", "gap_field", "reward_json", "metadata_json", "weight_versions", "weight_version_spans",
            *_ARRAY_COLUMNS, *(f"{name}_shape" for name in CONTEXT_REPLAY_ARRAYS))
_ARCHIVE_KEY, _DATASET_KEY = b"rollstream:archive_schema", b"rollstream:dataset_schema"
AHEAD = 2  # steps delivered ahead of the last one trained: what the trainer waits for is already here


class ArchivedRows:
    """The trained rows of one run in a dataset, read once and dealt into
    batches (`batches`: each step with its rows, in batch order)."""

    def __init__(self, path: str | os.PathLike, *, job: str = DEFAULT_JOB, run: str | None = None,
                 steps: tuple[int, int] | None = None, order: str = "as_trained", seed: int | None = None,
                 batch_size: int | None = None, unit: str = "trajectory"):
        try:
            import pyarrow.dataset as ds
        except ImportError:
            raise ExtraMissing("pyarrow", "archive", "an offline replay (it reads Parquet)") from None

        if order not in ORDERS:
            raise InvalidInput(f"order must be one of {ORDERS}, got {order!r}")
        if order == "shuffled" and (type(seed) is not int or type(batch_size) is not int or batch_size < 1):
            raise InvalidInput(f"a shuffled replay is repeatable and sized: expected an integer seed and batch_size "
                               f">= 1, got seed={seed!r}, batch_size={batch_size!r}")
        if steps is not None and not (len(steps) == 2 and all(type(s) is int for s in steps) and 0 <= steps[0] <= steps[1]):
            raise InvalidInput(f"steps is an inclusive range (first, last) of steps >= 0, got {steps!r}")
        path = Path(path)
        if not path.exists():
            raise InvalidInput(f"a replay reads a dataset `rollstream export` wrote: expected a Parquet file or "
                               f"directory at {path}, found nothing")
        data = ds.dataset(path, format="parquet", partitioning="hive" if path.is_dir() else None)
        metadata = data.schema.metadata or {}
        if _ARCHIVE_KEY in metadata:
            raise InvalidInput(f"{path} is a broker's archive, whose records are not merged yet: expected a dataset; "
                               f"write one with `rollstream export --archive {path} --out run.parquet` and replay that")
        if _DATASET_KEY not in metadata:
            raise InvalidInput(f"{path} is not a dataset `rollstream export` wrote: expected Parquet files whose "
                               f"metadata names {_DATASET_KEY.decode()}")
        condition = (ds.field("outcome") == "trained") & (ds.field("job") == job)
        if run is not None:
            condition &= ds.field("run") == run
        if steps is not None:
            condition &= (ds.field("step") >= steps[0]) & (ds.field("step") <= steps[1])
        # A dataset of an older schema version predates some log-prob columns: its rows have none of them.
        columns = [name for name in _COLUMNS if name not in _LATER_COLUMNS or name in data.schema.names]
        table = data.to_table(columns=columns, filter=condition)
        runs = sorted(set(table.column("run").to_pylist()))
        if not runs:
            raise InvalidInput(f"no trajectory of job {job!r}{'' if run is None else f' run {run!r}'}"
                               f"{'' if steps is None else f' at steps {steps[0]}..{steps[1]}'} was trained in {path}: "
                               "expected a selection that holds some")
        if len(runs) > 1:
            raise InvalidInput(f"{path} holds what more than one run trained: expected run= to name one of {runs}")
        self.run = runs[0]
        self.path = path
        self._facts = {name: table.column(name).to_pylist() for name in _COLUMNS if name not in _ARRAY_COLUMNS}
        self._arrays = {name: _ragged(table.column(name), name) for name in _ARRAY_COLUMNS if name in columns}
        recorded = sorted(range(table.num_rows), key=lambda i: (self._facts["step"][i], self._facts["position"][i]))
        if order == "as_trained":
            self.batches = self._recorded(recorded)
        else:
            assert batch_size is not None  # checked above
            self.batches = self._dealt(recorded, np.random.default_rng(seed), batch_size, unit,
                                       first_step=1 if steps is None else steps[0])

    @property
    def epochs(self) -> dict[int, int | None]:
        """Each recorded step's lineage epoch, as the run trained it (None: not known)."""
        return dict(zip(self._facts["step"], self._facts["epoch"]))

    def _recorded(self, rows: list[int]) -> list[tuple[int, list[int]]]:
        """The batches as trained: each step's rows by position (a position held twice is refused)."""
        batches: dict[int, list[int]] = {}
        steps, positions = self._facts["step"], self._facts["position"]
        for i in rows:
            batch = batches.setdefault(steps[i], [])
            if batch and positions[batch[-1]] == positions[i]:
                raise InvalidInput(f"step {steps[i]} of run {self.run!r} lists two trajectories at position "
                                   f"{positions[i]} ({self._facts['trajectory_id'][batch[-1]]!r} and "
                                   f"{self._facts['trajectory_id'][i]!r}): expected one per position")
            batch.append(i)
        return sorted(batches.items())

    def _dealt(self, rows: list[int], rng: np.random.Generator, batch_size: int, unit: str,
               first_step: int) -> list[tuple[int, list[int]]]:
        """The rows in units (a group whole, else one trajectory), the units
        in an order `rng` draws, dealt into batches of `batch_size` units
        (`unit="group"`) or of `batch_size` trajectories at most (a group
        never split: one larger than that comes alone)."""
        units: dict[Any, list[int]] = {}
        for i in rows:
            group = self._facts["group_id"][i]
            units.setdefault(("group", group) if group is not None else ("one", i), []).append(i)
        ordered = list(units.values())
        dealt = [ordered[k] for k in rng.permutation(len(ordered))]
        batches: list[list[int]] = [[]]
        counted = 0
        for members in dealt:
            size = 1 if unit == "group" else len(members)
            if batches[-1] and counted + size > batch_size:
                batches.append([])
                counted = 0
            batches[-1] += members
            counted += size
        return [(first_step + k, batch) for k, batch in enumerate(batches)]

    def trajectory(self, row: int) -> Trajectory:
        """Row `row` as the trajectory a broker delivered."""
        facts = self._facts
        arrays = {name: values(row) for name, values in self._arrays.items() if values(row) is not None}
        for name in CONTEXT_REPLAY_ARRAYS:  # kept flat beside their shape
            if name in arrays:
                arrays[name] = arrays[name].reshape(facts[f"{name}_shape"][row])
        gap = None if facts["gap_turn"][row] is None else Gap(facts["gap_turn"][row], facts["gap_field"][row])
        spans = facts["weight_version_spans"][row] or []
        trajectory = Trajectory.from_arrays(
            facts["trajectory_id"][row], arrays, status=facts["status"][row], turns=facts["turns"][row],
            weight_versions=facts["weight_versions"][row] or [],
            weight_version_spans=[[(s["version"], s["start"], s["end"]) for s in entry] for entry in spans],
            gap=gap, metadata=_loaded(facts["metadata_json"][row]) or {},
            **{name: facts[name][row] for name in ("group_id", "group_size", "sample_index")
               if facts[name][row] is not None})
        trajectory.reward = _loaded(facts["reward_json"][row])
        return trajectory

    def trajectory_id(self, row: int) -> str:
        return self._facts["trajectory_id"][row]


def _loaded(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _ragged(column, name: str):
    """List column `name` as row -> its values (a numpy slice, zero-copy,
    in the contract's dtype), or None for a null row."""
    lists = column.combine_chunks()
    dtype = ARRAYS[name].dtype
    offsets = lists.offsets.to_numpy()
    values = lists.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    nulls = lists.is_null().to_numpy(zero_copy_only=False)

    def row(i: int):
        return None if nulls[i] else values[offsets[i] : offsets[i + 1]]

    return row


class ArchiveServer:
    """What one broker would answer a checkpointing consumer, for the
    batches of `rows`: a welcome, the resume's answer (every batch after
    its step, by step and position), their deliveries (`replay: true`,
    `AHEAD` steps ahead of the last one trained), and the answers to acks,
    nacks, seals, policies and revokes. Sans-I/O: `answer` takes one
    message's type and fields and returns the frames of the replies."""

    def __init__(self, rows: ArchivedRows, *, ahead: int = AHEAD):
        self.rows = rows
        self.ahead = ahead
        self._packed = self._split = False
        self._job: str | None = None
        self._after: int | None = None  # the step the resume named: batches after it are replayed
        self._next = 0  # index in `rows.batches` of the next batch to deliver
        self._trained = -1  # the latest step an ack said was trained
        self._wanted = -1  # the latest step the trainer waits for (`want`)
        self._leases = 0

    def answer(self, kind: str, fields: dict) -> list[list]:
        seq = {"seq": fields["seq"]} if "seq" in fields else {}
        if kind == "hello":
            self._packed, self._split = bool(fields.get("packed_arrays")), bool(fields.get("split_arrays"))
            self._job = fields.get("job")
            welcome = {"broker_id": f"archive:{self.rows.path}", "lease_timeout": 86_400.0,
                       "heartbeat_interval": 3_600.0, "packed_arrays": self._packed, "split_arrays": self._split,
                       "max_unsealed_bytes": 1 << 62, **seq}
            if self._job is not None:
                welcome["job"] = self._job
            return [_encoded("welcome", welcome)]
        if kind == "resume":
            self._after = fields["step"]
            replay = [[step, position, self.rows.trajectory_id(row)] for step, batch in self.rows.batches
                      if step > self._after for position, row in enumerate(batch)]
            self._next = next((k for k, (step, _) in enumerate(self.rows.batches) if step > self._after),
                              len(self.rows.batches))
            self._trained = self._after
            return [_encoded("resumed", {"step": self._after, "replay": replay, "epoch": 0, **seq}), *self.deliveries()]
        if kind == "ack":
            if "step" in fields:
                self._trained = max(self._trained, fields["step"])
            return [_encoded("acked", {"leases": fields["leases"], **seq}), *self.deliveries()]
        if kind == "nack":
            return [_encoded("nacked", {"leases": fields["leases"], **seq})]
        if kind == "seal":
            return [_encoded("sealed", {"step": fields["step"], "reclaimed": 0, **seq})]
        if kind == "policy":
            return [_encoded("policy", {"version": fields["version"], "held": 0, "waiting": 0, **seq})]
        if kind == "revoke":
            return [_encoded("revoked", {"queued": 0, **seq})]
        return []  # heartbeat, credit: nothing is owed (no data beyond the batches replayed)

    def want(self, step: int) -> None:
        """The trainer waits for the batch of `step` (it takes batches
        before committing earlier ones): deliver through it too."""
        self._wanted = max(self._wanted, step)

    def deliveries(self) -> list[list]:
        """The batches through `ahead` steps past the last one trained (or
        the one the trainer waits for), not yet delivered."""
        out = []
        batches = self.rows.batches
        through = max(self._trained + self.ahead, self._wanted)
        while self._after is not None and self._next < len(batches) and batches[self._next][0] <= through:
            for row in batches[self._next][1]:
                self._leases += 1
                out.append(encode_deliver(self.rows.trajectory(row), f"archive-{self._leases}", may_pack=self._packed,
                                          may_split=self._split, replay=True, delivery_count=1))
            self._next += 1
        return out



def _encoded(kind: str, fields: dict) -> list:
    from rollstream.common.codec import encode

    return encode(BROKER_TO_CONSUMER, kind, fields)


class ArchiveConsumer(Consumer):
    """A `Consumer` whose one broker is an `ArchiveServer` in this process
    (`Consumer.from_archive`). Iteration ends once every batch of the
    selection was handed out. `rows`: what it replays."""

    def __init__(self, rows: ArchivedRows, *, resume: dict | None = None, world_size: int | None = None,
                 job: str = DEFAULT_JOB, ahead: int = AHEAD, **options):
        self._server = ArchiveServer(rows, ahead=ahead)
        self.rows = rows
        if resume is None:  # a fresh replay resumes from before its first batch: every batch comes back
            first = rows.batches[0][0] if rows.batches else 1
            resume = {"format": STATE_FORMAT, "job": job, "run": f"replay-of-{rows.run}", "lineage": None, "epoch": 0,
                      "branches": [], "step": max(first - 1, 0), "world_size": world_size or 1, "batches": []}
        largest = max((len(batch) for _, batch in rows.batches), default=1)
        super().__init__(f"archive:{rows.path}", batch_size=options.pop("batch_size", None) or largest,
                         checkpointed=True, resume=resume, world_size=world_size, job=job, **options)

    def _take(self, deadline: float | None, partial_at: float | None) -> Form:
        with self._lock:
            position = self._core.position
            assert position is not None  # checkpointed by construction
            if not position.waiting_for_resume(1):
                upcoming = position.next_replay()
                if upcoming is None:
                    raise ConsumerClosed(f"every batch of the {len(self.rows.batches)} replayed from {self.rows.path} "
                                         "was handed out")
                self._server.want(upcoming[0])
                self._wake()
        return super()._take(deadline, partial_at)

    def _run(self) -> None:
        """The I/O thread: what the core sends goes to the server, whose
        replies come back to the core, until the shell stops."""
        server = self._server
        try:
            while True:
                self._wake_in.poll(100)
                while self._wake_in.poll(0):
                    self._wake_in.recv()
                with self._changed:
                    if self._stopping:
                        break
                    now = Clock.monotonic()
                    replies = server.deliveries()
                    outgoing = self._core.due(now)
                    while outgoing or replies:
                        for _, kind, fields in outgoing:
                            replies += server.answer(kind, dict(fields))
                        for frames in replies:
                            self._core.received(0, decode(frames, BROKER_TO_CONSUMER, check_content=False), now)
                        replies = []
                        outgoing = self._core.due(now)
                    self._changed.notify_all()
        except BaseException as exc:  # surfaced to the trainer by next_batch
            with self._changed:
                self._error = exc
                self._changed.notify_all()
        finally:
            self._wake_in.close(linger=0)


def from_archive(path: str | os.PathLike, *, job: str = DEFAULT_JOB, run: str | None = None,
                 steps: Sequence[int] | None = None, order: str = "as_trained", seed: int | None = None,
                 batch_size: int | None = None, unit: str = "trajectory", ahead: int = AHEAD,
                 **options) -> ArchiveConsumer:
    """`Consumer.from_archive`: see its docstring."""
    if steps is not None and len(steps) != 2:
        raise InvalidInput(f"steps is an inclusive range (first, last) of steps >= 0, got {steps!r}")
    rows = ArchivedRows(path, job=job, run=run, steps=None if steps is None else (steps[0], steps[1]), order=order,
                        seed=seed, batch_size=batch_size, unit=unit)
    return ArchiveConsumer(rows, job=job, ahead=ahead, batch_size=batch_size, unit=unit, **options)
