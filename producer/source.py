"""What the daemon's episode sources share: their prompts by index, the
trajectories of a run (prompts times group members, with ids that follow
from the prompt, `PromptCursor`), pacing, and a driver that first takes up
what an earlier run of the producer left open at the broker, then runs
episodes a few at a time until the jobs run out or the daemon is stopping."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import numpy as np
import xxhash

from rollstream.common.clock import Clock
from rollstream.common.errors import InvalidInput

from .client import AsyncProducer, AsyncTrajectoryHandle, retrieve
from .cursor import PromptCursor, Sample
from .errors import Halted
from .resume import SCORING, Prefix, Resumable
from .settings import ON_RESTART, ProducerSettings

log = logging.getLogger("rollstream.producer")

ENDED, ABORTED = "ended", "aborted"
STOPPING = "producer stopping"


class SourceSettingsError(InvalidInput):
    """Settings a source found it cannot run with, once it knew enough
    (a model's context length, say): reported like a bad option."""


@dataclass(frozen=True)
class Job:
    """One trajectory to produce: sample `member` of prompt `prompt`
    (`sample_index` counts samples over the run: prompt times group size
    plus member).
    `resumable`: the broker holds it open from an earlier run of this
    producer, to continue from `resumable.next_turn` (with `prefix`, its
    content so far, for a source that continues from content)."""

    trajectory_id: str
    prompt_tokens: np.ndarray
    sample_index: int
    group_id: str | None = None
    group_size: int | None = None
    metadata: dict[str, Any] | None = None
    prompt: int = 0
    member: int = 0
    resumable: Resumable | None = None
    prefix: Prefix | None = None


class Prompts:
    """A source's prompts by index: those of a JSON-lines file (read once,
    so any of them can be issued again after a restart), or drawn from
    `(seed, index)` forever, the same at every start. `identity` says which
    prompts they are, so a cursor is never continued over other ones."""

    def __init__(self, at: Callable[[int], tuple[np.ndarray, dict | None] | None], identity: str):
        self.at, self.identity = at, identity

    @classmethod
    def from_file(cls, path: str) -> "Prompts":
        """`{"input_ids": [...], "metadata": {...}}` per line (blank lines skipped)."""
        raw = Path(path).read_bytes()
        prompts = []
        for number, line in enumerate(raw.decode("utf-8").split("\n"), 1):  # not splitlines: JSON may hold U+2028
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise InvalidInput(f"{path}:{number}: expected a JSON object per line, got {line[:80]!r}: {exc}") from None
                if not isinstance(record, dict) or "input_ids" not in record:
                    raise InvalidInput(f"{path}:{number}: expected an object with input_ids, got {line[:80]!r}")
                prompts.append((np.asarray(record["input_ids"], dtype=np.int32), record.get("metadata")))
        return cls(lambda p: prompts[p] if p < len(prompts) else None,
                   f"file {Path(path).name} xxh3 {xxhash.xxh3_64_hexdigest(raw)}")

    @classmethod
    def drawn(cls, draw: Callable[[np.random.Generator], np.ndarray], seed: int, what: str) -> "Prompts":
        """Prompt `p` is `draw(rng)` of a generator seeded with `(seed, p)`."""
        return cls(lambda p: (draw(np.random.default_rng([seed, p])), None), f"drawn seed {seed}: {what}")


def job_rng(seed: int, job: Job) -> np.random.Generator:
    """The random stream of one trajectory, a function of the seed, its
    prompt and its sample alone: a trajectory produced again, or continued
    after a restart, draws what it drew the first time."""
    return np.random.default_rng([seed, job.prompt, job.sample_index, 1])


class Plan:
    """The jobs of a run, in order: those handed back by the broker first,
    then those issued before a restart that the broker never saw, then
    prompts never issued, `group_size` samples each, until the prompts run
    out or `limit` samples were issued (0: no limit)."""

    def __init__(self, prompts: Prompts, cursor: PromptCursor, *, group_size: int, limit: int):
        self.prompts, self.cursor, self.group_size, self.limit = prompts, cursor, group_size, limit

    def job(self, sample: Sample, resumable: Resumable | None = None, prefix: Prefix | None = None) -> Job | None:
        """The job of `sample`, or None when its prompt does not exist."""
        drawn = self.prompts.at(sample[0])
        if drawn is None:
            return None
        prompt, metadata = drawn
        grouped = self.group_size > 1
        return Job(self.cursor.trajectory_id(sample), prompt, self._index(sample),
                   self.cursor.group_id(sample[0]) if grouped else None, self.group_size if grouped else None, metadata,
                   sample[0], sample[1], resumable, prefix)

    def _index(self, sample: Sample) -> int:
        """Where `sample` falls among the run's samples (its `sample_index`)."""
        return sample[0] * self.group_size + sample[1]

    def jobs(self, first: list[Job]) -> Iterator[Job]:
        yield from first
        taken = {(job.prompt, job.member) for job in first}
        for sample in sorted(self.cursor.outstanding - taken):
            job = self.job(sample)
            if job is not None:
                yield job
        sample = self.cursor.next
        while not self.limit or self._index(sample) < self.limit:
            job = self.job(sample)
            if job is None:
                return
            yield job
            sample = self.cursor.after(sample)


class Pacer:
    """At most `rate` starts per second (0: unpaced)."""

    def __init__(self, rate: float):
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self._next = Clock.monotonic()

    async def wait(self) -> None:
        if self.interval:
            now = Clock.monotonic()
            self._next = max(self._next + self.interval, now)
            await asyncio.sleep(self._next - now)


Episode = Callable[[AsyncTrajectoryHandle, Job, asyncio.Event], Awaitable[str]]

# What a source does with the trajectories it had open when its daemon died (`on_restart`).
CONTINUE, RESTART, ABORT = ON_RESTART
# How a source continues a handed-back trajectory: from its content so far, read from the broker (`PREFIX`), or by
# producing its earlier turns again without sending them (`AGAIN`: a source that draws them from `job_rng`).
PREFIX, AGAIN = "prefix", "again"


async def drive(producer: AsyncProducer, settings: ProducerSettings, prompts: Prompts, episode: Episode, *,
                stopping: asyncio.Event, continues: str | None) -> None:
    """Run `episode` for every job of the run (`Plan`), `concurrency` at a
    time, starting at most `rate` per second, until the jobs run out or
    `stopping` is set. An episode returns `ENDED` or `ABORTED`. Its handle
    halts, so it need not wait for its turns' receipts: a refusal of one of
    its turns or of its end gives the trajectory up (the producer aborts it
    and records it `given_up`), and the episode's next call on the handle
    raises `Halted`, which ends it as `ABORTED`. First, once the spool's
    resends have settled, what the broker holds open from an earlier run of
    this producer is continued, restarted or given up (`on_restart`;
    `continues` says how the source continues one, None: it cannot, so it
    restarts them)."""
    s = settings
    if s.spool_dir is None:
        log.warning("no spool directory: a restarted daemon cannot know which prompts it issued, so it starts them "
                    "over and what it had open expires at the broker (give --spool-dir to continue them)")
    cursor = PromptCursor(s.spool_dir, producer.producer_id, prompts=prompts.identity, group_size=s.group_size,
                          fsync=s.spool_fsync)
    plan = Plan(prompts, cursor, group_size=s.group_size, limit=s.trajectories)
    try:
        first = await _hand_back(producer, plan, s.on_restart, continues, stopping) if cursor.restored else []
        await _run_jobs(producer, plan, plan.jobs(first), episode, concurrency=s.concurrency, rate=s.rate,
                        stopping=stopping)
    finally:
        cursor.close()


async def _hand_back(producer: AsyncProducer, plan: Plan, on_restart: str, continues: str | None,
                     stopping: asyncio.Event) -> list[Job]:
    """The jobs continuing what the broker holds open from an earlier run;
    those restarted go again from turn 0, those given up are aborted (their
    groups go on without them)."""
    settled = asyncio.create_task(producer.flush())
    stop = asyncio.create_task(stopping.wait())
    await asyncio.wait({settled, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if not settled.done():
        settled.cancel()
        return []
    listed = await producer.open_trajectories()
    if listed is None:
        log.warning("the broker does not hand back open trajectories (an older broker): those this producer had open "
                    "expire there, and their prompts are issued again")
        return []
    metrics, first = producer.metrics, []
    for resumable in listed:
        sample = plan.cursor.sample_of(resumable.trajectory_id)
        job = None if sample is None else plan.job(sample, resumable)
        action = _restart_action(resumable, job is not None, on_restart, continues)
        if action is None:
            continue
        if action == CONTINUE:
            assert job is not None  # only one of its prompts is continued
            prefix = await producer.read_prefix(resumable.trajectory_id) if continues == PREFIX else None
            first.append(replace(job, prefix=prefix))
        else:
            handle = producer.resume(resumable, np.zeros(0, np.int32) if job is None else job.prompt_tokens)
            if action == RESTART:
                assert job is not None  # only one of its prompts is produced again
                retrieve(await handle.abort("producer restarted: produced again from turn 0", again=True))
                first.append(replace(job, resumable=None))
            else:
                if job is not None:
                    plan.cursor.finished((job.prompt, job.member))
                retrieve(await handle.abort("producer restarted: given up" if job is not None else
                                            "producer restarted: not one of its prompts"))
        metrics.inc(metrics.resumed, action=action)
        if producer.ledger is not None:
            producer.ledger.write("taken_up", id=resumable.trajectory_id, action=action, producer=producer.producer_id)
    log.info(f"producer restarted: {len(listed)} trajectories open at the broker, {len(first)} of them to produce "
             f"(on_restart = {on_restart})", extra={"open": len(listed), "on_restart": on_restart})
    return first


def _restart_action(resumable: Resumable, ours: bool, on_restart: str, continues: str | None) -> str | None:
    """What a restart does with a trajectory the broker handed back: one
    ended without its reward (`scoring`) can only get its reward (None: not
    one of this run's prompts, it is left to expire); one that is not of
    this run's prompts (an earlier spool's, another source's) nothing
    continues, so it is aborted; else `on_restart`, a restart where the
    source cannot continue."""
    if resumable.state == SCORING:
        return CONTINUE if ours else None
    if not ours:
        return ABORT
    return RESTART if on_restart == CONTINUE and continues is None else on_restart


async def _run_jobs(producer: AsyncProducer, plan: Plan, todo: Iterator[Job], episode: Episode, *, concurrency: int,
                    rate: float, stopping: asyncio.Event) -> None:
    pacer = Pacer(rate)
    metrics, cursor, ledger = producer.metrics, plan.cursor, producer.ledger

    async def worker() -> None:
        for job in todo:  # one shared iterator: each job goes to one worker
            if stopping.is_set():
                return
            sample = (job.prompt, job.member)
            if job.resumable is None:
                await pacer.wait()
                await producer.admitted()  # under a staleness bound: sample only what the broker will take
                traj = producer.trajectory(job.trajectory_id, job.prompt_tokens, group_id=job.group_id,
                                           group_size=job.group_size, sample_index=job.sample_index,
                                           metadata=job.metadata)
            else:
                traj = producer.resume(job.resumable, job.prompt_tokens, metadata=job.metadata,
                                       earlier=() if job.prefix is None else job.prefix.turns())
            cursor.issued(sample)
            if ledger is not None:
                ledger.write("issued", prompt=cursor.group_id(job.prompt), sample=job.member, id=job.trajectory_id,
                             producer=producer.producer_id)
            traj.finishing = lambda sample=sample: cursor.finished(sample)
            traj.halts = True
            try:
                outcome = await episode(traj, job, stopping)
            except Halted:  # the producer gave the trajectory up at a refusal (logged, counted, in the ledger)
                outcome = ABORTED
            metrics.inc(metrics.trajectories, outcome=outcome)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
