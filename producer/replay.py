"""The `replay` source: stream turns recorded on disk.

`replay_path` is a file or a directory (its `*.jsonl` and `*.safetensors`
files, in name order):
- `*.jsonl`: rollstream's JSON-lines recording, one event per line
  (`docs/producer.md` documents the format): `turn` (native arrays, or an
  SGLang `output_ids` + `meta_info` response), `end`, `abort`. Turn indices
  follow line order per trajectory (from 0 again after an abort); a `turn`
  key, when present, must agree.
- `*.safetensors`: a miles session payload (docs/semantics.md §7), one
  trajectory of per-turn samples; forced tokens come from the prefix
  relation between samples (`miles_samples`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from rollstream.common.contract import SUPPORT_LOG_PROB_ARRAYS, TOKEN_LOG_PROB_ARRAYS
from rollstream.common.errors import InvalidInput
from rollstream.common.ingest import turn_from_sglang
from rollstream.common.mask import SamplingMask
from rollstream.common.miles import decode_session_samples
from rollstream.common.trajectory import Turn

from .client import AsyncProducer, AsyncTrajectoryHandle, retrieve
from .errors import Halted
from .miles_samples import turns_from_miles_samples
from .settings import ProducerSettings
from .source import ABORTED, ENDED, STOPPING, Pacer

log = logging.getLogger("rollstream.producer")

EVENT_TYPES = ("turn", "end", "abort")
_IDENTITY = ("group_id", "group_size", "sample_index")
_NATIVE_ARRAYS = ("loss_mask", "forced_tokens", "routed_experts", "indexer_topk", *TOKEN_LOG_PROB_ARRAYS,
                  *SUPPORT_LOG_PROB_ARRAYS)


class ReplayError(InvalidInput):
    """A recording that cannot be replayed; the message names file and line."""


def recorded_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".safetensors"))
    if not path.exists():
        raise ReplayError(f"replay_path {path} does not exist")
    return [path]


def turn_of(event: Mapping[str, Any], vocab_size: int | None) -> Turn:
    """A `Turn` from a recorded `turn` event: an SGLang response
    (`output_ids` + `meta_info`) or native fields."""
    if "output_ids" in event:
        return turn_from_sglang(event["output_ids"], event["meta_info"], forced_tokens=event.get("forced_tokens"),
                                loss_mask=event.get("loss_mask"), vocab_size=vocab_size,
                                require_mask=event.get("require_mask", True))
    mask = None
    if "mask_ids" in event or "mask_offsets" in event:
        mask = SamplingMask(event["mask_ids"], event["mask_offsets"])
    arrays: dict[str, Any] = {name: np.asarray(event[name]) for name in _NATIVE_ARRAYS if event.get(name) is not None}
    normalized = event.get("mask_log_probs_normalized", False)
    if not isinstance(normalized, bool):
        raise ReplayError(f"rule 'mask_log_probs_normalized is true or false' not met: got {normalized!r:.80}")
    return Turn.build(event["tokens"], event["log_probs"], mask=mask, supports=event.get("supports"),
                      status=event.get("status", "completed"), weight_version=event.get("weight_version"),
                      mask_log_probs_normalized=normalized, vocab_size=vocab_size, **arrays)


def jsonl_events(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, event) for each non-blank line."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                event = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ReplayError(f"{where}: not JSON: {exc}") from None
            if not isinstance(event, dict) or event.get("type") not in EVENT_TYPES or not event.get("trajectory_id"):
                raise ReplayError(f"{where}: expected an object with type in {list(EVENT_TYPES)} and a trajectory_id")
            yield where, event


def miles_payload(path: Path, vocab_size: int | None):
    """The trajectory in one miles session payload: (prompt, turns, session metadata)."""
    try:
        session = decode_session_samples(path.read_bytes())  # with the mask when the payload carries it
    except ValueError as exc:
        raise ReplayError(f"{path}: not a miles session payload: {exc}") from None
    try:
        converted = turns_from_miles_samples(session.samples, vocab_size=vocab_size)
    except ValueError as exc:
        raise ReplayError(f"{path}: {exc}") from None
    if converted.dropped:
        log.info("miles samples after the merge stops are not sent", extra={"file": str(path),
                                                                           "dropped": converted.dropped})
    if converted.unknown_fields:  # a newer miles': the codec carries them, a turn has no place for them
        log.info("miles sample fields rollstream does not interpret are not sent",
                 extra={"file": str(path), "fields": list(converted.unknown_fields),
                        "count": len(converted.unknown_fields)})
    return converted, session.session_metadata if isinstance(session.session_metadata, dict) else {}


class ReplaySource:
    """Sends recorded trajectories in file and line order. Its handles halt,
    as `drive`'s do: the broker's refusal of a turn or an end gives that
    trajectory up (aborted, `given_up` in the ledger), and the rest of its
    recorded attempt is skipped, up to and including the attempt's own end
    or abort; the other trajectories go on."""

    def __init__(self, settings: ProducerSettings, producer_id: str):
        if not settings.replay_path:
            raise ReplayError("the replay source needs replay_path (a .jsonl/.safetensors file or a directory)")
        self.settings = settings
        self.files = recorded_files(settings.replay_path)
        self.given_up: set[str] = set()  # recorded attempts a refusal gave up, whose events are skipped

    async def run(self, producer: AsyncProducer, stopping: asyncio.Event) -> None:
        pacer = Pacer(self.settings.rate)
        open_: dict[str, AsyncTrajectoryHandle] = {}
        metrics = producer.metrics
        try:
            for path in self.files:
                if stopping.is_set():
                    return
                if path.suffix == ".safetensors":
                    await pacer.wait()
                    metrics.inc(metrics.trajectories, outcome=await self._send_payload(producer, path))
                    continue
                for where, event in jsonl_events(path):
                    if stopping.is_set():
                        return
                    outcome = await self._send_event(producer, open_, where, event, pacer)
                    if outcome is not None:
                        metrics.inc(metrics.trajectories, outcome=outcome)
        finally:
            for traj in open_.values():  # recordings cut short, or stopping: do not leave them open
                if traj.halted is None:  # (a halted one was aborted when the refusal gave it up)
                    retrieve(await traj.abort(STOPPING if stopping.is_set() else "replay ended without end"))
                metrics.inc(metrics.trajectories, outcome=ABORTED)

    async def _send_payload(self, producer: AsyncProducer, path: Path) -> str:
        """Send a miles payload's trajectory whole; its outcome."""
        converted, session = miles_payload(path, producer.vocab_size)
        identity = {name: session[name] for name in _IDENTITY if session.get(name) is not None}
        reward = session.get("reward", self.settings.default_reward)
        try:
            futures = await producer.send_trajectory(str(session.get("trajectory_id") or path.stem),
                                                     converted.prompt_tokens, converted.turns, reward, halts=True,
                                                     **identity)
        except Halted:  # a refusal gave it up (logged, counted, in the ledger)
            return ABORTED
        for future in futures:
            retrieve(future)
        return ENDED

    async def _send_event(self, producer: AsyncProducer, open_: dict[str, AsyncTrajectoryHandle], where: str,
                          event: dict, pacer: Pacer) -> str | None:
        """Send one recorded event; the trajectory's outcome once it is over."""
        tid = event["trajectory_id"]
        traj = open_.get(tid)
        kind = event["type"]
        if traj is None and tid in self.given_up:  # the rest of an attempt a refusal gave up
            if kind != "turn":
                self.given_up.discard(tid)
            return None
        if traj is None:
            if kind != "turn":
                raise ReplayError(f"{where}: {kind} for trajectory {tid!r}, which has no open turn before it")
            if "prompt_tokens" not in event:
                raise ReplayError(f"{where}: the first turn of {tid!r} needs prompt_tokens")
            await pacer.wait()
            try:
                traj = producer.trajectory(tid, event["prompt_tokens"], metadata=event.get("metadata"),
                                           **{name: event.get(name) for name in _IDENTITY})
            except (TypeError, ValueError) as exc:
                raise ReplayError(f"{where}: cannot open trajectory {tid!r}: {exc}") from None
            traj.halts = True
            open_[tid] = traj
        try:
            if kind == "turn":
                if event.get("turn", traj.next_turn) != traj.next_turn:
                    raise ReplayError(f"{where}: turn of {tid!r} must be {traj.next_turn} (line order), "
                                      f"got {event['turn']}")
                try:
                    turn = turn_of(event, producer.vocab_size)
                except (KeyError, TypeError, ValueError) as exc:
                    raise ReplayError(f"{where}: turn {traj.next_turn} of {tid!r} is not a valid turn: {exc!r}") from None
                retrieve(await traj.send(turn, metadata=None if traj.next_turn == 0 else event.get("metadata")))
                return None
            del open_[tid]
            if kind == "end":
                retrieve(await traj.end(event.get("reward", self.settings.default_reward), event.get("metadata")))
                return ENDED
            retrieve(await traj.abort(event.get("reason", "")))
            return ABORTED
        except Halted:  # a refusal gave the trajectory up (logged, counted, in the ledger)
            if open_.pop(tid, None) is not None:  # its attempt's later events are skipped
                self.given_up.add(tid)
            return ABORTED
