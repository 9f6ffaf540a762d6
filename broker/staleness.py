"""How stale a trajectory may be when it is trained: `Freshness`, sans-I/O.

Each job's trainer publishes its policy version (the `policy` message) with
how many trajectories a step takes and this broker's share of the job's
capacity; the broker keeps the latest durably (`SetPolicy`) and restores it
after a restart. One bound S (`max_staleness`, a broker setting a trainer
may lower) is kept at three points, all counted in trajectories:

- admission: a turn that would open a new trajectory enters only while the
  job's admitted-but-untrained trajectories (open, queued or leased: durable
  counts, never cumulative ones) are below `(S + 1) * per_step * share`. At
  version v, what is admitted now is trained within `untrained / per_step`
  steps, so this keeps it within S of the trainer;
- dispatch: queued units are handed out oldest version first (or freshest
  first) within the bound (`Dispatcher`);
- consumption: a unit whose version is more than S behind the trainer's is
  dead-lettered `stale` instead of delivered (and the consumer checks again
  when it hands a batch out); its admission room returns with it.

Without a bound, or before its trainer publishes a version, nothing here
refuses or drops anything.

A resumed trainer publishes its ancestry with its version: each branch,
the epoch a resume started and the checkpoint step it started from. What weights of an
abandoned lineage sampled (steps newer than where a later epoch resumed
from) is judged `abandoned` whether or not a bound is on: dropped (dead
letter `abandoned`) or kept, as `abandoned_lineage` says, and counted
either way. A resumed trainer's replayed batches are exempt, as they are
from the bound.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from rollstream.common.errors import InvalidInput
from rollstream.common.versions import ORDERED_RULE, Ancestry, Sampled, ordered_version

DISPATCH_ORDERS = ("oldest_first", "freshest_first")
ABANDONED_ACTIONS = ("drop", "keep")  # what `abandoned_lineage` does with data an abandoned lineage sampled


@dataclass(frozen=True, slots=True)
class Policy:
    """A job's policy as its trainer last published it."""

    version: int
    max_staleness: int | None = None  # the trainer's own bound (lowers the broker's)
    per_step: int | None = None  # trajectories one trainer step takes
    share: float | None = None  # this broker's share of the job's admission capacity, in (0, 1]
    ancestry: Ancestry = Ancestry()  # the trainer's branches (none until a resume)


@dataclass(frozen=True, slots=True)
class SetPolicy:
    """A job's published policy, to keep across restarts."""

    job: str
    policy: Policy


class Freshness:
    """The staleness bound of every job on this broker."""

    def __init__(self, max_staleness: int | None = None, order: str = "oldest_first", abandoned: str = "drop"):
        if max_staleness is not None and max_staleness < 0:
            raise InvalidInput(f"max_staleness must be at least 0 (or unset: no bound), got {max_staleness}")
        if order not in DISPATCH_ORDERS:
            raise InvalidInput(f"dispatch_order must be one of {DISPATCH_ORDERS}, got {order!r}")
        if abandoned not in ABANDONED_ACTIONS:
            raise InvalidInput(f"abandoned_lineage must be one of {ABANDONED_ACTIONS}, got {abandoned!r}")
        self.max_staleness = max_staleness
        self.order = order
        self.drops_abandoned = abandoned == "drop"
        self.policies: dict[str, Policy] = {}
        self.epochs: dict[str, int] = {}  # each job's lineage epoch now (the merge engine reads it)
        self.waiting: Counter[str] = Counter()  # per job: new trajectories told to wait since its last publication

    def restore(self, policies: Mapping[str, Policy]) -> None:
        self.policies = dict(policies)
        self.epochs.clear()
        self.epochs.update((job, policy.ancestry.epoch) for job, policy in policies.items() if policy.ancestry.branches)

    def publish(self, job: str, policy: Policy) -> SetPolicy:
        """The trainer of `job` published `policy` (its version may go back: a resumed trainer)."""
        if policy.share is not None and not 0 < policy.share <= 1:
            raise InvalidInput(f"a policy's share is in (0, 1], got {policy.share}")
        self.policies[job] = policy
        if policy.ancestry.branches:
            self.epochs[job] = policy.ancestry.epoch
        else:
            self.epochs.pop(job, None)
        return SetPolicy(job, policy)

    def ancestry(self, job: str) -> Ancestry:
        policy = self.policies.get(job)
        return Ancestry() if policy is None else policy.ancestry

    def abandoned(self, job: str, sampled: Sampled) -> bool:
        """Whether weights of a lineage `job`'s trainer abandoned sampled it."""
        return job in self.epochs and self.policies[job].ancestry.abandoned(sampled)

    def bound(self, job: str) -> int | None:
        """S for `job`: the broker's, lowered by its trainer's; None: no bound."""
        policy = self.policies.get(job)
        asked = None if policy is None else policy.max_staleness
        if asked is None or self.max_staleness is None:
            return asked if self.max_staleness is None else self.max_staleness
        return min(asked, self.max_staleness)

    def version(self, job: str) -> int | None:
        policy = self.policies.get(job)
        return None if policy is None else policy.version

    def versions_needed(self, job: str) -> bool:
        """Whether `job`'s turns must carry ordered versions (a bound is on for it)."""
        return self.bound(job) is not None

    def version_refusal(self, job: str, texts: list) -> str | None:
        """Why a turn whose versions are `texts` (its `weight_version` and
        its spans') cannot enter `job` now, or None."""
        if not self.versions_needed(job):
            return None
        for text in texts:
            if ordered_version(text) is None:
                return (f"rule '{ORDERED_RULE}' (max_staleness {self.bound(job)} is on) violated: "
                        f"expected a weight_version such as '12', 'step-12' or 'e1:12', got {text!r}")
        return None

    def stale_below(self, job: str) -> int | None:
        """Versions below this are stale for `job` now; None: nothing is."""
        bound, version = self.bound(job), self.version(job)
        if bound is None or version is None:
            return None
        return version - bound

    def capacity(self, job: str) -> int | None:
        """Trajectories `job` may hold admitted and untrained here; None: no limit."""
        bound, policy = self.bound(job), self.policies.get(job)
        if bound is None or policy is None or policy.per_step is None:
            return None
        return max(1, math.floor((bound + 1) * policy.per_step * (1.0 if policy.share is None else policy.share)))

    def admits_new(self, job: str, untrained: int) -> bool:
        """Whether a new trajectory of `job` may open, `untrained` being held."""
        capacity = self.capacity(job)
        return capacity is None or untrained < capacity

    def admission_refusal(self, job: str, untrained: int) -> str:
        """Why a new trajectory waits: the rule and its figures."""
        policy = self.policies[job]
        return (f"staleness capacity of job {job!r} reached: {untrained} trajectories admitted and not yet trained, "
                f"capacity (max_staleness {self.bound(job)} + 1) x {policy.per_step} per step x share "
                f"{1.0 if policy.share is None else policy.share} = {self.capacity(job)}; new trajectories wait "
                f"for the trainer; resend later")
