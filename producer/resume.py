"""What a restarted producer gets back from its broker: the trajectories it
had open there (`Resumable`) and, on request, one's content so far
(`Prefix`), so that rollout work done before a crash is continued rather
than thrown away (docs/protocol.md §3, "Open trajectories handed back")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rollstream.common.codec import Message
from rollstream.common.mask import SamplingMask
from rollstream.common.messages import OPEN_STATES
from rollstream.common.trajectory import Turn

# How a handed-back trajectory stands at its broker (`Resumable.state`).
OPEN, TERMINAL, SCORING = OPEN_STATES


@dataclass(frozen=True)
class Resumable:
    """A trajectory this producer opened and has not finished at its broker:
    `next_turn` is the index its next turn goes under. `open`: turns may
    follow; `terminal`: a truncated or aborted turn or a replay gap ended
    its turns, only its `end` may follow; `scoring`: it ended without a
    reward, which may follow."""

    trajectory_id: str
    next_turn: int
    state: str
    group_id: str | None = None
    group_size: int | None = None
    sample_index: int | None = None

    @classmethod
    def from_wire(cls, entry: dict[str, Any]) -> "Resumable":
        return cls(entry["trajectory_id"], entry["next_turn"], entry["state"], entry.get("group_id"),
                   entry.get("group_size"), entry.get("sample_index"))


@dataclass(frozen=True)
class Prefix:
    """An open trajectory's content as its broker merged it: the prompt and
    the response so far (sampled and forced tokens, their log-probs, loss
    mask and supports, and their full-vocabulary log-probs and the
    supports' log-probs when it carries them), where each turn's forced
    tokens lie and which weights sampled which tokens, in response
    positions. The arrays are the producer's own (copied from the reply)."""

    trajectory_id: str
    next_turn: int
    state: str
    status: str | None
    prompt_tokens: np.ndarray
    tokens: np.ndarray
    log_probs: np.ndarray
    loss_mask: np.ndarray
    mask: SamplingMask | None
    forced_spans: tuple[tuple[int, int], ...]
    weight_version_spans: tuple[tuple[str, int, int], ...]
    full_log_probs: np.ndarray | None = None
    mask_log_probs: np.ndarray | None = None  # aligned with `mask.ids` (0.0 for a forced token's singleton)

    @classmethod
    def from_message(cls, message: Message) -> "Prefix":
        arrays = {name: np.array(array) for name, array in message.arrays.items()}
        mask = (SamplingMask(arrays["mask_ids"], arrays["mask_offsets"]) if "mask_ids" in arrays else None)
        return cls(message["trajectory_id"], message["next_turn"], message["state"], message.get("status"),
                   arrays["prompt_tokens"], arrays["tokens"], arrays["log_probs"], arrays["loss_mask"], mask,
                   tuple((start, end) for start, end in message.get("forced_spans", ())),
                   tuple((version, start, end) for version, start, end in message.get("weight_version_spans", ())),
                   arrays.get("full_log_probs"), arrays.get("mask_log_probs"))

    @property
    def context(self) -> np.ndarray:
        """The prompt and every token so far: what an engine continues from."""
        return np.concatenate([self.prompt_tokens, self.tokens])

    def turns(self) -> list[Turn]:
        """The response as turns, each its sampled tokens then the forced
        tokens after them (split where forced tokens lie: a turn without
        forced tokens merges with the next, which changes no digest), each
        with its first weight version. What the ledger records as sent."""
        bounds = list(self.forced_spans)
        if not bounds or bounds[-1][1] < len(self.tokens):
            bounds.append((len(self.tokens), len(self.tokens)))
        turns, start = [], 0
        for forced_start, forced_end in bounds:
            mask = support_log_probs = None
            if self.mask is not None:
                offsets = self.mask.offsets[start:forced_start + 1]
                mask = SamplingMask(self.mask.ids[offsets[0]:offsets[-1]], offsets - offsets[0])
                if self.mask_log_probs is not None:  # one per id of the sampled tokens' supports
                    support_log_probs = self.mask_log_probs[offsets[0]:offsets[-1]]
            versions = [v for v, a, b in self.weight_version_spans if a < forced_start and b > start]
            full = None if self.full_log_probs is None else self.full_log_probs[start:forced_start]
            turns.append(Turn.build(self.tokens[start:forced_start], self.log_probs[start:forced_start],
                                    loss_mask=self.loss_mask[start:forced_start], mask=mask, full_log_probs=full,
                                    mask_log_probs=support_log_probs,
                                    forced_tokens=self.tokens[forced_start:forced_end],
                                    weight_version=versions[0] if versions else None))
            start = forced_end
        return turns

    def sampled_tokens(self) -> np.ndarray:
        """The tokens the engine sampled (not forced), in order."""
        keep = np.ones(len(self.tokens), dtype=bool)
        for start, end in self.forced_spans:
            keep[start:end] = False
        return self.tokens[keep]
