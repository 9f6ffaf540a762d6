"""The end-to-end checker: what producers had acknowledged, joined with what
consumers handed to the trainer and what the broker dead-lettered.

Each side writes a `Ledger` (JSON lines, one file per process):
- a producer writes `sent` when it accepts a trajectory's `end` (every
  turn's content digest, taken as the turn was sent) and `acked` when the
  broker acknowledges that `end` durably;
- a consumer writes `handed` when it gives a trajectory to the trainer and
  `committed`, with the digest of the arrays it delivered, when the trainer
  commits it. A checkpointing consumer's commits also name their `run`,
  `lineage`, `step` and `position`; it writes `resumed` (the new lineage,
  the lineage whose checkpoint it resumed from and that checkpoint's step)
  and `sealed`.

With lineages, what counts is the lineage the surviving model descends
from: per run, the latest lineage's commits, then its parent's through the
step it resumed from, and so on back. A trajectory trained twice there is
`duplicated`, an acked one trained nowhere there is `lost`; one trained by
an abandoned lineage and again in the surviving one is `replayed`, which
is how it must be.

A producer issuing trajectories from numbered prompts (each as a group of
samples) also writes `issued` (`prompt`, `sample`, `id`) per trajectory it
starts, again under the same id when it continues or restarts one after its
own restart. Trajectory figures cannot see a prompt that never trained (a
group none of whose trajectories was acked) or a sample issued again under
a new id and trained twice, so prompts get their own: `prompts_skipped`
(no trajectory of it trained and none dead-lettered for a reason the run
chose, `CHOSEN_DEAD_REASONS`; `prompts_unseen` while the broker has a
backlog) and `prompts_duplicated` (a sample trained more than once across
its ids). A group trained short (a member given up) is neither.

The digests are computed here from docs/semantics.md §3-§4 alone (forced tokens
get log-prob 0, loss 0 and a singleton support; a replay gap cuts the
trajectory after the last fully captured turn's sampled tokens; nothing is
applied after a `truncated` or `aborted` turn), never by the broker's merge
code, so a merge bug shows as `corrupted` or `partial`. Records hold
digests, not arrays: hashing is a pass over bytes the caller already has.
"""
from __future__ import annotations

import json
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

import numpy as np
import xxhash

from .clock import Clock
from .contract import ARRAYS, CONTEXT_REPLAY_ARRAYS, REPLAY_FIELDS, SUPPORT_LOG_PROB_ARRAYS, TOKEN_LOG_PROB_ARRAYS
from .messages import status_count

# The digest's streams: each is the field's values over the whole trajectory,
# in order, in the contract dtype; a support is hashed as its size and ids.
_STREAMS = ("prompt_tokens", "tokens", "log_probs", "loss_mask", "support_sizes", "mask_ids")
_TOKENS, _LOG_PROBS, _LOSS, _SIZES, _IDS = range(1, 6)
_SIZE_DTYPE = ARRAYS["mask_offsets"].dtype
# The optional log-prob arrays, each digested in a stream of its own, in this order.
_LOG_PROB_ARRAYS = (*TOKEN_LOG_PROB_ARRAYS, *SUPPORT_LOG_PROB_ARRAYS)


def _raw(values, name: str) -> memoryview:
    """The bytes of `values` in the contract dtype of `name` (no copy when it already is)."""
    array = np.ascontiguousarray(np.asarray(values), dtype=ARRAYS[name].dtype)
    return array.data.cast("B")


