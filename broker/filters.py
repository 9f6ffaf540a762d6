"""Group filters the broker runs when a group completes, before any batch
forms: a group whose members carry no learning signal (all rewards equal,
under GRPO) is dead-lettered `filtered:<name>` instead of taking a batch
slot, and its admission room returns so producers refill it.

A filter is written `name` or `name:threshold` (the broker's
`group_filters` setting, comma-separated):

- `all_equal_rewards[:tolerance]`: every member's reward within
  `tolerance` (default 1e-6) of the first's (DAPO's dynamic sampling);
- `reward_std_below:threshold`: the population standard deviation of the
  members' rewards is below `threshold`;
- `min_members:n`: fewer than `n` members ended (the rest aborted or
  expired).

Rewards are numbers, or a map's `reward_key` entry; a group with a member
whose reward is neither is kept (nothing to judge it by).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rollstream.common.errors import InvalidInput

DEFAULT_TOLERANCE = 1e-6
_NEEDS_THRESHOLD = ("reward_std_below", "min_members")
FILTER_NAMES = ("all_equal_rewards", *_NEEDS_THRESHOLD)


@dataclass(frozen=True)
class GroupFilter:
    name: str
    threshold: float

    def drops(self, rewards: Sequence[float | None]) -> bool:
        """Whether a group whose ended members' rewards are `rewards` is dropped."""
        if self.name == "min_members":
            return len(rewards) < self.threshold
        if not rewards or any(r is None for r in rewards):
            return False
        values = [float(r) for r in rewards if r is not None]
        if self.name == "all_equal_rewards":
            return all(abs(r - values[0]) <= self.threshold for r in values)
        mean = sum(values) / len(values)
        return math.sqrt(sum((r - mean) ** 2 for r in values) / len(values)) < self.threshold

    def __str__(self) -> str:
        return f"{self.name}:{self.threshold:g}"


def parse_filters(text: str) -> tuple[GroupFilter, ...]:
    """`group_filters` as written (comma-separated `name[:threshold]`)."""
    filters = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, value = item.partition(":")
        if name not in FILTER_NAMES:
            raise InvalidInput(f"a group filter is one of {FILTER_NAMES} (name or name:threshold), got {item!r}")
        if not value and name in _NEEDS_THRESHOLD:
            raise InvalidInput(f"group filter {name} needs a threshold ({name}:VALUE), got {item!r}")
        try:
            threshold = float(value) if value else DEFAULT_TOLERANCE
        except ValueError:
            raise InvalidInput(f"a group filter's threshold is a number, got {item!r}") from None
        if not math.isfinite(threshold) or threshold < 0:
            raise InvalidInput(f"a group filter's threshold is a finite number >= 0, got {item!r}")
        filters.append(GroupFilter(name, threshold))
    return tuple(filters)


def scalar_reward(reward, reward_key: str | None) -> float | None:
    """A reward as the filters compare it: a number, or a map's `reward_key` entry; None otherwise."""
    if isinstance(reward, Mapping):
        reward = reward.get(reward_key) if reward_key is not None else None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return None
    return float(reward)


def first_dropping(filters: Sequence[GroupFilter], rewards: Sequence[float | None]) -> GroupFilter | None:
    """The first of `filters` that drops a group with these members' rewards, or None."""
    return next((f for f in filters if f.drops(rewards)), None)
