"""The producer's resend window and heartbeat as units: no sockets, no
clocks. Replies are real broker messages (encoded, then decoded)."""
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.common.codec import decode, encode
from rollstream.common.messages import BROKER_TO_PRODUCER
from rollstream.producer.errors import Refused
from rollstream.producer.window import Heartbeat, HeldFrame, Receipt, ResendWindow, WindowFull, batch_runs

TIMEOUT = 10.0


def frame(seq, tid="t", kind="turn", turn=None):
    return HeldFrame(seq, kind, tid, [b"frame-%d" % seq], turn if turn is not None or kind != "turn" else seq - 1)


def ack(seq, tid="t", applied=True, **extra):
    return decode(encode(BROKER_TO_PRODUCER, "ack", {"seq": seq, "trajectory_id": tid, "applied": applied, **extra}),
                  BROKER_TO_PRODUCER)


def nack(seq, code, message="no", **extra):
    return decode(encode(BROKER_TO_PRODUCER, "nack", {"seq": seq, "code": code, "message": message, **extra}),
                  BROKER_TO_PRODUCER)


def window(limit=8, **options):
    return ResendWindow(limit, reply_timeout=TIMEOUT, **options)


def send_ready(w, now=0.0):
    """Transmit everything `ready` offers; the seqs sent, in order."""
    sent = []
    for item in w.due(now):
        w.sent(item.seq, now)
        sent.append(item.seq)
    return sent


# -- holding and sending ----------------------------------------------------------
def test_push_beyond_the_limit_is_refused_and_nothing_is_dropped():
    w = window(limit=2)
    w.push(frame(1))
    w.push(frame(2, tid="u", turn=0))
    assert w.full and len(w) == 2
    with pytest.raises(WindowFull):
        w.push(frame(3, tid="v", turn=0))
    assert len(w) == 2 and 3 not in w


def test_seqs_must_increase():
    w = window()
    w.push(frame(5))
    with pytest.raises(ValueError, match="seq must increase: got 5 after 5"):
        w.push(frame(5, tid="u", turn=0))


def test_ready_hands_out_frames_in_seq_order_once():
    w = window()
    for seq, tid in ((1, "a"), (2, "b"), (3, "c")):
        w.push(frame(seq, tid=tid, turn=0))
    assert send_ready(w) == [1, 2, 3]
    assert w.in_flight == 3
    assert send_ready(w) == []


def test_a_frame_the_socket_did_not_take_is_offered_again():
    w = window()
    w.push(frame(1))
    w.push(frame(2))
    first = w.due(0.0)
    w.sent(first[0].seq, 0.0)  # the socket refused the second: stop there
    assert [item.seq for item in w.due(0.0)] == [2]


def test_sending_a_frame_twice_without_a_resend_is_a_bug():
    w = window()
    w.push(frame(1))
    w.sent(1, 0.0)
    with pytest.raises(ValueError, match="not waiting to be sent"):
        w.sent(1, 0.0)


# -- replies ------------------------------------------------------------------------
def test_ack_settles_with_a_receipt():
    w = window()
    w.push(frame(1, turn=0))
    send_ready(w)
    settled = w.on_reply(ack(1, turn=0), 1.0)
    assert settled.outcome == Receipt("turn", "t", 0, 1, True, False, None)
    assert len(w) == 0 and w.in_flight == 0


def test_not_applied_outcomes_are_receipts_not_refusals():
    w = window()
    w.push(frame(1, turn=3))
    w.push(frame(2, tid="u", turn=0))
    send_ready(w)
    gap = w.on_reply(ack(1, applied=False, turn=3, reason="replay_gap"), 1.0).outcome
    dup = w.on_reply(ack(2, tid="u", turn=0, duplicate=True), 1.0).outcome
    assert (gap.applied, gap.reason) == (False, "replay_gap")
    assert (dup.applied, dup.duplicate) == (True, True)


def test_replies_that_match_nothing_sent_are_ignored():
    w = window()
    w.push(frame(1))
    w.push(frame(2, tid="u", turn=0))
    w.sent(1, 0.0)  # seq 2 never transmitted
    assert w.on_reply(ack(99), 1.0) is None  # unknown seq
    assert w.on_reply(ack(2, tid="u"), 1.0) is None  # never sent
    assert w.on_reply(ack(1, tid="other"), 1.0) is None  # another trajectory's seq
    assert w.ignored == 3 and len(w) == 2
    assert w.on_reply(ack(1), 1.0) is not None