class ContentDigest:
    """A streaming digest of a trajectory's content as docs/semantics.md merges
    it: feed the prompt, then each turn's sampled tokens and its forced
    tokens, in order. `copy` forks it (a turn sent again after a refusal
    goes on from the state before it). An optional log-prob array beyond
    `log_probs` (per token, `TOKEN_LOG_PROB_ARRAYS`, or per support id,
    `SUPPORT_LOG_PROB_ARRAYS`) gets a stream of its own from the first turn
    that carries it, and a trajectory without one digests as before there
    were any. A forced token adds 0.0 to each: its log-prob, and its
    singleton support's."""

    __slots__ = ("_streams", "has_mask", "_replay", "_log_prob_streams")

    def __init__(self, prompt_tokens=None):
        self._streams = [xxhash.xxh3_64() for _ in _STREAMS]
        self.has_mask = False
        self._replay = b""  # the latest turn's context replay arrays (the merged trajectory keeps those)
        self._log_prob_streams = {}  # name -> its stream, for the optional log-prob arrays carried
        if prompt_tokens is not None:
            self._streams[0].update(_raw(prompt_tokens, "prompt_tokens"))

    def copy(self) -> "ContentDigest":
        other = ContentDigest.__new__(ContentDigest)
        other._streams = [stream.copy() for stream in self._streams]
        other.has_mask, other._replay = self.has_mask, self._replay
        other._log_prob_streams = {name: stream.copy() for name, stream in self._log_prob_streams.items()}
        return other

    def add_sampled(self, tokens, log_probs, loss_mask=None, mask_ids=None, mask_offsets=None,
                    replay: Mapping[str, Any] | None = None, log_prob_arrays: Mapping[str, Any] | None = None) -> None:
        """One turn's sampled tokens; `loss_mask` None means every one trains;
        `log_prob_arrays` the turn's arrays of `TOKEN_LOG_PROB_ARRAYS` (one
        per token) and `SUPPORT_LOG_PROB_ARRAYS` (one per support id) by name."""
        streams = self._streams
        n = len(tokens)
        streams[_TOKENS].update(_raw(tokens, "tokens"))
        streams[_LOG_PROBS].update(_raw(log_probs, "log_probs"))
        for name, values in (log_prob_arrays or {}).items():
            if values is not None:  # not carried (a dataset row holds None where a trajectory has none)
                self._log_prob_streams.setdefault(name, xxhash.xxh3_64()).update(_raw(values, name))
        streams[_LOSS].update(b"\x01" * n if loss_mask is None else _raw(loss_mask, "loss_mask"))
        if mask_offsets is not None:
            self.has_mask = True
            streams[_SIZES].update(np.diff(np.asarray(mask_offsets, dtype=_SIZE_DTYPE)).data.cast("B"))
            streams[_IDS].update(_raw(mask_ids, "mask_ids"))
        if replay:
            kept = xxhash.xxh3_64()
            for name in CONTEXT_REPLAY_ARRAYS:
                if replay.get(name) is not None:
                    array = np.asarray(replay[name])
                    kept.update(f"{name}{list(array.shape)}".encode())
                    kept.update(_raw(array, name))
            self._replay = kept.digest()

    def add_forced(self, forced_tokens) -> None:
        """Forced tokens: log-prob 0, loss 0, a singleton support each when
        the trajectory carries a mask (its one id's log-prob 0 when it
        carries those)."""
        n = len(forced_tokens)
        if not n:
            return
        streams = self._streams
        raw = _raw(forced_tokens, "tokens")
        streams[_TOKENS].update(raw)
        streams[_LOG_PROBS].update(bytes(ARRAYS["log_probs"].dtype.itemsize * n))
        for name, stream in self._log_prob_streams.items():  # one entry per forced token either way
            stream.update(bytes(ARRAYS[name].dtype.itemsize * n))
        streams[_LOSS].update(bytes(n))
        if self.has_mask:
            streams[_SIZES].update(np.ones(n, _SIZE_DTYPE).data.cast("B"))
            streams[_IDS].update(raw)

    def hexdigest(self) -> str:
        whole = xxhash.xxh3_128()
        for stream in self._streams:
            whole.update(stream.digest())
        whole.update(self._replay)
        for name in _LOG_PROB_ARRAYS:
            if name in self._log_prob_streams:
                whole.update(name.encode())
                whole.update(self._log_prob_streams[name].digest())
        return whole.hexdigest()


def delivered_digest(arrays: Mapping[str, Any]) -> str:
    """The digest of a delivered trajectory's arrays (contract names:
    `prompt_tokens`, `tokens` for the response, `log_probs`, `loss_mask`,
    and `mask_ids` + `mask_offsets`, the replay arrays and the optional
    log-prob arrays it carries)."""
    digest = ContentDigest(arrays["prompt_tokens"])
    digest.add_sampled(arrays["tokens"], arrays["log_probs"], arrays["loss_mask"], arrays.get("mask_ids"),
                       arrays.get("mask_offsets"), {name: arrays.get(name) for name in CONTEXT_REPLAY_ARRAYS},
                       {name: arrays.get(name) for name in _LOG_PROB_ARRAYS})
    return digest.hexdigest()


