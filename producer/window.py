"""The producer's resend window and heartbeat (docs/protocol.md §3), sans-I/O.

Plain synchronous objects: no sockets, no clocks, no files. Their caller
(`session.ProducerSession`) passes the current time in, transmits what `due()` hands it, and feeds
every decoded broker reply back. The window then decides what is settled,
what must go out again and in which order, so reconnects, reply timeouts,
lost, duplicate and reordered replies are all testable without a broker.

Ordering rules, on top of "keep every frame until acked or nacked":
- frames go out, and out again, in `seq` order;
- turns of one trajectory may be pipelined, but an `end` or `abort` waits
  until every earlier frame of its trajectory is settled, and nothing of that
  trajectory goes out until the `end`/`abort` is settled. Otherwise a turn
  lost on a dying connection could be overtaken by the `end` (the broker would
  end the trajectory short) or, resent, restart a trajectory an `abort`
  discarded.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from rollstream.common.codec import BATCH_ENVELOPE_BYTES, batched_size, decode_header
from rollstream.common.errors import InternalError, InvalidInput, RollstreamError

from .errors import Refused

TURN, END, ABORT, REWARD = "turn", "end", "abort", "reward"
KINDS = (TURN, END, ABORT, REWARD)


@dataclass(eq=False, slots=True)
class HeldFrame:
    """One frame the producer keeps until the broker settles it: the encoded
    wire frames plus the header fields the window orders and matches by."""

    seq: int
    kind: str
    trajectory_id: str
    frames: list
    turn: int | None = None
    # bookkeeping of the window
    attempts: int = 0  # transmissions so far
    sent_at: float = 0.0  # time of the last transmission (read only while it is not unsent)
    unsent: bool = True  # must (re)transmit
    not_before: float = 0.0  # earliest retransmission after `unavailable`
    parked: bool = False  # unsent, and held back by its trajectory's order (see `ResendWindow._may_go`)

    @classmethod
    def from_frames(cls, frames: list) -> "HeldFrame":
        """Read seq, kind, trajectory and turn from an encoded message's header."""
        header = decode_header(frames[0])
        kind = header.get("type")
        if kind not in KINDS:
            raise InvalidInput(f"the resend window holds {KINDS} messages, got type {kind!r}")
        return cls(header["seq"], kind, header["trajectory_id"], list(frames), header.get("turn"))


class Receipt(NamedTuple):
    """The broker's durable `ack` of one frame. `applied: false` with a
    `reason` (`after_terminal`, `replay_gap`, `unknown_trajectory`) is an
    outcome to report, not an error. (A named tuple: one is made per
    frame, and a frozen dataclass costs three times as much to make.)"""

    kind: str
    trajectory_id: str
    turn: int | None
    seq: int
    applied: bool
    duplicate: bool = False
    reason: str | None = None


class Settled(NamedTuple):
    """A frame leaves the window: its receipt, or the refusal to raise."""

    item: HeldFrame
    outcome: Receipt | Refused


def batch_runs(items: list[HeldFrame], *, max_items: int, max_bytes: int, item_max_bytes: int) -> list[list[HeldFrame]]:
    """`items` (in transmission order) cut into runs to send as one message
    each: consecutive frames whose bytes after the header are at most
    `item_max_bytes` go together, up to `max_items` and `max_bytes` a run
    (docs/protocol.md §3, batched frames); a larger frame goes alone, as it is.
    Batching copies what it carries, so it is for the frames that ZeroMQ
    would copy anyway."""
    runs: list[list[HeldFrame]] = []
    run: list[HeldFrame] = []
    run_bytes = 0
    for item in items:
        if sum(map(len, item.frames[1:])) > item_max_bytes:
            if run:
                runs.append(run)
                run, run_bytes = [], 0
            runs.append([item])
            continue
        size = batched_size(item.frames)
        if run and (len(run) == max_items or BATCH_ENVELOPE_BYTES + run_bytes + size > max_bytes):
            runs.append(run)
            run, run_bytes = [], 0
        run.append(item)
        run_bytes += size
    if run:
        runs.append(run)
    return runs


class WindowFull(RollstreamError, RuntimeError):
    """The window holds its limit of unsettled frames: push again once one settles."""

    code = "window_full"