def acks(*ranges, outcomes=None):
    fields = {"ranges": [list(r) for r in ranges]}
    if outcomes is not None:
        fields["outcomes"] = outcomes
    return decode(encode(BROKER_TO_PRODUCER, "acks", fields), BROKER_TO_PRODUCER)


def test_batched_acks_settle_whole_ranges_with_the_outcomes_that_differ():
    w = window()
    for seq, tid, turn in ((1, "a", 0), (2, "a", 1), (3, "b", 0), (4, "c", 0), (5, "c", 1)):
        w.push(frame(seq, tid=tid, turn=turn))
    send_ready(w)
    settled = w.on_acks(acks((1, 3), (5, 5), outcomes=[{"seq": 2, "applied": False, "reason": "after_terminal"},
                                                       {"seq": 5, "applied": True, "duplicate": True}]))
    by_seq = {s.item.seq: s.outcome for s in settled}
    assert sorted(by_seq) == [1, 2, 3, 5] and len(settled) == 4
    assert by_seq[1] == Receipt("turn", "a", 0, 1, True, False, None)
    assert by_seq[2] == Receipt("turn", "a", 1, 2, False, False, "after_terminal")
    assert by_seq[3] == Receipt("turn", "b", 0, 3, True, False, None)
    assert (by_seq[5].duplicate, by_seq[5].applied) == (True, True)
    assert [item.seq for item in w.items()] == [4] and w.ignored == 0


def test_batched_acks_for_frames_not_sent_or_settled_are_ignored():
    w = window()
    w.push(frame(1, turn=0))
    w.push(frame(2, tid="u", turn=0))
    w.sent(1, 0.0)  # seq 2 never transmitted
    assert [s.item.seq for s in w.on_acks(acks((1, 2)))] == [1]
    assert w.on_acks(acks((1, 1))) == []  # already settled
    assert w.ignored == 2 and [item.seq for item in w.items()] == [2]


def test_a_batched_ack_range_wider_than_the_window_walks_only_what_is_held():
    w = window()
    w.push(frame(7, turn=0))
    send_ready(w)
    settled = w.on_acks(acks((-(2**62), 2**62)))  # a loop over the range itself would never end
    assert [s.item.seq for s in settled] == [7] and len(w) == 0
    assert w.ignored == 2**63


def test_an_end_held_behind_its_turns_goes_once_batched_acks_settle_them():
    w = window()
    w.push(frame(1, turn=0))
    w.push(frame(2, turn=1))
    w.push(frame(3, kind="end"))
    w.push(frame(4, tid="u", turn=0))
    assert send_ready(w) == [1, 2, 4]  # the end waits; the other trajectory does not
    w.on_acks(acks((1, 1)))
    assert send_ready(w) == []  # turn 1 still unsettled
    w.on_acks(acks((2, 2), (4, 4)))
    assert send_ready(w) == [3]


def test_a_duplicate_reply_settles_nothing_twice():
    w = window()
    w.push(frame(1))
    send_ready(w)
    assert w.on_reply(ack(1), 1.0) is not None
    assert w.on_reply(ack(1), 1.0) is None
    assert w.on_reply(nack(1, "conflict"), 1.0) is None
    assert w.ignored == 2


def test_replies_arriving_out_of_order_settle_the_right_frames():
    w = window()
    for seq, tid in ((1, "a"), (2, "b"), (3, "c")):
        w.push(frame(seq, tid=tid, turn=0))
    send_ready(w)
    assert w.on_reply(ack(3, tid="c"), 1.0).item.trajectory_id == "c"
    assert w.on_reply(ack(1, tid="a"), 1.0).item.trajectory_id == "a"
    assert [item.seq for item in w.items()] == [2]


def test_a_refusal_carries_the_code_message_and_expected_turn():
    w = window()
    w.push(frame(1, kind="end", tid="x"))
    send_ready(w)
    refused = w.on_reply(nack(1, "unknown_trajectory", "never seen"), 1.0).outcome
    assert isinstance(refused, Refused)
    assert (refused.code, refused.message) == ("unknown_trajectory", "never seen")
    assert (refused.kind, refused.trajectory_id) == ("end", "x")
    assert "unknown_trajectory" in str(refused) and "'x'" in str(refused)


def test_out_of_order_with_nothing_earlier_pending_is_a_refusal():
    w = window()
    w.push(frame(1, turn=2))
    send_ready(w)
    refused = w.on_reply(nack(1, "out_of_order", expected=0), 1.0).outcome
    assert (refused.code, refused.expected, refused.turn) == ("out_of_order", 0, 2)


