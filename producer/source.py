"""What the daemon's episode sources share: trajectory jobs (prompts times
group members, with run-unique ids), pacing, and a driver that runs
episodes a few at a time until the jobs run out or the daemon is stopping."""
from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Iterator

import numpy as np

from rollstream.common.clock import Clock
from rollstream.common.errors import InvalidInput

from .client import AsyncProducer, AsyncTrajectoryHandle

log = logging.getLogger("rollstream.producer")

ENDED, ABORTED = "ended", "aborted"
STOPPING = "producer stopping"


class SourceSettingsError(InvalidInput):
    """Settings a source found it cannot run with, once it knew enough
    (a model's context length, say): reported like a bad option."""


@dataclass(frozen=True)
class Job:
    """One trajectory to produce."""

    trajectory_id: str
    prompt_tokens: np.ndarray
    sample_index: int
    group_id: str | None = None
    group_size: int | None = None
    metadata: dict[str, Any] | None = None


def run_id(producer_id: str) -> str:
    """Ids unique to this run, so a restarted daemon never reuses one."""
    return f"{producer_id}-{secrets.token_hex(4)}"


def jobs(prompts: Iterable[tuple[np.ndarray, dict | None]], run: str, group_size: int, limit: int) -> Iterator[Job]:
    """`group_size` trajectories per prompt (a group when more than one),
    at most `limit` in all (0: no limit)."""
    count = itertools.count() if not limit else range(limit)
    members = ((p, prompt, j) for p, prompt in enumerate(prompts) for j in range(group_size))
    for index, (p, (prompt, metadata), j) in zip(count, members):
        grouped = group_size > 1
        yield Job(f"{run}-{p}-{j}", prompt, index, f"{run}-{p}" if grouped else None,
                  group_size if grouped else None, metadata)


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


def retrieve(future: asyncio.Future) -> None:
    """Episodes do not await their frames' futures (the client logs and
    counts refusals); this marks their exceptions as seen."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


Episode = Callable[[AsyncTrajectoryHandle, Job, asyncio.Event], Awaitable[str]]


async def drive(producer: AsyncProducer, todo: Iterator[Job], episode: Episode, *, concurrency: int, rate: float,
                stopping: asyncio.Event) -> None:
    """Run `episode` for every job, `concurrency` at a time, starting at most
    `rate` per second, until the jobs run out or `stopping` is set. An
    episode returns `ENDED` or `ABORTED`."""
    pacer = Pacer(rate)
    metrics = producer.metrics

    async def worker() -> None:
        for job in todo:  # one shared iterator: each job goes to one worker
            if stopping.is_set():
                return
            await pacer.wait()
            await producer.admitted()  # under a staleness bound: sample only what the broker will take
            traj = producer.trajectory(job.trajectory_id, job.prompt_tokens, group_id=job.group_id,
                                       group_size=job.group_size, sample_index=job.sample_index,
                                       metadata=job.metadata)
            outcome = await episode(traj, job, stopping)
            metrics.inc(metrics.trajectories, outcome=outcome)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