class TurnRecord(NamedTuple):
    """What the checker needs of one sent turn: its status, the replay
    fields it carried, and the trajectory's digest after its sampled
    tokens and after its forced tokens."""

    status: str
    carries: tuple[str, ...]
    after_sampled: str
    after_forced: str


def turn_record(before: ContentDigest, turn) -> tuple[TurnRecord, ContentDigest]:
    """The record of `turn` (a `Turn`) sent on top of `before`, and the digest after it."""
    after = before.copy()
    mask = turn.mask
    after.add_sampled(turn.tokens, turn.log_probs, turn.loss_mask, None if mask is None else mask._ids,
                      None if mask is None else mask._offsets,
                      {name: getattr(turn, name) for name in CONTEXT_REPLAY_ARRAYS},
                      {name: getattr(turn, name) for name in _LOG_PROB_ARRAYS})
    sampled = after.hexdigest()
    after.add_forced(turn.forced_tokens)
    carries = tuple(name for name in REPLAY_FIELDS if turn.carries(name))
    return TurnRecord(turn.status, carries, sampled, after.hexdigest()), after


@dataclass(frozen=True)
class Expected:
    """What a trajectory's consumer must get: the final digest, the gap it
    must report (turn, field) or None, and the digests of shorter versions
    of it (a delivery matching one of those lost turns)."""

    digest: str
    gap: tuple[int, str] | None
    shorter: frozenset[str]


def expected(prompt_digest: str, turns: list[TurnRecord]) -> Expected:
    """Apply docs/semantics.md §4 to the sent turns: stop after a terminal
    status; at a turn lacking a replay field the trajectory carried, cut
    after the previous turn's sampled tokens and report the gap."""
    final, seen = prompt_digest, [prompt_digest]
    carried: set[str] | None = None
    for index, turn in enumerate(turns):
        if carried is None:
            carried = set(turn.carries)
        else:
            missing = [name for name in REPLAY_FIELDS if name in carried and name not in turn.carries]
            if missing:
                cut = turns[index - 1].after_sampled
                return Expected(cut, (index, missing[0]), frozenset(seen) - {cut})
        seen += [turn.after_sampled, turn.after_forced]
        final = turn.after_forced
        if turn.status != "completed":
            break
    return Expected(final, None, frozenset(seen) - {final})