class ResendWindow:
    """At most `limit` unsettled frames, kept until the broker settles them.

    Unsent frames that may go now wait in `_unsent` (seq order); a frame its
    trajectory's order holds back (an `end` behind unsettled turns, anything
    behind an unsettled `end`/`abort`) is parked instead and joins `_unsent`
    when a settlement frees it, so handing out frames costs what goes out,
    not what waits."""

    def __init__(self, limit: int, *, reply_timeout: float, retry_delay: float = 0.5):
        if limit < 1:
            raise InvalidInput(f"window must be at least 1 frame, got {limit}")
        if reply_timeout <= 0 or retry_delay < 0:
            raise InvalidInput(f"reply_timeout must be > 0 and retry_delay >= 0, got {reply_timeout} and {retry_delay}")
        self.limit = limit
        self.reply_timeout = reply_timeout
        self.retry_delay = retry_delay
        self._items: dict[int, HeldFrame] = {}  # by seq, in seq order
        self._unsent: list[int] = []  # sorted seqs waiting for (re)transmission, not parked
        self._parked = 0  # how many items are parked
        self._trajectories: dict[str, list[int]] = {}  # unsettled seqs of each trajectory, in order
        self._last_seq: int | None = None
        self.resends = 0  # retransmissions
        self.ignored = 0  # replies that matched nothing this window sent

    # -- state ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, seq: int) -> bool:
        return seq in self._items

    @property
    def full(self) -> bool:
        return len(self._items) >= self.limit

    @property
    def in_flight(self) -> int:
        """Frames transmitted and not settled (not counting those due again)."""
        return len(self._items) - len(self._unsent) - self._parked

    def items(self) -> list[HeldFrame]:
        return list(self._items.values())

    # -- input ----------------------------------------------------------------
    def push(self, item: HeldFrame) -> None:
        """Hold a new frame; seqs must increase. Raises `WindowFull`."""
        if self.full:
            raise WindowFull(f"window is full: {len(self._items)} of {self.limit} frames unsettled")
        if self._last_seq is not None and item.seq <= self._last_seq:
            raise InvalidInput(f"seq must increase: got {item.seq} after {self._last_seq}")
        if item.kind not in KINDS:
            raise InvalidInput(f"kind must be one of {KINDS}, got {item.kind!r}")
        self._last_seq = item.seq
        item.attempts, item.sent_at, item.unsent, item.not_before = 0, 0.0, True, 0.0
        self._items[item.seq] = item
        self._trajectories.setdefault(item.trajectory_id, []).append(item.seq)
        if self._may_go(item):
            item.parked = False
            self._unsent.append(item.seq)  # the largest seq so far
        else:
            item.parked = True
            self._parked += 1

    def due(self, now: float) -> list[HeldFrame]:
        """Frames to transmit now, in the order to transmit them. Call `sent`
        for each one actually transmitted, in this order, and stop at the
        first that cannot be (later ones may depend on it)."""
        out: list[HeldFrame] = []
        waiting: set[str] = set()  # trajectories with a turn backing off: later turns wait behind it
        items = self._items
        for seq in self._unsent:
            item = items[seq]
            if item.not_before > now:
                waiting.add(item.trajectory_id)
            elif not waiting or item.trajectory_id not in waiting:
                out.append(item)
        return out

    def _may_go(self, item: HeldFrame) -> bool:
        """Turns pipeline behind earlier turns of their trajectory; an
        `end`/`abort`, and anything after one, waits until every earlier
        frame of the trajectory is settled."""
        items = self._items
        for seq in self._trajectories[item.trajectory_id]:
            if seq == item.seq:
                return True
            if item.kind != TURN or items[seq].kind != TURN:
                return False
        raise InternalError(f"seq {item.seq} is missing from its trajectory's list of unsettled seqs")

    def sent(self, seq: int, now: float) -> None:
        """`seq` was handed to the socket at `now`."""
        item = self._items[seq]
        if not item.unsent or item.parked:
            raise InvalidInput(f"seq {seq} is not waiting to be sent")
        self._drop_unsent(seq)
        item.unsent = False
        item.sent_at = now
        item.attempts += 1
        if item.attempts > 1:
            self.resends += 1

    def on_reply(self, reply: Any, now: float) -> Settled | None:
        """Apply a decoded `ack` or `nack` (a `Message`). Returns the settled
        frame, or None when nothing settled: a reply to a seq this window did
        not send (unknown, already settled, never transmitted, another
        trajectory), or a transient refusal after which the frame goes again."""
        seq = reply.get("seq")
        item = self._items.get(seq) if type(seq) is int else None
        if item is None or item.attempts == 0 or reply.get("trajectory_id", item.trajectory_id) != item.trajectory_id:
            self.ignored += 1
            return None
        if reply.type == "ack":
            receipt = Receipt(item.kind, item.trajectory_id, item.turn, seq, reply["applied"],
                              reply.get("duplicate", False), reply.get("reason"))
            return self._settle(item, receipt)
        if reply.type != "nack":
            raise InvalidInput(f"the window takes ack and nack replies, got {reply.type!r}")
        code = reply["code"]
        if code == "unavailable":  # the broker cannot persist now: same frame, later
            item.not_before = now + self.retry_delay
            self._mark_unsent(item)
            return None
        if code == "out_of_order" and self._retry_out_of_order(item):
            return None
        refused = Refused(code, reply["message"], kind=item.kind, trajectory_id=item.trajectory_id, turn=item.turn,
                          seq=seq, expected=reply.get("expected"))
        return self._settle(item, refused)

    def on_acks(self, reply: Any) -> list[Settled]:
        """Apply a decoded batched `acks` (docs/protocol.md §3): every seq in its
        ranges is acked `applied`, except those `outcomes` lists with their
        own outcome. Seqs this window did not send are ignored and counted."""
        items = self._items
        differ = {outcome["seq"]: outcome for outcome in reply.get("outcomes", ())}
        settled = []
        for first, last in reply["ranges"]:
            if last - first >= len(items):  # a range wider than the window: walk what is held, not the range
                seqs: Sequence[int] = [seq for seq in items if first <= seq <= last]
                self.ignored += last - first + 1 - len(seqs)
            else:
                seqs = range(first, last + 1)
            for seq in seqs:
                item = items.get(seq)
                if item is None or item.attempts == 0:
                    self.ignored += 1
                    continue
                outcome = differ.get(seq)
                if outcome is None:
                    receipt = Receipt(item.kind, item.trajectory_id, item.turn, seq, True)
                else:
                    receipt = Receipt(item.kind, item.trajectory_id, item.turn, seq, outcome["applied"],
                                      outcome.get("duplicate", False), outcome.get("reason"))
                settled.append(self._settle(item, receipt))
        return settled

    def _retry_out_of_order(self, item: HeldFrame) -> bool:
        """An earlier frame of the trajectory is still unsettled, so it was
        lost on the way (the broker never saw it): send it and this one again,
        in order. With no earlier frame pending the refusal stands."""
        earlier = [self._items[seq] for seq in self._trajectories[item.trajectory_id] if seq < item.seq]
        if not earlier:
            return False
        for frame in (*earlier, item):
            self._mark_unsent(frame)
        return True

    def reconnected(self) -> int:
        """The connection was re-established: whatever it carried may be lost,
        so every transmitted, unsettled frame goes again (in seq order)."""
        return self._resend_all()

    def answered_until(self, sent_at: float) -> int:
        """The broker answered a ping transmitted at `sent_at`. It reads a
        connection in order and answers in order, so it has answered every
        frame transmitted before that ping: one still unsettled lost its
        reply on the way (the broker could not send it), and goes again, in
        order. Slow replies are never a reason to resend on a live
        connection: they would only queue duplicates behind the originals.
        Returns how many go again."""
        count = 0
        for item in self._items.values():
            if not item.unsent and item.sent_at < sent_at:
                self._mark_unsent(item)
                count += 1
        return count

    def overdue(self, now: float) -> int:
        """Transmitted frames without a reply for `reply_timeout` (reported,
        not resent: heartbeats tell a slow broker from a lost reply)."""
        return sum(1 for item in self._items.values() if not item.unsent and item.sent_at + self.reply_timeout <= now)

    def set_limit(self, limit: int) -> None:
        """A smaller window only stops new pushes; nothing held is dropped."""
        if limit < 1:
            raise InvalidInput(f"window must be at least 1 frame, got {limit}")
        self.limit = limit

    # -- internals ------------------------------------------------------------
    def _resend_all(self) -> int:
        count = 0
        for item in self._items.values():
            if not item.unsent:
                self._mark_unsent(item)
                count += 1
        return count

    def _mark_unsent(self, item: HeldFrame) -> None:
        """Due again. A frame that was transmitted was free to go then, and
        only settlements change that, so it never parks."""
        if not item.unsent:
            item.unsent = True
            bisect.insort(self._unsent, item.seq)

    def _drop_unsent(self, seq: int) -> None:
        index = bisect.bisect_left(self._unsent, seq)
        if index < len(self._unsent) and self._unsent[index] == seq:
            del self._unsent[index]

    def _settle(self, item: HeldFrame, outcome: Receipt | Refused) -> Settled:
        del self._items[item.seq]
        if item.unsent:
            self._drop_unsent(item.seq)
        seqs = self._trajectories[item.trajectory_id]
        seqs.remove(item.seq)
        if not seqs:
            del self._trajectories[item.trajectory_id]
        elif self._parked:
            self._unpark(seqs)
        return Settled(item, outcome)

    def _unpark(self, seqs: list[int]) -> None:
        """A settlement may free the trajectory's parked frames (in order)."""
        for seq in seqs:
            item = self._items[seq]
            if not item.parked:
                continue
            if not self._may_go(item):
                return  # later ones wait behind this one
            item.parked = False
            self._parked -= 1
            bisect.insort(self._unsent, seq)


class Heartbeat:
    """Application-level liveness: ping every `interval`; the broker counts
    as lost when nothing at all was heard from it for `timeout` (any reply
    counts, not only pongs). It is presumed alive at start."""

    def __init__(self, interval: float, timeout: float, now: float):
        if interval <= 0 or timeout <= interval:
            raise InvalidInput(f"need 0 < heartbeat interval < timeout, got {interval} and {timeout}")
        self.interval = interval
        self.timeout = timeout
        self.last_heard = now
        self.next_ping = now
        self.alive = True

    def heard(self, now: float) -> bool:
        """Something arrived from the broker. True when it was lost until now."""
        self.last_heard = now
        back, self.alive = not self.alive, True
        return back

    def ping_due(self, now: float) -> bool:
        return now >= self.next_ping

    def pinged(self, now: float) -> None:
        self.next_ping = now + self.interval

    def lost(self, now: float) -> bool:
        """True once, when the broker has been silent for `timeout`."""
        if self.alive and now - self.last_heard >= self.timeout:
            self.alive = False
            return True
        return False
