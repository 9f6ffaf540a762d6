"""Starvation made loud: `Starvation`, sans-I/O.

Filters and a staleness bound throw trajectories away on purpose. When
they throw nearly everything away (rewards saturated, so no group carries a
signal; producers far behind the trainer), or a job's trainer waits with
nothing to take, the run must say so, with the cause and the figures,
instead of hanging quietly. Per job, over a sliding window of `window`
seconds, counted in trajectories:

- `filtered` / `stale`: at least `min_trajectories` finished in the window
  (became deliverable or were thrown away) and the share the filters (or
  the bound) threw away is `share` or more;
- `idle`: a consumer of the job holds credit, nothing of the job is queued,
  and no unit became deliverable for `idle_after` seconds.

The core reports outcomes as they commit (no clock needed there);
`check`, at housekeeping, stamps them with the time and returns what
started and what ended since the last call; the core logs each and keeps a
gauge per job and cause.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

CAUSES = ("filtered", "stale", "idle")


@dataclass
class _JobWindow:
    outcomes: deque = field(default_factory=deque)  # (mono, cause or "kept", trajectories)
    pending: Counter = field(default_factory=Counter)  # reported since the last check, by cause or "kept"
    last_ready: float | None = None
    alarms: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Alarm:
    job: str
    cause: str
    started: bool  # False: it ended
    figures: dict


class Starvation:
    def __init__(self, window: float = 60.0, share: float = 0.9, min_trajectories: int = 8, idle_after: float = 120.0):
        self.window, self.share, self.min_trajectories, self.idle_after = window, share, min_trajectories, idle_after
        self._jobs: dict[str, _JobWindow] = {}

    def _job(self, job: str) -> _JobWindow:
        return self._jobs.setdefault(job, _JobWindow())

    def kept(self, job: str, trajectories: int) -> None:
        """`trajectories` of `job` became deliverable."""
        self._job(job).pending["kept"] += trajectories

    def dropped(self, job: str, cause: str, trajectories: int) -> None:
        """`trajectories` of `job` were thrown away for `cause` (`filtered` or `stale`)."""
        self._job(job).pending[cause] += trajectories

    def check(self, mono: float, waiting: dict[str, bool], queued: dict[str, int]) -> list[Alarm]:
        """Alarms that started or ended; `waiting`: jobs with a consumer
        holding credit, `queued`: what is queued by job."""
        changes = []
        for job in set(self._jobs) | {job for job, wants in waiting.items() if wants}:
            state = self._job(job)
            if state.pending["kept"]:
                state.last_ready = mono
            state.outcomes.extend((mono, cause, n) for cause, n in state.pending.items() if n)
            state.pending.clear()
            while state.outcomes and state.outcomes[0][0] < mono - self.window:
                state.outcomes.popleft()
            if state.last_ready is None:
                state.last_ready = mono  # the idle clock starts when the job is first seen
            totals = {"kept": 0, "filtered": 0, "stale": 0}
            for _, cause, n in state.outcomes:
                totals[cause] += n
            finished = sum(totals.values())
            now_on = set()
            for cause in ("filtered", "stale"):
                if finished >= self.min_trajectories and totals[cause] >= self.share * finished:
                    now_on.add(cause)
            idle_for = mono - state.last_ready
            if waiting.get(job) and not queued.get(job) and idle_for >= self.idle_after:
                now_on.add("idle")
            figures = {"window_s": self.window, "finished": finished, **totals, "idle_s": round(idle_for, 1)}
            for cause in sorted(now_on - state.alarms):
                changes.append(Alarm(job, cause, True, figures))
            for cause in sorted(state.alarms - now_on):
                changes.append(Alarm(job, cause, False, figures))
            state.alarms = now_on
        return changes

    def active(self) -> dict[str, list[str]]:
        """Each starving job's causes."""
        return {job: sorted(state.alarms) for job, state in sorted(self._jobs.items()) if state.alarms}