class Ledger:
    """One process's records, appended to `path` as JSON lines. Each record
    is one `write` of one line to a file opened for appending, so a process
    killed at any point leaves whole lines behind (a torn last line is
    skipped when read). Safe to share between threads."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":  # a killed writer's torn line: end it
            os.write(self._fd, b"\n")

    def write(self, kind: str, **fields: Any) -> None:
        """Append one record: its `kind`, `fields` and `at` (wall-clock seconds, comparable across processes)."""
        line = json.dumps({"kind": kind, **fields, "at": Clock.read().wall}, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class LedgerReader:
    """Follows the ledgers at `paths` (a directory stands for the `*.jsonl`
    files in it, including ones that appear later) as they grow: each
    `read_new` returns the whole records written since the last. A line
    still being written waits for its newline; the torn last line of a
    killed process gets one from the next `Ledger` opened on that file, and
    is skipped."""

    def __init__(self, paths: Iterable[str | os.PathLike]):
        self.paths = [Path(path) for path in paths]
        self._offsets: dict[Path, int] = {}

    def read_new(self) -> list[dict]:
        records = []
        for path in self.paths:
            for file in sorted(path.glob("*.jsonl")) if path.is_dir() else [path]:
                records += self._read(file)
        return records

    def _read(self, file: Path) -> list[dict]:
        start = self._offsets.get(file, 0)
        try:
            with open(file, "rb") as f:
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offsets[file] = start + end
        records = []
        for line in data[:end].splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a killed writer's torn line
                continue
        return records


def read_records(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """Every whole record of the ledgers at `paths` (a directory stands for its `*.jsonl` files)."""
    return LedgerReader(paths).read_new()


@dataclass
class Report:
    """The checker's verdict. Each list names trajectories (the `prompts_`
    ones, prompt keys); all must be empty (and dead letters only those a
    scenario expects)."""

    acked: int = 0
    committed: int = 0
    lost: list[str] = field(default_factory=list)  # acked, not delivered, and the broker holds nothing more to deliver
    duplicated: list[str] = field(default_factory=list)  # committed by the trainer more than once
    partial: list[str] = field(default_factory=list)  # delivered with turns missing and no matching gap
    corrupted: list[str] = field(default_factory=list)  # delivered bytes differ from what was acked
    unseen: list[str] = field(default_factory=list)  # acked, still neither delivered nor dead-lettered
    dead_lettered: Counter = field(default_factory=Counter)  # acked trajectories dead-lettered, by reason
    # Trajectories their producer gave up, by its reason: a refusal of one of their frames ("turn 2 refused:
    # out_of_vocab"), a support overflow, or `ON_RESTART_ABORT`. Shown, not failed: the producer chose.
    given_up: Counter = field(default_factory=Counter)
    redelivered: int = 0  # hand-outs to the trainer beyond the committed one (a consumer died before committing)
    unacked_committed: int = 0  # committed with no ack recorded (a producer killed before it read the ack)
    replayed: int = 0  # commits by abandoned lineages of trajectories the surviving one trained again
    resumed_from_step: int | None = None  # the latest resume's checkpoint step
    replayed_batches_identical: bool | None = None  # each batch trained again as it was trained first (None: none was)
    prompts: int = 0  # distinct prompts judged: those with `issued` records, and those `check` was told to expect
    prompts_skipped: list[str] = field(default_factory=list)  # no trajectory trained, none dropped by the run's choice
    prompts_duplicated: list[str] = field(default_factory=list)  # a sample trained more than once across its ids
    prompts_unseen: list[str] = field(default_factory=list)  # not trained yet while the broker has a backlog

    PROBLEMS = ("lost", "duplicated", "partial", "corrupted", "unseen")
    # Counted only when prompts were judged: a run without `issued` records reads as before.
    PROMPT_PROBLEMS = ("prompts_skipped", "prompts_duplicated", "prompts_unseen")

    def counts(self) -> dict[str, int]:
        names = self.PROBLEMS + (self.PROMPT_PROBLEMS if self.prompts else ())
        return {name: len(getattr(self, name)) for name in names}

    def ok(self, expected_dead_reasons: Iterable[str] = ()) -> bool:
        """Nothing lost, duplicated, partial, corrupted or unseen, no prompt
        skipped, duplicated or unseen, and no acked trajectory dead-lettered
        for a reason not expected."""
        allowed = set(expected_dead_reasons)
        return not any(self.counts().values()) and all(reason in allowed for reason in self.dead_lettered)

    def line(self) -> str:
        return "  ".join(f"{name} {count}" for name, count in self.counts().items())

    def summary(self) -> dict[str, Any]:
        return {"acked": self.acked, "committed": self.committed, **self.counts(),
                "dead_lettered": dict(self.dead_lettered), "given_up": dict(self.given_up), "redelivered": self.redelivered,
                "unacked_committed": self.unacked_committed, **self.lineage(), **self.prompt_figures()}

    def prompt_figures(self) -> dict[str, int]:
        """The prompt figures, zeros included (`summary()` always has them; `counts()` only once prompts were judged)."""
        return {"prompts": self.prompts, **{name: len(getattr(self, name)) for name in self.PROMPT_PROBLEMS}}

    def lineage(self) -> dict[str, Any]:
        """The lineage figures (`lineage_lost`, `lineage_duplicated`: the
        counts above, which follow the surviving lineage when there is one)."""
        return {"lineage_lost": len(self.lost), "lineage_duplicated": len(self.duplicated), "replayed": self.replayed,
                "resumed_from_step": self.resumed_from_step,
                "replayed_batches_identical": self.replayed_batches_identical}


# What a broker's `status` counts as ended and still to deliver: queued, out
# on a lease, waiting for its reward, waiting for the rest of its group.
BACKLOG_KEYS = ("queued", "leased", "scoring", "awaiting_group")


# The dead-letter reasons that are the run's own choices (a group filter, a
# staleness bound, an abandoned lineage's samples): a prompt one of whose
# trajectories was dropped for one was judged, not skipped. Others (`expired`,
# `reward_expired`, `unreadable`, ...) are failures and do not excuse a prompt.
# A reason is matched by its part before any `:` (`filtered:zero_variance`).
CHOSEN_DEAD_REASONS = frozenset({"filtered", "stale", "abandoned"})
# The reason `Report.given_up` counts a trajectory under that a restarted producer aborted (`on_restart = abort`).
ON_RESTART_ABORT = "on_restart abort"


def broker_backlog(status: Mapping[str, Any]) -> int:
    """The trajectories a broker's `status` says it still has to deliver
    (`BACKLOG_KEYS`), the `broker_backlog` that `check` takes."""
    return sum(status_count(status, key) for key in BACKLOG_KEYS)


def check(records: Iterable[Mapping[str, Any]], dead_letters: Iterable[Mapping[str, Any]] = (), *,
          broker_backlog: int = 0, prompts: Iterable[str] | None = None) -> Report:
    """Join ledger records with the broker's dead letters (`trajectory_id`,
    `reason`). An acked trajectory neither committed nor dead-lettered is
    `unseen` while the broker still has trajectories to deliver
    (`broker_backlog`, from its status by `broker_backlog()`) and `lost`
    once it has none. `prompts`: the prompt keys the run was to issue (one
    with no `issued` record is skipped); None judges only the issued ones."""
    sent: dict[str, Mapping[str, Any]] = {}
    acked: set[str] = set()
    handed: Counter = Counter()
    committed: dict[str, list[Mapping[str, Any]]] = {}
    resumes: dict[str, Mapping[str, Any]] = {}
    issued: dict[str, dict[int, set[str]]] = {str(key): {} for key in prompts or ()}
    # Trajectories their producer chose to give up: at a restart (`taken_up` with action abort) or for a reason its
    # source names (`given_up`, a support overflow)
    given_up: dict[str, str] = {}  # by id, the reason
    for record in records:
        kind = record.get("kind")
        if kind == "resumed":
            resumes[record["lineage"]] = record
            continue
        if kind == "sealed":
            continue
        tid = record["id"]
        if kind == "sent":
            sent[tid] = record
        elif kind == "acked" and (record.get("applied") or record.get("duplicate")):
            acked.add(tid)
        elif kind == "handed":
            handed[tid] += 1
        elif kind == "committed":
            committed.setdefault(tid, []).append(record)
        elif kind == "issued":
            issued.setdefault(str(record["prompt"]), {}).setdefault(record["sample"], set()).add(tid)
        elif kind == "given_up":
            given_up[tid] = str(record.get("reason") or "unknown")
        elif kind == "taken_up" and record.get("action") == "abort":
            given_up[tid] = ON_RESTART_ABORT
    dead = {item["trajectory_id"]: item.get("reason") or "unknown" for item in dead_letters}
    report = Report(acked=len(acked), committed=len(committed), given_up=Counter(given_up.values()))
    trained = _surviving(committed, resumes, report)
    for tid in sorted(acked):
        deliveries = committed.get(tid)
        if not trained[tid]:  # (with lineages: trained, if at all, only by abandoned ones)
            if tid in dead:
                report.dead_lettered[dead[tid]] += 1
            else:
                (report.unseen if broker_backlog else report.lost).append(tid)
        elif trained[tid] > 1:
            report.duplicated.append(tid)
        if not deliveries:
            continue
        want = _expected_of(sent.get(tid))
        if want is None:
            report.corrupted.append(tid)  # acked with no record of what was sent: nothing vouches for the bytes
            continue
        for delivery in deliveries:
            gap = tuple(delivery["gap"]) if delivery.get("gap") else None
            if delivery["digest"] == want.digest and gap == want.gap:
                continue
            (report.partial if delivery["digest"] in want.shorter else report.corrupted).append(tid)
            break
    report.unacked_committed = sum(1 for tid in committed if tid not in acked)
    report.redelivered = sum(max(0, count - len(committed.get(tid, ()))) for tid, count in handed.items())
    _judge_prompts(issued, trained, dead, given_up, broker_backlog, report)
    return report


def _judge_prompts(issued: Mapping[str, Mapping[int, set[str]]], trained: Counter, dead: Mapping[str, str],
                   given_up: Mapping[str, str], broker_backlog: int, report: Report) -> None:
    """Set the report's prompt figures from the ids issued per prompt and
    sample, with `trained` as `check` counts it (the surviving lineage). A
    trajectory a restarted producer gave up (`on_restart = abort`) was
    thrown away by the run's choice, as a chosen dead letter is."""
    report.prompts = len(issued)
    for key in sorted(issued):
        samples = issued[key]
        if any(sum(trained[tid] for tid in ids) > 1 for ids in samples.values()):
            report.prompts_duplicated.append(key)
        ids = set().union(*samples.values())
        if any(trained[tid] for tid in ids):
            continue
        if any(dead.get(tid, "").partition(":")[0] in CHOSEN_DEAD_REASONS or tid in given_up for tid in ids):
            continue
        # A prompt every issued trajectory of which was dead-lettered cannot come any more, backlog or not.
        may_come = not ids or any(tid not in dead for tid in ids)
        (report.prompts_unseen if broker_backlog and may_come else report.prompts_skipped).append(key)