def test_out_of_order_behind_a_lost_turn_resends_both_in_order():
    """Turn 0 died with the old connection, turn 1 got through and was
    refused out_of_order: both go again, turn 0 first, and turn 1's later
    ack settles it as applied."""
    w = window()
    w.push(frame(1, turn=0))
    w.push(frame(2, turn=1))
    send_ready(w)
    assert w.on_reply(nack(2, "out_of_order", expected=0), 1.0) is None
    assert send_ready(w, 1.0) == [1, 2]
    assert w.resends == 2
    assert w.on_reply(ack(1, turn=0), 2.0).outcome.applied
    assert w.on_reply(ack(2, turn=1), 2.0).outcome.applied


def test_unavailable_waits_retry_delay_then_resends():
    w = window(retry_delay=0.5)
    w.push(frame(1))
    w.push(frame(2))
    send_ready(w, 0.0)
    assert w.on_reply(nack(1, "unavailable"), 1.0) is None
    assert w.due(1.2) == []  # backing off; turn 1 of the same trajectory is in flight already
    assert send_ready(w, 1.5) == [1]
    assert w.on_reply(ack(1), 2.0) is not None


def test_a_turn_behind_a_backing_off_turn_waits_for_it():
    w = window(retry_delay=0.5)
    w.push(frame(1))
    send_ready(w, 0.0)
    w.on_reply(nack(1, "unavailable"), 1.0)
    w.push(frame(2))
    w.push(frame(3, tid="other", turn=0))
    assert [item.seq for item in w.due(1.1)] == [3]  # other trajectories are not held up
    assert [item.seq for item in w.due(1.5)] == [1, 2, 3]


def test_an_ack_for_an_earlier_transmission_settles_a_frame_due_again():
    w = window()
    w.push(frame(1))
    send_ready(w)
    w.reconnected()
    assert w.on_reply(ack(1), 1.0) is not None
    assert w.due(1.0) == [] and len(w) == 0


# -- resending ----------------------------------------------------------------------------
def test_reconnect_resends_everything_unsettled_in_seq_order():
    w = window()
    for seq, tid in ((1, "a"), (2, "b"), (3, "a")):
        w.push(frame(seq, tid=tid, turn=0 if seq < 3 else 1))
    send_ready(w)
    w.on_reply(ack(2, tid="b"), 0.5)
    w.push(frame(4, tid="c", turn=0))  # never sent yet
    assert w.reconnected() == 2
    assert send_ready(w, 1.0) == [1, 3, 4]
    assert w.resends == 2


def test_slow_replies_are_reported_and_never_resent_on_a_live_connection():
    w = window()
    w.push(frame(1, tid="a", turn=0))
    send_ready(w, 0.0)
    w.push(frame(2, tid="b", turn=0))
    send_ready(w, 5.0)
    assert w.overdue(TIMEOUT - 0.001) == 0
    assert w.overdue(TIMEOUT) == 1 and w.overdue(TIMEOUT + 5.0) == 2
    assert send_ready(w, 10 * TIMEOUT) == [] and w.resends == 0


def test_frames_sent_before_an_answered_ping_lost_their_replies_and_go_again_in_order():
    w = window()
    for seq, tid in ((1, "a"), (2, "b")):
        w.push(frame(seq, tid=tid, turn=0))
    send_ready(w, 1.0)
    w.push(frame(3, tid="c", turn=0))
    send_ready(w, 3.0)
    w.on_reply(ack(2, "b"), 3.5)
    assert w.answered_until(2.0) == 1  # the ping went at 2.0: frame 1's reply is lost, frame 3 came after it
    assert send_ready(w, 4.0) == [1]
    assert w.answered_until(2.0) == 0  # just resent: after that ping


# -- ordering within a trajectory --------------------------------------------------------
def test_turns_pipeline_but_end_waits_until_every_turn_settled():
    w = window()
    w.push(frame(1, turn=0))
    w.push(frame(2, turn=1))
    w.push(frame(3, kind="end"))
    w.push(frame(4, tid="u", turn=0))
    assert send_ready(w) == [1, 2, 4]
    w.on_reply(ack(1, turn=0), 1.0)
    assert send_ready(w, 1.0) == []
    w.on_reply(ack(2, turn=1), 1.0)
    assert send_ready(w, 1.0) == [3]


