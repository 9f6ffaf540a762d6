"""Partitioning a batch's samples across data-parallel ranks.

Each strategy returns, per rank, the batch positions it gets (ascending);
`Batch.select` then carries every per-sample field, mask included (with
the support log-probs beside its ids, when the batch carries them).
- `round_robin`: sample `i` to rank `i % ranks`.
- `balanced`: Karmarkar–Karp largest differencing over total (prompt +
  response) lengths with equal counts per rank (counts differ by at most one
  when the batch does not divide evenly).
- `group`: whole groups to one rank, groups balanced the same way by their
  total length with equal group counts per rank.
- `tokens`: largest differencing over the same lengths without the equal
  counts, so a rank with long samples gets fewer of them; every rank gets a
  sample when the batch has at least as many as ranks (fewer leave some
  ranks an empty shard).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import numpy as np

from rollstream.common.errors import InvalidInput

from .batch import group_index

STRATEGIES = ("round_robin", "balanced", "group", "tokens")


def round_robin(n: int, ranks: int) -> list[list[int]]:
    return [list(range(rank, n, ranks)) for rank in range(ranks)]


def karmarkar_karp(weights: Sequence[float], ranks: int, *, equal_counts: bool = True) -> list[list[int]]:
    """Multiway largest differencing.

    With `equal_counts`, items sorted by weight are cut into runs of `ranks`
    (padded with zero-weight placeholders), each run a partial solution with
    one item per rank; without, each item is a partial solution alone (on
    one rank, the others empty). The two partial solutions with the largest
    spread (max - min sum) are merged, heaviest part of one with lightest of
    the other, until one remains. Merging never widens the spread beyond the
    larger of the two, so the final spread is at most the heaviest item.
    Parts sort by weight, then by item count, so an empty part is always
    among the lightest and takes the other's heaviest: merging solutions of
    `a` and `b` non-empty parts leaves `min(ranks, a + b)`, hence no rank
    empty when there are at least as many items as ranks.
    """
    if ranks < 1:
        raise InvalidInput(f"ranks must be positive, got {ranks}")

    def spread(parts: list[tuple[int, list[int]]]) -> tuple[int, int, list[tuple[int, list[int]]]]:
        parts.sort(key=lambda p: (-p[0], -len(p[1])))
        return -(parts[0][0] - parts[-1][0]), next(tie), parts

    tie = itertools.count()
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    if equal_counts:
        pad = -len(order) % ranks
        items = [(0, None)] * pad + [(int(weights[i]), i) for i in order]
        runs = [[(w, [i] if i is not None else []) for w, i in items[start : start + ranks]]
                for start in range(0, len(items), ranks)]
    else:
        runs = [[(int(weights[i]), [i])] + [(0, [])] * (ranks - 1) for i in order]
    heap = [spread(parts) for parts in runs]  # (-spread, tie-break, per rank (sum, items))
    heapq.heapify(heap)
    if not heap:
        return [[] for _ in range(ranks)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        heapq.heappush(heap, spread([(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, reversed(b))]))
    return [sorted(members) for _, members in heap[0][2]]


def group_preserving(weights: Sequence[int], groups: Sequence[int], ranks: int) -> list[list[int]]:
    """Whole groups per rank, balanced by group weight (equal group counts)."""
    group_of = np.asarray(groups, dtype=np.int64)
    n_groups = int(group_of.max()) + 1 if len(group_of) else 0
    group_weights = np.bincount(group_of, weights=np.asarray(weights, dtype=np.float64), minlength=n_groups)
    members: list[list[int]] = [[] for _ in range(n_groups)]
    for position, group in enumerate(group_of.tolist()):
        members[group].append(position)
    return [sorted(p for g in chosen for p in members[g]) for chosen in karmarkar_karp(group_weights.tolist(), ranks)]


def partition(lengths: Sequence[int], ranks: int, strategy: str = "balanced", groups=None) -> list[list[int]]:
    """Per rank, the positions of its samples given each sample's total length."""
    if strategy == "round_robin":
        return round_robin(len(lengths), ranks)
    if strategy == "balanced":
        return karmarkar_karp(lengths, ranks)
    if strategy == "group":
        return group_preserving(lengths, range(len(lengths)) if groups is None else groups, ranks)
    if strategy == "tokens":
        return karmarkar_karp(lengths, ranks, equal_counts=False)
    raise InvalidInput(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def partition_batch(batch, ranks: int, strategy: str = "balanced") -> list[list[int]]:
    """`partition` of a `Batch` by its samples' prompt + response lengths."""
    return partition(batch.lengths["sequence"].tolist(), ranks, strategy, group_index(batch.group_ids))


def rank_tokens(lengths: Sequence[int], parts: Sequence[Sequence[int]]) -> list[int]:
    """Per rank, the total length of its samples."""
    return [int(sum(lengths[i] for i in part)) for part in parts]


def token_imbalance(tokens: Sequence[int]) -> float:
    """Most tokens on a rank over the mean across ranks: 1.0 is even (and so is nothing at all)."""
    total = sum(tokens)
    return max(tokens) * len(tokens) / total if total else 1.0