def _surviving(committed: Mapping[str, list[Mapping[str, Any]]], resumes: Mapping[str, Mapping[str, Any]],
               report: Report) -> Counter:
    """How many times each trajectory was trained in the lineages the
    surviving models descend from (`_kept`); with no lineages, every
    commit. Sets the report's replay figures."""
    commits = [c for records in committed.values() for c in records]
    if not any("lineage" in c for c in commits):
        return Counter({tid: len(records) for tid, records in committed.items()})
    surviving = _kept(commits, resumes)
    counts = Counter(c["id"] for c in surviving)
    kept = {id(c) for c in surviving}
    report.replayed = sum(1 for c in commits if id(c) not in kept and counts[c["id"]])
    latest_resume = max(resumes.values(), key=lambda r: r["at"], default=None)
    report.resumed_from_step = None if latest_resume is None else latest_resume["from_step"]
    report.replayed_batches_identical = _replays_identical(commits, kept)
    return counts


def _kept(commits: list[Mapping[str, Any]], resumes: Mapping[str, Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The commits of the lineages the surviving models descend from: per
    run, the latest lineage's, then its parent's through the step it
    resumed from, and so on back."""
    latest: dict[str, tuple[float, str]] = {}
    for c in commits:
        run = c.get("run", "")
        latest[run] = max(latest.get(run, (float("-inf"), "")), (c["at"], c.get("lineage", "")))
    for r in resumes.values():
        latest[r["run"]] = max(latest.get(r["run"], (float("-inf"), "")), (r["at"], r["lineage"]))
    by_lineage: dict[str, list[Mapping[str, Any]]] = {}
    for c in commits:
        by_lineage.setdefault(c.get("lineage", ""), []).append(c)
    kept: list[Mapping[str, Any]] = []
    for _, final in latest.values():
        lineage: str | None = final
        through = float("inf")
        while lineage is not None:
            kept += [c for c in by_lineage.get(lineage, ()) if c.get("step", 0) <= through]
            resume = resumes.get(lineage)
            if resume is None:
                break
            through = min(through, resume["from_step"])
            lineage = resume.get("parent")
    return kept


def surviving_commits(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The `committed` records (`id`, `run`, `lineage`, `step`, `position`)
    of the lineages the surviving models descend from, as `check` follows
    them; every commit when none names a lineage (a consumer that deletes
    on commit). What a broker's archive of the run's trained rows must
    match, each once (docs/archive.md)."""
    commits, resumes = [], {}
    for record in records:
        if record.get("kind") == "committed":
            commits.append(record)
        elif record.get("kind") == "resumed":
            resumes[record["lineage"]] = record
    if not any("lineage" in c for c in commits):
        return commits
    return _kept(commits, resumes)


def _replays_identical(commits: list[Mapping[str, Any]], kept: set[int]) -> bool | None:
    """Whether every batch trained again (a run's step committed by an
    abandoned lineage and by a surviving one) holds the same trajectories in
    the same order; None when no batch was trained again."""
    batches: dict[tuple[str, str, int], dict[int, str]] = {}
    for c in commits:
        if "lineage" in c and "step" in c:
            batches.setdefault((c.get("run", ""), c["lineage"], c["step"]), {})[c.get("position", 0)] = c["id"]
    surviving = {(c.get("run", ""), c["step"]): (c.get("run", ""), c["lineage"], c["step"])
                 for c in commits if id(c) in kept and "step" in c}
    compared = None
    for (run, lineage, step), batch in batches.items():
        mine = surviving.get((run, step))
        if mine is None or mine[1] == lineage:
            continue
        same = sorted(batch.items()) == sorted(batches[mine].items())
        compared = same if compared is None else compared and same
    return compared


def _expected_of(record: Mapping[str, Any] | None) -> Expected | None:
    if record is None:
        return None
    return expected(record["prompt"], [TurnRecord(status, tuple(carries), sampled, forced)
                                       for status, carries, sampled, forced in record["turns"]])