def test_nothing_of_a_trajectory_overtakes_its_abort():
    w = window()
    w.push(frame(1, turn=0))
    w.push(frame(2, kind="abort"))
    w.push(frame(3, turn=0))  # the retry after the abort
    assert send_ready(w) == [1]
    w.on_reply(ack(1, turn=0), 1.0)
    assert send_ready(w, 1.0) == [2]
    w.on_reply(ack(2), 1.0)
    assert send_ready(w, 1.0) == [3]


def test_an_end_is_sent_even_after_a_refused_turn():
    """The broker decides what an end after a refused turn means."""
    w = window()
    w.push(frame(1, turn=0))
    w.push(frame(2, kind="end"))
    send_ready(w)
    w.on_reply(nack(1, "mask_invalid"), 1.0)
    assert send_ready(w, 1.0) == [2]


def test_a_smaller_limit_stops_pushes_but_keeps_what_is_held():
    w = window(limit=4)
    for seq in (1, 2, 3):
        w.push(frame(seq))
    w.set_limit(2)
    assert w.full and len(w) == 3
    with pytest.raises(ValueError):
        w.set_limit(0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        ResendWindow(0, reply_timeout=1.0)
    with pytest.raises(ValueError, match="reply_timeout"):
        ResendWindow(4, reply_timeout=0)


# -- a model of an unreliable connection -------------------------------------------------------
class Broker:
    """A strict, idempotent broker model: turns in order by index, a
    duplicate index acked again, an index ahead refused out_of_order."""

    def __init__(self):
        self.applied = {}  # trajectory -> turn indices applied, in order
        self.ended = {}  # trajectory -> turns applied when the end arrived

    def handle(self, item):
        tid = item.trajectory_id
        turns = self.applied.setdefault(tid, [])
        if item.kind == "end":
            self.ended.setdefault(tid, len(turns))
            return ack(item.seq, tid)
        if tid in self.ended:
            return ack(item.seq, tid, applied=False, turn=item.turn, reason="after_terminal")
        if item.turn < len(turns):
            return ack(item.seq, tid, turn=item.turn, duplicate=True)
        if item.turn > len(turns):
            return nack(item.seq, "out_of_order", expected=len(turns))
        turns.append(item.turn)
        return ack(item.seq, tid, turn=item.turn)


class Ping(NamedTuple):
    """A heartbeat in the model's queues: the broker answers it in order."""

    sent_at: float


OPS = st.sampled_from(["push"] * 3 + ["transmit", "deliver", "reply"] * 2
                      + ["reply_late", "cut", "notice", "lose_reply", "ping"])


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(ops=st.lists(OPS, max_size=80), seed=st.integers(0, 2**16), limit=st.integers(1, 6))
def test_lossy_connection_loses_nothing_duplicates_nothing_and_ends_whole(ops, seed, limit):
    """Random interleavings of pushes, transmissions, broker processing and
    replies (some out of order), with the faults a DEALER sees: a cut
    connection loses the frames it carried while later ones, queued, get
    through on the new one before the reconnect is noticed; a reply is lost
    (found by a ping answered after it). Then a reliable drain. Every frame is settled
    exactly once and never refused, each trajectory has every turn applied
    exactly once in order, and its end arrived after all its turns."""
    import random

    rnd = random.Random(seed)
    w = ResendWindow(limit, reply_timeout=TIMEOUT)
    broker, to_broker, to_producer = Broker(), [], []
    plan = {tid: 2 for tid in "ab"}  # turns per trajectory, then an end
    pushed = {tid: 0 for tid in plan}
    settled, seq, now, cut = {}, 0, 0.0, False

    def push():
        nonlocal seq
        open_ = [tid for tid in plan if pushed[tid] <= plan[tid]]
        if not open_ or w.full:
            return
        tid = rnd.choice(open_)
        seq += 1
        kind = "end" if pushed[tid] == plan[tid] else "turn"
        w.push(HeldFrame(seq, kind, tid, [b""], pushed[tid] if kind == "turn" else None))
        pushed[tid] += 1

    def transmit():
        for item in w.due(now):
            w.sent(item.seq, now)
            to_broker.append(HeldFrame(item.seq, item.kind, item.trajectory_id, item.frames, item.turn))

    def deliver(count):
        for _ in range(min(count, len(to_broker))):
            item = to_broker.pop(0)
            to_producer.append(item if isinstance(item, Ping) else broker.handle(item))  # a ping comes back a pong

    def reply(index=0):
        if to_producer and isinstance(to_producer[index], Ping):
            w.answered_until(to_producer.pop(index).sent_at)
        elif to_producer:
            done = w.on_reply(to_producer.pop(index), now)
            if done is not None:
                assert not isinstance(done.outcome, Refused), done.outcome
                assert done.item.seq not in settled
                settled[done.item.seq] = done.outcome

    for op in ops:
        now += 1.0
        if op == "push":
            push()
        elif op == "transmit":
            transmit()
        elif op == "deliver":
            deliver(rnd.randint(1, 3))
        elif op == "reply":
            reply()
        elif op == "reply_late":
            reply(len(to_producer) - 1 if to_producer else 0)
        elif op == "cut":  # the old connection's frames and replies are lost; queued ones survive
            del to_broker[: rnd.randint(1, max(1, len(to_broker)))]
            to_producer.clear()
            cut = True
        elif op == "notice" and cut:
            w.reconnected()
            cut = False
        elif op == "lose_reply" and to_producer:
            to_producer.pop(rnd.randrange(len(to_producer)))
        elif op == "ping":
            to_broker.append(Ping(now))
    for _ in range(200):  # a reliable connection from here on
        if cut:
            w.reconnected()
            cut = False
        now += 1.0
        push()
        transmit()
        to_broker.append(Ping(now + 0.5))
        deliver(len(to_broker))
        while to_producer:
            reply()
        if not len(w) and all(pushed[tid] > plan[tid] for tid in plan):
            break
    assert len(w) == 0
    assert sorted(settled) == list(range(1, seq + 1))
    for tid, turns in plan.items():
        assert broker.applied[tid] == list(range(turns))
        assert broker.ended[tid] == turns


# -- heartbeat -----------------------------------------------------------------------------------
def test_heartbeat_pings_each_interval_and_reports_loss_and_return_once():
    beat = Heartbeat(1.0, 3.0, now=100.0)
    assert beat.ping_due(100.0)
    beat.pinged(100.0)
    assert not beat.ping_due(100.5) and beat.ping_due(101.0)
    assert not beat.lost(102.9)
    assert beat.lost(103.0) and not beat.alive
    assert not beat.lost(110.0)  # reported once
    assert beat.heard(111.0) and beat.alive
    assert not beat.heard(111.5)
    assert not beat.lost(114.4) and beat.lost(114.5)


def test_heartbeat_timeout_must_exceed_the_interval():
    with pytest.raises(ValueError, match="interval < timeout"):
        Heartbeat(2.0, 2.0, now=0.0)


# -- batching what goes out together -----------------------------------------------
def sized(seq, body_bytes):
    """A frame with a 10-byte header and `body_bytes` after it."""
    return HeldFrame(seq, "turn", "t", [b"h" * 10, b"b" * body_bytes], seq - 1)


def test_batch_runs_group_consecutive_small_frames_and_send_a_large_one_alone():
    items = [sized(1, 100), sized(2, 100), sized(3, 5000), sized(4, 100), HeldFrame(5, "end", "t", [b"h" * 10])]
    runs = batch_runs(items, max_items=8, max_bytes=1 << 20, item_max_bytes=1000)
    assert [[item.seq for item in run] for run in runs] == [[1, 2], [3], [4, 5]]


def test_batch_runs_stop_at_max_items_and_at_max_bytes_with_room_for_the_entries():
    items = [sized(seq, 100) for seq in range(1, 8)]
    assert [len(run) for run in batch_runs(items, max_items=3, max_bytes=1 << 20, item_max_bytes=1000)] == [3, 3, 1]
    # 110 bytes of frames and 32 of entries a message: 142; three fit in 16 + 426 bytes, a fourth does not
    assert [len(run) for run in batch_runs(items, max_items=99, max_bytes=442, item_max_bytes=1000)] == [3, 3, 1]
    assert [len(run) for run in batch_runs(items, max_items=99, max_bytes=441, item_max_bytes=1000)] == [2, 2, 2, 1]


@given(st.lists(st.integers(0, 3000), max_size=40), st.integers(1, 6), st.integers(200, 5000))
@settings(max_examples=100, deadline=None)
def test_batch_runs_keep_every_frame_once_in_order_within_the_bounds(sizes, max_items, max_bytes):
    items = [sized(seq, size) for seq, size in enumerate(sizes, 1)]
    runs = batch_runs(items, max_items=max_items, max_bytes=max_bytes, item_max_bytes=1000)
    assert [item for run in runs for item in run] == items
    for run in runs:
        if len(run) > 1:
            assert len(run) <= max_items and all(len(item.frames[1]) <= 1000 for item in run)
            assert 16 + sum(sum(map(len, item.frames)) + 16 * len(item.frames) for item in run) <= max_bytes
