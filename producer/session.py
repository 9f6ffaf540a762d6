"""The producer's conduct toward its broker (docs/protocol.md §3), sans-I/O.

`ProducerSession` decides what the producer's one connection says and what
the broker's replies mean: the hello and what the welcome negotiated
(batched acks, batched frames and their byte bound, the granted window),
pings and what a pong proves lost, the broker's liveness, the resend of
everything in order behind a fresh hello after a reconnect, and which frames
go out next, batched. It numbers the drafts the trajectory handles submit
(encoding one again when a refusal rewound its handle meanwhile), keeps them
until a reply settles them (the intake, the optional spool, the
`ResendWindow`), and rewinds the handle of a refused turn, or, for a handle
that halts, gives its trajectory up: aborts it and takes nothing more of it.

It reads no clock, owns no socket and runs no loop: its facade
(`client.AsyncProducer`) passes the time in, sends what `transmit` hands its
`send`, and feeds every decoded reply to `received`. The only files it
touches are those of the optional spool and ledger it is given, through
their own objects. It takes no lock either: the methods marked *shared* are
also called for senders on other threads, so the facade calls them under
its lock; the others run on the facade's event loop only.
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from typing import Any, Callable, Protocol

from rollstream.common.checker import ContentDigest, Ledger, TurnRecord, turn_record
from rollstream.common.codec import PACK_UP_TO_BYTES, encode, encode_batch, number_header
from rollstream.common.errors import InternalError, InvalidInput, InvalidState, ProtocolError, Refused
from rollstream.common.jobs import DEFAULT_JOB, check_job
from rollstream.common.messages import PRODUCER_TO_BROKER
from rollstream.common.trajectory import Turn

from .errors import Halted
from .metrics import ProducerMetrics
from .spool import Spool, record_bytes
from .window import ABORT, END, TURN, Heartbeat, HeldFrame, Receipt, ResendWindow, Settled, batch_runs

log = logging.getLogger("rollstream.producer")

BEFORE_WELCOME_WINDOW = 2  # frames in flight until the broker's welcome grants a window
BATCH_UP_TO_BYTES = 1 << 20  # a batch of frames stops growing here (or at the broker's max_message_bytes)
PINGS_KEPT = 64  # unanswered pings remembered; a silent broker keeps only the latest
_SEQ_BYTES = len(number_header(b"\x80", 0)) - 1  # what numbering adds to a header


class TrajectoryDigests:
    """A trajectory's content digests for the ledger (`rollstream.common.checker`):
    after its prompt and after each turn accepted. A corrected turn replaces
    a refused one, and turn 0 after an `abort` starts afresh. Nothing is
    hashed unless the producer keeps a ledger."""

    __slots__ = ("prompt_tokens", "_after", "_records")

    def __init__(self, prompt_tokens: Any) -> None:
        self.prompt_tokens = prompt_tokens
        self._after: list[ContentDigest] = []  # after the prompt, then after each turn
        self._records: list[TurnRecord] = []

    def turn(self, index: int, turn: Turn) -> None:
        if not self._after:
            self._after.append(ContentDigest(self.prompt_tokens))
        del self._after[index + 1:], self._records[index:]
        record, after = turn_record(self._after[index], turn)
        self._after.append(after)
        self._records.append(record)

    def earlier(self, turns: list[Turn], next_turn: int) -> None:
        """The turns the broker already holds of a resumed trajectory, sent
        by an earlier run of this producer: recorded as sent, the last
        record repeated up to `next_turn` where fewer turns came back
        (turns merged at the broker without forced tokens between them)."""
        for index, turn in enumerate(turns):
            self.turn(index, turn)
        if not self._after:
            self._after.append(ContentDigest(self.prompt_tokens))
        while self._records and len(self._records) < next_turn:
            last = self._records[-1]
            self._records.append(TurnRecord(last.status, last.carries, last.after_forced, last.after_forced))
            self._after.append(self._after[-1].copy())
        del self._after[next_turn + 1:], self._records[next_turn:]

    def sent(self, turns: int) -> tuple[str, list[list]]:
        """The prompt's digest and the records of the first `turns` turns, for an `end`'s `sent` record."""
        prompt = self._after[0] if self._after else ContentDigest(self.prompt_tokens)
        return prompt.hexdigest(), [list(record) for record in self._records[:turns]]


class DraftSource(Protocol):
    """What the session reads and moves of the trajectory handle a draft came from."""

    trajectory_id: str
    next_turn: int  # the index the handle's next turn goes under: advanced on acceptance, rewound after a refusal
    digests: TrajectoryDigests
    halts: bool  # a refusal of one of its turns or of its end gives its trajectory up (`ProducerSession.settle`)
    halted: Refused | None  # the refusal that gave it up: nothing more of it is accepted

    def abort_draft(self, reason: str, again: bool = False) -> Draft:
        """Its `abort`; without `again`, the final one."""


class Draft:
    """A frame a handle checked and encoded but that is not yet numbered: its
    header lacks `seq`, which `ProducerSession.accept` adds at a fixed width
    (so `spool_bytes` is final). `encode(index)` encodes it again under
    another turn index, for a handle a refusal rewound before it was accepted."""

    __slots__ = ("kind", "handle", "frames", "index", "encode", "tokens", "turn")

    def __init__(self, kind: str, handle: DraftSource, index: int, encode_at: Callable[[int], list],
                 tokens: tuple[int, int] = (0, 0), turn: Turn | None = None):
        self.kind, self.handle, self.index, self.encode = kind, handle, index, encode_at
        self.frames = encode_at(index)
        self.tokens = tokens  # sampled, forced
        self.turn = turn  # a turn draft's turn, for the ledger

    @property
    def spool_bytes(self) -> int:
        """What the numbered frame will take in a spool."""
        return record_bytes(self.frames) + _SEQ_BYTES


class ProducerSession:
    """One producer's frames and its conversation with one broker endpoint."""

    def __init__(self, producer_id: str, endpoint: str, *, metrics: ProducerMetrics, now: float, window: int = 256,
                 reply_timeout: float = 30.0, retry_delay: float = 0.5, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 10.0, batch_acks: bool = True, batch_frames: bool = True,
                 send_burst: int = 32, ledger: Ledger | None = None, job: str = DEFAULT_JOB):
        if send_burst < 1:
            raise InvalidInput(f"send_burst must be at least 1 frame, got {send_burst}")
        self.producer_id = producer_id
        self.job = check_job(job)  # named in the hello and on every frame (`rollstream.common.jobs`)
        self.endpoint = endpoint  # named in log lines
        self.metrics = metrics
        self.ledger = ledger
        self.batch_acks = batch_acks
        self.batch_frames = batch_frames
        self.send_burst = send_burst
        self.batch_bytes = 0  # how large a batch may be: 0 until a welcome says the broker reads them
        self.window_setting = window
        # Until the welcome says how many frames this connection may have in
        # flight, a few: hundreds of producers starting at once would
        # otherwise queue a full window each at the broker before any grant.
        self.window = ResendWindow(min(window, BEFORE_WELCOME_WINDOW), reply_timeout=reply_timeout,
                                   retry_delay=retry_delay)
        self.heartbeat = Heartbeat(heartbeat_interval, heartbeat_timeout, now)
        self.spool: Spool | None = None
        self.next_seq = 1  # frames and pings share the sequence
        # New trajectories the broker admits now (its staleness capacity, docs/protocol.md §4); None: no limit.
        self.admit: int | None = None
        # The trainer's branch, its lineage epoch and the step it resumed from, once a resume started one: reload
        # those weights.
        self.branch: tuple[int, int] | None = None
        self.intake: deque[HeldFrame] = deque()  # accepted, in seq order, not yet in the window
        self.in_memory = 0  # accepted and unsettled frames held in memory (intake and window)
        self.pending: dict[int, tuple[Any, float, DraftSource | None]] = {}  # seq -> future, accepted at, a turn's handle
        self.pings: dict[int, float] = {}  # seq -> when transmitted, until answered
        self._ping_seq = 0  # the seq of the ping `ping` built last
        self._connected_before = False
        self._next_overdue_report = 0.0
        self.lists_open: bool | None = None  # whether the broker hands back open trajectories; None until its welcome
        # seq -> a `list_open` or `read_open` awaiting its answer (sent again after a reconnect)
        self.queries: dict[int, list] = {}
        self.answers: dict[int, Any] = {}  # seq -> the reply that answered one of them

    @property
    def unsettled(self) -> int:
        """Frames accepted and not yet settled (in memory and in the spool)."""
        return self.in_memory + (self.spool.backlog if self.spool else 0)

    def use_spool(self, spool: Spool) -> None:
        """Keep every accepted frame in `spool` too; its unsettled frames go
        first, and numbering goes on after its last seq."""
        self.spool = spool
        self.next_seq = spool.last_seq + 1
        if spool.backlog:
            log.info(f"resending {spool.backlog} spooled frames from {spool.directory}",
                     extra={"producer_id": self.producer_id, "frames": spool.backlog, "spool_dir": str(spool.directory)})

    # -- intake (shared) ---------------------------------------------------------
    def spool_bytes(self, draft: Draft) -> int:
        """The draft's spool footprint (0 without a spool); too big for the spool is an error."""
        if self.spool is None:
            return 0
        size = draft.spool_bytes
        if size > self.spool.max_bytes:
            raise InvalidInput(f"a frame of {size} spool bytes exceeds spool_bytes={self.spool.max_bytes}")
        return size

    def has_room(self, size: int) -> bool:
        """Whether a frame of `size` spool bytes may be accepted now: the window
        bounds memory, or the spool's byte budget when there is a spool."""
        if self.spool is None:
            return self.in_memory < self.window.limit
        return self.spool.nbytes + size <= self.spool.max_bytes

    def accept(self, draft: Draft, future: Any, now: float) -> None:
        """*Shared.* Number the draft and keep it until settled (in the spool,
        and in the intake while memory has room), register its `future` and
        move its handle on. A draft whose handle a refusal rewound since it
        was encoded is encoded again under the rewound index; one whose
        handle a refusal halted raises `Halted`, and nothing changes."""
        handle, kind = draft.handle, draft.kind
        if handle.halted is not None:
            raise Halted(handle.trajectory_id, handle.halted, kind)
        if kind != ABORT and handle.next_turn != draft.index:
            draft.index = handle.next_turn
            draft.frames = draft.encode(draft.index)
        seq = self.next_seq
        self.next_seq = seq + 1
        frames = [number_header(draft.frames[0], seq), *draft.frames[1:]]
        item = HeldFrame(seq, kind, handle.trajectory_id, frames, draft.index if kind == TURN else None)
        # The ledger before the spool: a process killed between the two leaves an end recorded `sent` that no spool
        # holds (its trajectory stays open at the broker, to be handed back and ended again), never a spooled end
        # that the next run resends and records `acked` with no record of what it carries.
        if self.ledger is not None:
            self._record(draft, self.ledger)
        spool = self.spool
        direct = spool is None or (not spool.backlog and self.in_memory < self.window.limit)
        if spool is not None:
            spool.append(seq, frames, handed_out=direct)
        if direct:
            self.intake.append(item)
            self.in_memory += 1
        self.pending[seq] = (future, now, handle if kind in (TURN, END) else None)
        handle.next_turn = draft.index + 1 if kind == TURN else 0 if kind == ABORT else handle.next_turn
        sampled, forced = draft.tokens
        if sampled or forced:
            tokens = self.metrics.tokens
            tokens.add(sampled, "sampled")
            if forced:
                tokens.add(forced, "forced")

    def _record(self, draft: Draft, ledger: Ledger) -> None:
        """The ledger's view of an accepted draft: a turn's digest goes on from
        the turn before it; an `end` writes the trajectory's `sent` record."""
        digests = draft.handle.digests
        if draft.kind == TURN:
            if draft.turn is None:
                raise InternalError(f"a turn draft of {draft.handle.trajectory_id!r} carries no turn")
            digests.turn(draft.index, draft.turn)
        elif draft.kind == END:
            prompt, turns = digests.sent(draft.index)
            ledger.write("sent", id=draft.handle.trajectory_id, producer=self.producer_id, prompt=prompt, turns=turns)

    def fill_window(self) -> None:
        """*Shared.* Move accepted frames into the window while it has room:
        the intake first, then the spool's backlog, read back in order."""
        window, intake, spool = self.window, self.intake, self.spool
        while intake and not window.full:
            window.push(intake.popleft())
        while spool is not None and spool.backlog and not window.full and not intake:
            backlog = spool.next_backlog()
            if backlog is None:  # not while it has a backlog
                break
            window.push(HeldFrame.from_frames(backlog[1]))
            self.in_memory += 1

    def settle(self, settled: list[Settled], now: float) -> list[tuple[Any, Receipt | Refused]]:
        """*Shared.* Frames left the window: free their spool records and
        memory, count their outcomes (with a ledger, an `end`'s `acked`
        record) and rewind the handle of a refused turn to that turn, so the
        corrected turn goes under the same index (not after `conflict`: the
        broker's turn stands); a handle that halts gives its trajectory up
        at the first refusal of a turn or its end (`_give_up`). Returns each
        future with its outcome, to resolve outside the lock (a blocking
        future runs its callbacks there)."""
        outcomes: Counter = Counter()
        resolved = []
        observe = self.metrics.ack_latency.observe
        spool, pending, ledger = self.spool, self.pending, self.ledger
        for item, outcome in settled:
            if spool is not None:
                spool.settle(item.seq)
            self.in_memory -= 1
            future, accepted_at, handle = pending.pop(item.seq, (None, None, None))
            if accepted_at is not None:
                observe(now - accepted_at)
            if isinstance(outcome, Refused):
                if handle is not None and item.turn is not None and outcome.code != "conflict":
                    handle.next_turn = min(handle.next_turn, item.turn)
                if handle is not None and handle.halts and handle.halted is None:
                    self._give_up(handle, outcome, now)
            else:
                outcomes["duplicate" if outcome.duplicate else "applied" if outcome.applied
                         else outcome.reason or "not_applied"] += 1
                if item.kind == END and ledger is not None:
                    ledger.write("acked", id=item.trajectory_id, applied=outcome.applied, duplicate=outcome.duplicate,
                                 reason=outcome.reason, latency=None if accepted_at is None else now - accepted_at)
            if future is not None:
                resolved.append((future, outcome))
        for label, count in outcomes.items():
            self.metrics.acked.add(count, label)
        return resolved

    def _give_up(self, handle: DraftSource, refused: Refused, now: float) -> None:
        """A halting handle's turn or end was refused: whatever it sends
        next would not follow what the broker holds (a later turn would take
        the refused one's index), so its trajectory is given up: recorded
        `given_up` in the ledger, then its final abort accepted (it goes once
        every earlier frame of the trajectory is settled: an end accepted
        before is refused first, the broker holding fewer turns than it
        counts), and nothing more of it is accepted (`Halted`)."""
        tid = handle.trajectory_id
        reason = f"{refused.kind}{'' if refused.turn is None else f' {refused.turn}'} refused: {refused.code}"
        if self.ledger is not None:  # before the abort is spooled, as an end's `sent` record is
            self.ledger.write("given_up", id=tid, reason=reason, producer=self.producer_id)
        self.accept(handle.abort_draft(reason), None, now)
        handle.halted = refused
        self.metrics.inc(self.metrics.given_up, code=refused.code)
        log.warning(f"gave {tid!r} up: {refused}; aborting it, nothing more of it is sent",
                    extra={"trajectory_id": tid, "code": refused.code, "reason": reason})

    def abandon(self) -> list:
        """*Shared.* The producer closes: forget every unsettled frame (a
        spool keeps its records); returns their futures (None: a give-up's
        abort, which no caller awaits)."""
        futures = [future for future, _, _ in self.pending.values()]
        self.pending.clear()
        self.intake.clear()
        return futures

    # -- the connection (the loop) -------------------------------------------------
    def hello(self) -> list:
        """The hello that opens a connection: it asks for batched acks and
        frames as configured, and for the trainer's branch as `branch`.
        Until its welcome, one frame a message."""
        fields: dict[str, Any] = {"producer_id": self.producer_id}
        if self.job != DEFAULT_JOB:
            fields["job"] = self.job
        if self.batch_acks:
            fields["batch_acks"] = True
        if self.batch_frames:
            fields["batch_frames"] = True
        fields["reads_branch"] = True
        fields["lists_open"] = True
        self.batch_bytes = 0
        return encode(PRODUCER_TO_BROKER, "hello", fields)

    def connected(self) -> list | None:
        """A handshake with the broker succeeded. The first needs nothing more
        (the hello sent at the start went with it). After a reconnect
        whatever the old connection carried may be lost: its pings are
        forgotten and every unsettled frame goes again, in order, behind the
        fresh hello returned here (send it first)."""
        if not self._connected_before:
            self._connected_before = True
            return None
        self.pings.clear()
        resent = self.window.reconnected()
        self.metrics.inc(self.metrics.reconnects)
        log.info(f"reconnected to the broker {self.endpoint}; resending {resent} frames in order",
                 extra={"endpoint": self.endpoint, "frames": resent})
        return self.hello()

    def transmit(self, now: float, send: Callable[[list], bool],
                 body: Callable[[int], memoryview] | None = None) -> None:
        """Hand `send` every frame that may go now, in order: frames due
        together as batches once the welcome allowed them (`batch_runs`),
        others alone, a batch's body written into `body(size)` when given
        (`encode_batch`). Stops at the first message `send` refuses (False)."""
        window, metrics = self.window, self.metrics
        due = window.due(now)
        runs = ([[item] for item in due] if not self.batch_bytes or len(due) < 2 else
                batch_runs(due, max_items=self.send_burst, max_bytes=self.batch_bytes, item_max_bytes=PACK_UP_TO_BYTES))
        for run in runs:
            if not send(run[0].frames if len(run) == 1 else encode_batch([item.frames for item in run], body)):
                break
            for item in run:
                if item.attempts == 0:
                    metrics.sent.add(1, item.kind)
                else:
                    metrics.resends.add(1)
                window.sent(item.seq, now)

    def received(self, reply: Any, now: float) -> list[Settled]:
        """A decoded reply from the broker (a `Message`). Any reply proves the
        broker alive; a `window` field is its grant; acks and refusals settle
        frames (returned, for `settle`); a pong finds replies lost on the way;
        a welcome says whether the broker reads batches. Replies that answer
        nothing this producer sent are ignored and counted."""
        if self.heartbeat.heard(now):
            self.metrics.broker_up.set(1)
            log.info(f"broker {self.endpoint} answering again", extra={"endpoint": self.endpoint})
        window = self.window
        ignored = window.ignored
        if "window" in reply.fields:  # the welcome's window, or the broker's share of its in-flight bound since
            self._grant(reply["window"])
        kind = reply.type
        if kind in ("welcome", "pong", "acks"):  # each says how many new trajectories the broker admits now
            self.admit = reply.get("admit")
            branch = reply.get("branch", reply.get("lineage"))  # `lineage`: a broker older than `reads_branch`
            if branch is not None and tuple(branch) != self.branch:
                self.branch = (branch[0], branch[1])
                log.warning(f"the trainer resumed from its checkpoint of step {branch[1]} (lineage epoch "
                            f"{branch[0]}): serve those weights; what newer weights sample is dropped as abandoned",
                            extra={"endpoint": self.endpoint, "epoch": branch[0], "resumed_from": branch[1]})
        settled: list[Settled] = []
        if kind == "acks":
            settled = window.on_acks(reply)
        elif kind == "pong":
            self._pong(reply["seq"])
        elif kind == "welcome":
            if self.job != DEFAULT_JOB and reply.get("job") != self.job:
                raise InvalidState(f"rule 'a broker keeps jobs apart' not met: broker {reply['broker_id']} at "
                                   f"{self.endpoint} did not echo job {self.job!r} in its welcome (got "
                                   f"{reply.get('job')!r}); a broker of this version does")
            if self.batch_frames and reply.get("batch_frames"):
                self.batch_bytes = min(BATCH_UP_TO_BYTES, reply["max_message_bytes"])
            self.lists_open = bool(reply.get("lists_open"))
            log.info(f"broker {reply['broker_id']} welcomed us: window {window.limit}",
                     extra={"broker_id": reply["broker_id"], "window": window.limit})
        elif kind in ("open_list", "open_trajectory") or (kind == "nack" and reply.get("seq") in self.queries):
            if self.queries.pop(reply["seq"], None) is not None:
                self.answers[reply["seq"]] = reply
            else:
                self.metrics.inc(self.metrics.ignored)
        elif kind == "nack" and "seq" not in reply.fields:
            self.metrics.inc(self.metrics.ignored)
            log.warning(f"broker refused a message it could not read: {reply['code']}: {reply['message']}",
                        extra={"code": reply["code"], "reason": reply["message"]})
        elif kind in ("ack", "nack"):
            one = window.on_reply(reply, now)
            if one is not None:
                if isinstance(one.outcome, Refused):
                    self._refused(one.outcome)
                settled = [one]
        if window.ignored > ignored:
            self.metrics.inc(self.metrics.ignored, window.ignored - ignored)
        return settled

    def undecodable(self, error: ProtocolError) -> None:
        """A reply that did not decode: ignored, counted and logged."""
        self.metrics.inc(self.metrics.ignored)
        log.warning(f"undecodable reply from the broker ignored: {error.code}: {error.message}",
                    extra={"code": error.code, "reason": error.message})

    def _grant(self, granted: int) -> None:
        """Frames in flight the broker allows now: at most the producer's own
        `window` setting. A smaller grant only stops new frames."""
        limit = min(self.window_setting, granted)
        if limit != self.window.limit:
            self.window.set_limit(limit)

    def _pong(self, seq: int) -> None:
        """The broker answered everything sent before this ping: frames sent
        before it and still unsettled lost their replies, and go again."""
        sent_at = self.pings.pop(seq, None)
        if sent_at is None:
            return
        for earlier in [ping for ping in self.pings if ping < seq]:  # their pongs would have come first
            del self.pings[earlier]
        resent = self.window.answered_until(sent_at)
        if resent:
            log.warning(f"the broker answered a later ping but not {resent} frames sent before it; resending them in order",
                        extra={"frames": resent})

    def _refused(self, refused: Refused) -> None:
        self.metrics.inc(self.metrics.nacked, code=refused.code)
        log.warning(f"broker refused {refused.kind} of {refused.trajectory_id!r}"
                    + (f" turn {refused.turn}" if refused.turn is not None else "")
                    + f": {refused.code}: {refused.message}",
                    extra={"trajectory_id": refused.trajectory_id, "kind": refused.kind, "turn": refused.turn,
                           "code": refused.code, "reason": refused.message})

    # -- time (the loop; `ping` is shared) --------------------------------------------
    def tick(self, now: float) -> None:
        """Report frames without a reply for `reply_timeout` (reported, not
        resent: a live connection loses nothing, and pongs find lost
        replies), once a `reply_timeout`; and a broker silent for the
        heartbeat timeout (`broker_up` 0 until its next reply)."""
        window, heartbeat = self.window, self.heartbeat
        if now >= self._next_overdue_report:
            overdue = window.overdue(now)
            if overdue:
                self._next_overdue_report = now + window.reply_timeout
                log.warning(f"{overdue} frames without a reply for {window.reply_timeout} s; waiting "
                            f"(the broker {'answers pings' if heartbeat.alive else 'is silent'})",
                            extra={"frames": overdue})
        if heartbeat.lost(now):
            self.metrics.broker_up.set(0)
            log.warning(f"broker {self.endpoint} silent for {heartbeat.timeout} s",
                        extra={"endpoint": self.endpoint, "seconds": heartbeat.timeout})

    def ping_due(self, now: float) -> bool:
        return self.heartbeat.ping_due(now)

    def ping(self) -> list:
        """*Shared* (it takes the next seq). A ping to send now; call `pinged` once it is transmitted."""
        self._ping_seq = seq = self.next_seq
        self.next_seq = seq + 1
        return encode(PRODUCER_TO_BROKER, "ping", {"seq": seq})

    def query(self, kind: str, fields: dict[str, Any]) -> tuple[int, list]:
        """*Shared* (it takes the next seq). A `list_open` or `read_open` to
        send now: its seq, whose answer `received` puts in `answers`, and its
        frames (kept in `queries`, to send again after a reconnect)."""
        seq = self.next_seq
        self.next_seq = seq + 1
        frames = self.queries[seq] = encode(PRODUCER_TO_BROKER, kind, {"seq": seq, **fields})
        return seq, frames

    def pinged(self, now: float) -> None:
        """The ping `ping` built went out at `now`: its pong will show what was answered before it."""
        self.heartbeat.pinged(now)
        self.pings[self._ping_seq] = now
        if len(self.pings) > PINGS_KEPT:
            del self.pings[min(self.pings)]

    def refresh_gauges(self) -> None:
        metrics = self.metrics
        metrics.in_flight.set(self.window.in_flight)
        metrics.held.set(self.in_memory)
        if self.spool is not None:
            metrics.spool_bytes.set(self.spool.nbytes)
            metrics.backlog.set(self.spool.backlog)
