"""Where a checkpointing trainer stands in its data, sans-I/O.

What survives a trainer's restart is its checkpoint, so the data position
lives there: `TrainingPosition.state_dict()` is saved with the model, and
a trainer resumed from it (`Consumer(..., resume=state)`) gets back exactly
what it trained after that checkpoint, in the same batches, before any new
data. Brokers keep what a commit recorded as trained until the trainer
seals a later checkpoint (`sealed`), keeping the last `keep_checkpoints`
to fall back on.

A run is one training job from its first step; each start of it (the
first, and every resume) is a new lineage. The broker tells lineages apart
so that a resume hands back what an abandoned lineage trained, and not
what this one already has. A resume also starts a new lineage epoch,
numbered above any its brokers have seen for the job: policy versions are
(epoch, step), and what weights of an abandoned lineage sampled is told
apart (`rollstream.common.versions.Ancestry`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

from rollstream.common.errors import InvalidInput, InvalidState
from rollstream.common.jobs import DEFAULT_JOB
from rollstream.common.versions import Ancestry

STATE_FORMAT = "rollstream.consumer.position/1"
# Batches a state lists at most: a trainer that never seals must not grow it (and the consumer) without end.
MAX_MANIFEST_BATCHES = 10_000


@dataclass(frozen=True)
class TrainedBatch:
    """One committed batch, as a checkpoint's manifest keeps it: its step,
    trajectories in order, and the prompts they came from (for a rollout
    manager resuming its prompt cursor)."""

    step: int
    trajectory_ids: tuple[str, ...]
    sample_indices: tuple[int | None, ...]
    group_ids: tuple[str | None, ...]
    nbytes: int = 0  # of its arrays as delivered (not saved: for the unsealed budget)

    def to_state(self) -> dict[str, Any]:
        return {"step": self.step, "trajectory_ids": list(self.trajectory_ids),
                "sample_indices": list(self.sample_indices), "group_ids": list(self.group_ids)}


def _new_id() -> str:
    return os.urandom(8).hex()


def _field(state: Mapping, name: str, kind: type, describe: str):
    value = state.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidInput(f"resume state: {name} must be {describe}, got {value!r}")
    return value


def _batches(state: Mapping) -> list[TrainedBatch]:
    out = []
    for entry in _field(state, "batches", list, "a list of batches"):
        if not isinstance(entry, Mapping):
            raise InvalidInput(f"resume state: each batch must be a map, got {entry!r}")
        step = _field(entry, "step", int, "an integer")
        tids = _field(entry, "trajectory_ids", list, "a list of trajectory ids")
        samples = entry.get("sample_indices", [None] * len(tids))
        groups = entry.get("group_ids", [None] * len(tids))
        if not all(isinstance(t, str) for t in tids) or len(samples) != len(tids) or len(groups) != len(tids):
            raise InvalidInput(f"resume state: batch of step {step} must list one trajectory id (a string), sample "
                               f"index and group id per trajectory, got {entry!r}")
        out.append(TrainedBatch(step, tuple(tids), tuple(samples), tuple(groups)))
    return out


class TrainingPosition:
    """A checkpointing consumer's run, lineage, last step, the batches
    committed since the last seal, and, after a resume, what each broker
    hands back. Driven by `Sessions` (what brokers say) and `ConsumerCore`
    (what the trainer does).

    Two threads reach it, only through `ConsumerCore` and under its shell's
    lock (who calls what):
    - the I/O thread (through `Sessions`) calls `hello_fields`,
      `on_welcome`, `resumed`, `answered`, `budget`, `sealed` and `refused`.
      Affects: the brokers that answered the resume, `ancestry`, the
      batches to train again (`_replay`), budgets, seals awaiting answers
      (`_seals`) and `failure`.
    - the trainer's thread calls `waiting_for_resume`, `next_replay`,
      `handed`, `replayed_steps`, `commit_step`, `committed`,
      `nearing_budget`, `seal`, `confirmed` and `state_dict`, and sets
      `world_size` (`ConsumerCore.shard_over`). Affects: `batches`, `step`,
      `_replay`, the replayed steps with the trainer, `sealed_step`,
      `_seals` and the unsealed bytes.
    Both change `_replay` (a resume's answer adds, a commit removes) and
    `_seals` (a seal adds, its answer removes).
    """

    def __init__(self, *, keep_checkpoints: int = 2, world_size: int = 1, resume: Mapping[str, Any] | None = None,
                 job: str = DEFAULT_JOB):
        if keep_checkpoints < 1:
            raise InvalidInput(f"keep_checkpoints must be at least 1, got {keep_checkpoints}")
        self.keep = keep_checkpoints
        self.world_size = world_size
        self.job = job
        self.lineage = _new_id()
        self.batches: list[TrainedBatch] = []  # committed since the last seal
        self.resumed_from: int | None = None
        self.parent: str | None = None
        self.sealed_step = 0  # the latest checkpoint this lineage knows durable
        self.saved_world_size = world_size  # the world size of the state resumed from
        self.ancestry = Ancestry()  # the run's branches: each resume's epoch and the step it resumed from, this one's last
        self._answered: set[int] = set()  # brokers that answered the resume
        self._replay: dict[int, dict[int, str]] = {}  # step -> position -> trajectory id, still to train again
        self._handed: set[int] = set()  # steps of `_replay` with the trainer now
        self._seals: dict[int, int] = {}  # broker -> the step of its seal not yet answered
        self.failure: tuple[str, str] | None = None  # a refusal that ends the run: (code, message)
        self._budgets: dict[int, int] = {}  # each broker's max_unsealed_bytes, from its welcome
        self._unsealed_bytes = 0  # of `batches` after `sealed_step`, kept as they change
        self._warned: set[str] = set()  # the warnings given (each once)
        if resume is None:
            self.run, self.step = _new_id(), 0
            return
        if resume.get("format") != STATE_FORMAT:
            raise InvalidInput(f"resume state: format must be {STATE_FORMAT!r}, got {resume.get('format')!r}")
        if resume.get("job", DEFAULT_JOB) != job:  # another job's run: its data is not this consumer's to train
            raise InvalidInput(f"resume state: rule 'a run resumes in its own job' violated: the state belongs to job "
                               f"{resume.get('job', DEFAULT_JOB)!r}, this consumer reads job {job!r}")
        self.run = _field(resume, "run", str, "a string")
        self.parent = resume.get("lineage")  # the lineage that saved the state
        self.step = self.resumed_from = self.sealed_step = _field(resume, "step", int, "an integer")
        try:
            saved = Ancestry.of(resume.get("branches", ()))
        except (InvalidInput, TypeError) as error:
            raise InvalidInput(f"resume state: branches: {error}") from None
        epoch = max(saved.epoch, _field(resume, "epoch", int, "an integer")) + 1
        self.ancestry = Ancestry((*saved.branches, (epoch, self.step)))
        self.saved_world_size = _field(resume, "world_size", int, "an integer")
        self.batches = [b for b in _batches(resume) if b.step <= self.step]

    # -- what goes to brokers ---------------------------------------------------
    def hello_fields(self) -> dict[str, str]:
        return {"run": self.run, "lineage": self.lineage}

    def on_welcome(self, broker: int) -> list[tuple[str, dict]]:
        """What a (re)started session with `broker` must be told: the resume
        while its replay is not all back, and a seal it has not answered."""
        out = []
        if self.resumed_from is not None and (broker not in self._answered or self._replay):
            # From the latest seal: what this lineage trained since is in `batches`, what it has still to train
            # again comes back (which broker holds what is not known here, so each is asked again).
            trained = [[b.step, position, tid] for b in self.batches for position, tid in enumerate(b.trajectory_ids)
                       if b.step <= self.sealed_step]
            out.append(("resume", {"step": self.sealed_step, "keep": self.keep, "trained": trained}))
        if broker in self._seals:
            out.append(("seal", {"step": self._seals[broker], "keep": self.keep}))
        return out

    # -- what brokers say ---------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.ancestry.epoch

    def resumed(self, broker: int, replay: Sequence[Sequence], epoch: int = 0) -> bool:
        """`broker` answered the resume, its job's lineage being at `epoch`;
        True when this lineage's epoch had to rise above it (published again)."""
        raised = broker not in self._answered and epoch >= self.epoch  # a later answer may know this lineage's own
        self._answered.add(broker)
        if raised:
            assert self.resumed_from is not None  # only a resume is answered
            self.ancestry = Ancestry((*self.ancestry.branches[:-1], (epoch + 1, self.resumed_from)))
        for step, position, tid in replay:
            if step > self.step:  # this lineage trains replayed batches in order: the rest it has committed
                self._replay.setdefault(step, {})[position] = tid
        return raised

    def answered(self, broker: int) -> bool:
        """Whether `broker` may hear this lineage's policy: it answered the
        resume (its epoch is known), or there is none."""
        return self.resumed_from is None or broker in self._answered

    def budget(self, broker: int, max_unsealed_bytes: int) -> None:
        self._budgets[broker] = max_unsealed_bytes

    def nearing_budget(self) -> str | None:
        """Once, when what was trained since the last seal passes half the
        smallest broker's unsealed budget (all of it could be on one
        broker): the warning to log. Past the budget a broker reclaims the
        oldest trained steps, and resuming from before them is refused."""
        if "budget" in self._warned or not self._budgets:
            return None
        held, budget = self._unsealed_bytes, min(self._budgets.values())
        if 2 * held <= budget:
            return None
        self._warned.add("budget")
        return (f"{held} bytes trained since the last seal (step {self.sealed_step}), and a broker keeps at most "
                f"{budget} bytes unsealed (max_unsealed_bytes): seal checkpoints more often, or raise it")

    def sealed(self, broker: int, step: int) -> None:
        if self._seals.get(broker) == step:
            del self._seals[broker]

    def refused(self, code: str, message: str) -> None:
        self.failure = (code, message)

    # -- the trainer's side -------------------------------------------------------
    def waiting_for_resume(self, n_brokers: int) -> bool:
        return self.resumed_from is not None and len(self._answered) < n_brokers

    def next_replay(self) -> tuple[int, list[str]] | None:
        """The earliest batch still to train again and not with the
        trainer: its step and trajectories in order."""
        waiting = [step for step in self._replay if step not in self._handed]
        if not waiting:
            return None
        step = min(waiting)
        return step, [tid for _, tid in sorted(self._replay[step].items())]

    def handed(self, step: int, *, back: bool = False) -> None:
        """The replayed batch of `step` is with the trainer (`back`: given back untrained)."""
        (self._handed.discard if back else self._handed.add)(step)

    def replayed_steps(self) -> list[int]:
        return sorted(self._replay)

    def commit_step(self, step: int | None, replayed: int | None) -> int:
        """The step a commit records: a replayed batch's own, else the one
        given, else the next; steps only go forward."""
        if replayed is not None:
            if step is not None and step != replayed:
                raise InvalidInput(f"a replayed batch is committed at the step it was trained at: expected {replayed}, "
                                   f"got {step}")
            return replayed
        if self._replay:
            raise InvalidState(f"batches of steps {sorted(self._replay)} are still to be trained again first")
        step = self.step + 1 if step is None else step
        if step <= self.step:
            raise InvalidInput(f"commit steps go forward: expected a step after {self.step}, got {step}")
        return step

    def committed(self, batch: TrainedBatch) -> str | None:
        """Record a committed batch; returns a warning to log when the
        manifest had to drop its oldest batch (nothing was ever sealed)."""
        self.batches.append(batch)
        self._unsealed_bytes += batch.nbytes
        dropped = None
        if len(self.batches) > MAX_MANIFEST_BATCHES:
            oldest = self.batches.pop(0)
            self._unsealed_bytes -= oldest.nbytes
            if "manifest" not in self._warned:
                self._warned.add("manifest")
                dropped = (f"{MAX_MANIFEST_BATCHES} batches committed without a seal: state_dict() no longer lists "
                           f"those before step {self.batches[0].step}; call sealed(step) after each checkpoint")
        self.step = max(self.step, batch.step)
        self._replay.pop(batch.step, None)
        self._handed.discard(batch.step)
        return dropped

    def seal(self, step: int, n_brokers: int, unconfirmed: Collection[str] = ()) -> list[tuple[int, str, dict]]:
        """The trainer's checkpoint at `step` is durable: forget the batches
        it holds (`confirmed`) and tell every broker."""
        if step > self.step:
            raise InvalidInput(f"sealed takes a checkpoint's step, at most the last committed one ({self.step}), "
                               f"got {step}")
        self.sealed_step = max(self.sealed_step, step)
        self.confirmed(unconfirmed)
        for broker in range(n_brokers):
            self._seals[broker] = max(step, self._seals.get(broker, step))
        return [(broker, "seal", {"step": self._seals[broker], "keep": self.keep}) for broker in range(n_brokers)]

    def confirmed(self, unconfirmed: Collection[str]) -> None:
        """Forget the batches a seal covers, except those with a trajectory
        in `unconfirmed` (its ack not yet answered by its broker): a state
        saved later must still list such a batch, so that a resume from it
        records the batch as trained even if that ack never arrives."""
        sealed = self.sealed_step
        self.batches = [b for b in self.batches if b.step > sealed or not set(b.trajectory_ids).isdisjoint(unconfirmed)]
        self._unsealed_bytes = sum(b.nbytes for b in self.batches if b.step > sealed)

    @property
    def unsealed(self) -> int:
        """Seals sent and not yet answered."""
        return len(self._seals)

    @property
    def resume_record(self) -> dict[str, Any]:
        """The fields of the end-to-end checker's record of this resume (`rollstream.common.checker`)."""
        return {"run": self.run, "lineage": self.lineage, "parent": self.parent, "from_step": self.resumed_from}

    def record_resume(self, ledger) -> None:
        """Write the checker's record of this resume to `ledger`."""
        ledger.write("resumed", **self.resume_record)

    def state_dict(self) -> dict[str, Any]:
        """Plain lists, numbers and strings: save it with the checkpoint.
        `batches` holds every commit since the last seal, answered by its
        brokers or not (the weights saved with it trained them), and older
        ones whose acks are still unanswered (`confirmed`)."""
        return {"format": STATE_FORMAT, "job": self.job, "run": self.run, "lineage": self.lineage, "epoch": self.epoch,
                "branches": self.ancestry.to_wire(), "step": self.step,
                "world_size": self.world_size, "batches": [b.to_state() for b in self.batches]}
