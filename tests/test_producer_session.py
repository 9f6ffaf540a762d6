"""The producer's session core as a unit: no sockets, no event loop, no
clock. Drafts are real encoded frames, replies real broker messages
(encoded, then decoded), and what the session transmits is decoded back."""
import json
import logging

import numpy as np
import pytest

from rollstream.common.checker import ContentDigest, Ledger, check, read_records, turn_record
from rollstream.common.codec import decode, encode, split_batch
from rollstream.common.errors import InvalidInput, InvalidState, Refused, RemoteProtocolError
from rollstream.common.messages import BROKER_TO_PRODUCER, PRODUCER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn
from rollstream.producer.errors import Halted
from rollstream.producer.metrics import ProducerMetrics
from rollstream.producer.session import (
    BATCH_UP_TO_BYTES,
    BEFORE_WELCOME_WINDOW,
    Draft,
    ProducerSession,
    TrajectoryDigests,
)
from rollstream.producer.spool import Spool
from rollstream.producer.window import Receipt

PROMPT = np.array([1, 2], dtype=np.int32)


def session(**options):
    options = {"metrics": ProducerMetrics(), "now": 0.0, "reply_timeout": 10.0, **options}
    return ProducerSession("p", "inproc://broker", **options)


def reply(kind, **fields):
    return decode(encode(BROKER_TO_PRODUCER, kind, fields), BROKER_TO_PRODUCER)


def welcome(**fields):
    return reply("welcome", **{"broker_id": "b", "max_message_bytes": 1 << 26, "window": 64, **fields})


def ack(seq, tid, **fields):
    return reply("ack", seq=seq, trajectory_id=tid, applied=True, **fields)


def a_turn(token=5):
    return Turn.build([token], [-0.5], supports=[[token, 6]])


class Handle:
    """What a trajectory handle gives the session: its id, its next turn, its
    digests, whether it halts, and drafts encoded as the real handles encode them."""

    def __init__(self, trajectory_id, halts=False):
        self.trajectory_id = trajectory_id
        self.next_turn = 0
        self.digests = TrajectoryDigests(PROMPT)
        self.halts, self.halted = halts, None

    def turn(self, turn=None):
        turn = turn or a_turn()

        def encode_at(index):
            return encode_turn(self.trajectory_id, index, turn, seq=None, prompt_tokens=PROMPT if index == 0 else None,
                               checked=False)
        return Draft("turn", self, self.next_turn, encode_at, (len(turn.tokens), 0), turn)

    def end(self, reward=1.0):
        def encode_at(turns):
            return encode(PRODUCER_TO_BROKER, "end", {"trajectory_id": self.trajectory_id, "reward": reward,
                                                      "turns": turns}, numbered=False)
        return Draft("end", self, self.next_turn, encode_at)

    def abort_draft(self, reason="", again=False):
        frames = encode(PRODUCER_TO_BROKER, "abort", {"trajectory_id": self.trajectory_id, "reason": reason,
                                                      **({"again": True} if again else {})}, numbered=False)
        return Draft("abort", self, self.next_turn, lambda _: frames)


def accept(s, *drafts, now=0.0):
    """Accept each draft (its future: a list the outcome lands in) and take them into the window."""
    futures = []
    for draft in drafts:
        futures.append([])
        s.accept(draft, futures[-1], now)
    s.fill_window()
    return futures


def transmit(s, now=0.0, refuse_after=None):
    """What `transmit` sends, each message as its `summary`, a batch as the list of what it carries."""
    sent = []

    def send(frames):
        if refuse_after is not None and len(sent) == refuse_after:
            return False
        message = decode(frames, PRODUCER_TO_BROKER, check_content=False)
        if message.type == "batch":
            sent.append([summary(decode(carried, PRODUCER_TO_BROKER)) for carried in split_batch(message)])
        else:
            sent.append(summary(message))
        return True
    s.transmit(now, send)
    return sent


def summary(message):
    """(type, seq, trajectory, turn), the last an end's count of turns."""
    return message.type, message.get("seq"), message.get("trajectory_id"), message.get("turn", message.get("turns"))


def settle(s, message, now=1.0):
    """Feed a reply; resolve what it settled into the futures (lists) it names."""
    resolved = s.settle(s.received(message, now), now)
    for future, outcome in resolved:
        future.append(outcome)
    return resolved


def gauge(s, name):
    return s.metrics.registry.get_sample_value(f"rollstream_producer_{name}")


# -- the handshake and what it negotiated --------------------------------------------------
def test_the_hello_asks_for_what_the_producer_was_configured_with():
    assert decode(session().hello(), PRODUCER_TO_BROKER).fields == {
        "producer_id": "p", "batch_acks": True, "batch_frames": True, "reads_branch": True, "lists_open": True}
    assert decode(session(batch_acks=False, batch_frames=False).hello(), PRODUCER_TO_BROKER).fields == {
        "producer_id": "p", "reads_branch": True, "lists_open": True}


def test_a_query_is_answered_by_its_seq_and_a_broker_that_lists_nothing_says_so():
    s = session()
    assert s.lists_open is None  # until the welcome
    s.received(welcome(lists_open=True), 0.0)
    assert s.lists_open is True
    seq, frames = s.query("list_open", {})
    assert decode(frames, PRODUCER_TO_BROKER).fields == {"seq": seq}
    s.received(decode(encode(BROKER_TO_PRODUCER, "open_list", {"seq": seq + 7, "trajectories": []}),
                      BROKER_TO_PRODUCER), 0.0)
    assert s.answers == {} and seq in s.queries  # another seq answers nothing of ours
    s.received(decode(encode(BROKER_TO_PRODUCER, "open_list", {"seq": seq, "trajectories": []}), BROKER_TO_PRODUCER), 0.0)
    assert s.answers[seq]["trajectories"] == [] and seq not in s.queries
    older = session()
    older.received(welcome(), 0.0)
    assert older.lists_open is False


def test_the_trainers_branch_is_read_as_branch_or_from_an_older_broker_as_lineage():
    current = session()
    current.received(welcome(reads_branch=True, branch=[1, 10]), 0.0)
    assert current.branch == (1, 10)
    older = session()
    older.received(welcome(lineage=[2, 12]), 0.0)  # a broker before `reads_branch` names it `lineage`
    assert older.branch == (2, 12)


def test_a_producer_of_a_job_names_it_and_fails_on_a_broker_that_does_not_keep_jobs_apart():
    eval_session = session(job="eval")
    assert decode(eval_session.hello(), PRODUCER_TO_BROKER)["job"] == "eval"
    eval_session.received(welcome(job="eval"), 0.0)  # echoed: jobs kept apart
    with pytest.raises(InvalidState, match="rule 'a broker keeps jobs apart' not met: broker b .* did not echo job "
                                           "'eval'"):
        session(job="eval").received(welcome(), 0.0)
    with pytest.raises(InvalidInput, match="a job name must match"):
        session(job="eval/1")


def test_the_welcome_grants_the_window_and_says_whether_batches_are_read():
    s = session(window=32)
    assert s.window.limit == BEFORE_WELCOME_WINDOW and s.batch_bytes == 0
    s.received(welcome(window=64, batch_frames=True, max_message_bytes=4096), 0.0)
    assert s.window.limit == 32  # never more than the producer's own setting
    assert s.batch_bytes == 4096  # the broker's message bound
    s.received(welcome(batch_frames=True), 0.0)
    assert s.batch_bytes == BATCH_UP_TO_BYTES  # or the producer's own, the smaller
    s.hello()  # a new connection: one frame a message until its welcome
    assert s.batch_bytes == 0
    s.received(welcome(), 0.0)  # a broker that does not read batches
    assert s.batch_bytes == 0
    unbatched = session(batch_frames=False)
    unbatched.received(welcome(batch_frames=True), 0.0)
    assert unbatched.batch_bytes == 0


def test_frames_ready_together_go_as_one_batch_only_once_the_welcome_allows_it():
    for batch_frames, expected in ((False, [("turn", 1, "a", 0), ("turn", 2, "b", 0), ("turn", 3, "c", 0)]),
                                   (True, [[("turn", 1, "a", 0), ("turn", 2, "b", 0), ("turn", 3, "c", 0)]])):
        s = session()
        s.received(welcome(batch_frames=batch_frames), 0.0)
        accept(s, *(Handle(tid).turn() for tid in "abc"))
        assert transmit(s) == expected


def test_a_message_the_socket_refuses_stops_the_run_and_goes_next_time():
    s = session()
    s.received(welcome(), 0.0)
    accept(s, *(Handle(tid).turn() for tid in "abc"))
    assert transmit(s, refuse_after=1) == [("turn", 1, "a", 0)]
    assert transmit(s) == [("turn", 2, "b", 0), ("turn", 3, "c", 0)]
    assert s.metrics.totals.get("frames_sent.turn") == 3 and not s.metrics.totals.get("resends")


# -- window grants -----------------------------------------------------------------------------
def test_grants_in_any_reply_grow_and_shrink_the_window_within_the_setting():
    s = session(window=8)
    s.received(welcome(window=64), 0.0)
    assert s.window.limit == 8
    accept(s, *(Handle(tid).turn() for tid in "abcde"))
    s.received(reply("pong", seq=999, window=3), 0.0)
    assert s.window.limit == 3 and len(s.window) == 5  # nothing held is dropped
    assert not s.has_room(0)
    s.received(reply("acks", ranges=[], window=6), 0.0)
    assert s.window.limit == 6 and s.has_room(0)


# -- pings and pongs -------------------------------------------------------------------------
def ping(s, now):
    """The ping due at `now`, transmitted: its seq."""
    assert s.ping_due(now)
    seq = decode(s.ping(), PRODUCER_TO_BROKER)["seq"]
    s.pinged(now)
    return seq


def test_a_pong_resends_what_was_sent_before_its_ping_and_is_still_unanswered():
    s = session(heartbeat_interval=1.0, heartbeat_timeout=30.0)
    s.received(welcome(), 0.0)
    accept(s, Handle("a").turn(), Handle("b").turn())
    assert [seq for _, seq, _, _ in transmit(s, 1.0)] == [1, 2]
    settle(s, ack(2, "b"))
    pinged = ping(s, 2.0)
    assert pinged == 3  # pings take their seq from the frames' sequence
    accept(s, Handle("c").turn())
    assert transmit(s, 3.0) == [("turn", 4, "c", 0)]
    settle(s, reply("pong", seq=pinged), 3.5)
    assert transmit(s, 4.0) == [("turn", 1, "a", 0)]  # its reply was lost; seq 4 went after the ping
    assert s.metrics.totals.get("resends") == 1


def test_a_pong_forgets_the_earlier_pings_and_an_unknown_pong_resends_nothing():
    s = session(heartbeat_interval=1.0, heartbeat_timeout=30.0)
    s.received(welcome(), 0.0)
    accept(s, Handle("a").turn())
    transmit(s, 0.5)
    first = ping(s, 1.0)
    second = ping(s, 2.0)
    settle(s, reply("pong", seq=second), 2.5)
    assert s.pings == {}  # the earlier ping's pong would have come first: lost, or never coming
    assert transmit(s, 3.0) == [("turn", 1, "a", 0)]
    settle(s, reply("pong", seq=first), 3.5)
    settle(s, reply("pong", seq=12345), 3.5)
    assert transmit(s, 4.0) == []


# -- reconnects --------------------------------------------------------------------------------------
def test_a_reconnect_resends_every_unsettled_frame_in_order_behind_a_fresh_hello():
    s = session(heartbeat_interval=1.0, heartbeat_timeout=30.0)
    assert s.connected() is None  # the first handshake: the hello went with it
    s.received(welcome(batch_frames=True), 0.0)
    a, b = Handle("a"), Handle("b")
    accept(s, a.turn(), b.turn())
    accept(s, a.turn())
    assert transmit(s) == [[("turn", 1, "a", 0), ("turn", 2, "b", 0), ("turn", 3, "a", 1)]]
    settle(s, ack(2, "b"))
    old_ping = ping(s, 1.0)
    hello = s.connected()
    assert decode(hello, PRODUCER_TO_BROKER).type == "hello"
    assert s.pings == {}  # they went with the old connection
    assert transmit(s, 2.0) == [("turn", 1, "a", 0), ("turn", 3, "a", 1)]  # in order, unbatched until welcomed
    assert s.metrics.totals.get("reconnects") == 1
    settle(s, reply("pong", seq=old_ping), 2.5)  # the old connection's ping: answers nothing on this one
    assert transmit(s, 3.0) == []


# -- replies ------------------------------------------------------------------------------------------
def test_acks_settle_frames_with_receipts_and_replies_that_answer_nothing_are_counted():
    s = session()
    s.received(welcome(), 0.0)
    handle = Handle("t")
    futures = accept(s, handle.turn())
    futures += accept(s, handle.turn())
    transmit(s)
    settle(s, reply("acks", ranges=[[1, 2]], outcomes=[{"seq": 2, "applied": False, "reason": "replay_gap"}]))
    assert futures == [[Receipt("turn", "t", 0, 1, True)], [Receipt("turn", "t", 1, 2, False, False, "replay_gap")]]
    assert s.in_memory == 0 and s.pending == {}
    settle(s, ack(1, "t"))  # settled already
    settle(s, reply("nack", code="malformed", message="unreadable"))  # answers no seq
    s.undecodable(RemoteProtocolError("malformed", "garbage"))
    assert s.metrics.totals.get("replies_ignored") == 3
    assert s.metrics.totals.get("frames_acked.applied") == 1 and s.metrics.totals.get("frames_acked.replay_gap") == 1


# -- refusals rewind the handle ---------------------------------------------------------------------
def test_a_refused_turn_rewinds_its_handle_and_a_draft_made_before_goes_under_the_rewound_index():
    s = session()
    s.received(welcome(), 0.0)
    handle = Handle("t")
    futures = accept(s, handle.turn())
    futures += accept(s, handle.turn(a_turn(7)))
    assert handle.next_turn == 2
    made_before = handle.turn(a_turn(9))  # encoded as turn 2 while turn 1 is in flight
    transmit(s)
    settle(s, reply("nack", seq=2, code="mask_invalid", message="token 7 outside its support"))
    (refused,) = futures[1]
    assert isinstance(refused, Refused) and (refused.code, refused.kind, refused.trajectory_id, refused.turn) == (
        "mask_invalid", "turn", "t", 1)
    assert handle.next_turn == 1  # before the future was resolved
    accept(s, made_before)
    assert made_before.index == 1 and handle.next_turn == 2
    assert transmit(s) == [("turn", 3, "t", 1)]
    assert s.metrics.totals.get("frames_nacked.mask_invalid") == 1


def test_a_conflict_does_not_rewind_the_broker_holds_that_turn():
    s = session()
    s.received(welcome(), 0.0)
    handle = Handle("t")
    accept(s, handle.turn(), handle.turn())
    transmit(s)
    settle(s, reply("nack", seq=2, code="conflict", message="turn 1 differs"))
    assert handle.next_turn == 2


def test_the_ledger_records_the_corrected_turn_in_place_of_the_refused_one(tmp_path):
    s = session(window=8)
    s.ledger = Ledger(tmp_path / "ledger.jsonl")
    s.received(welcome(), 0.0)
    handle, first, refused, corrected = Handle("t"), a_turn(5), a_turn(7), a_turn(9)
    accept(s, handle.turn(first), handle.turn(refused))
    transmit(s)
    settle(s, reply("nack", seq=2, code="mask_invalid", message="no"))
    accept(s, handle.turn(corrected), handle.end())
    s.ledger.close()
    (sent,) = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    record0, after0 = turn_record(ContentDigest(PROMPT), first)
    record1, _ = turn_record(after0, corrected)
    assert (sent["kind"], sent["id"], sent["producer"]) == ("sent", "t", "p")
    assert sent["prompt"] == ContentDigest(PROMPT).hexdigest()
    assert sent["turns"] == json.loads(json.dumps([record0, record1]))  # as JSON keeps them


# -- a halting handle gives its trajectory up at a refusal ------------------------------------------------
@pytest.mark.parametrize("refused_seq, reason", [(2, "turn 1 refused: internal"), (4, "end refused: internal")])
def test_a_halting_handle_gives_its_trajectory_up_at_a_refusal_even_behind_the_end_it_took_before(tmp_path, refused_seq,
                                                                                                   reason):
    """Its three turns and its end are taken before any reply, as a source
    that does not wait for receipts sends them. A refused turn (the broker
    then refuses the later turn and the end: it holds fewer turns than the
    end counts) or a refused end gives the trajectory up: `given_up` in the
    ledger, a final abort once everything before it settled, and nothing
    more of it taken."""
    s = session(window=8)
    s.ledger = Ledger(tmp_path / "ledger.jsonl")
    s.received(welcome(), 0.0)
    handle = Handle("t", halts=True)
    accept(s, handle.turn(a_turn(5)), handle.turn(a_turn(7)), handle.turn(a_turn(9)), handle.end())
    went = []

    def send(frames):
        went.append(decode(frames, PRODUCER_TO_BROKER, check_content=False))
        return True
    answered = 0
    while True:  # as the facade pumps: into the window, out, then the broker's answers
        s.fill_window()
        s.transmit(1.0, send)
        if answered == len(went):
            break
        for message in went[answered:]:
            seq = message["seq"]
            code = "internal" if seq == refused_seq else "out_of_order" if refused_seq < seq < 5 else None
            settle(s, ack(seq, "t") if code is None else reply("nack", seq=seq, code=code, message="no"))
            answered += 1
    assert [summary(message) for message in went] == [
        ("turn", 1, "t", 0), ("turn", 2, "t", 1), ("turn", 3, "t", 2), ("end", 4, "t", 3), ("abort", 5, "t", None)]
    assert went[-1]["reason"] == reason and "again" not in went[-1].fields
    assert handle.halted.code == "internal" and s.metrics.totals["given_up.internal"] == 1
    s.ledger.close()
    records = read_records([tmp_path / "ledger.jsonl"])
    assert [(r["kind"], r["id"]) for r in records] == [("sent", "t"), ("given_up", "t")]
    assert records[1]["reason"] == reason
    with pytest.raises(Halted) as halted:
        accept(s, handle.turn())
    assert str(halted.value) == (
        f"rule 'a halting handle sends nothing after a refusal' not met: {handle.halted}, so the producer gave 't' up; "
        "expected no further frame of it, got a 'turn' frame")
    assert halted.value.refused is handle.halted and s.next_seq == 6 and s.unsettled == 0  # nothing of it taken


@pytest.mark.parametrize("code", ["mask_invalid", "conflict"])
def test_a_turn_a_halting_handle_made_before_a_refusal_is_not_taken_under_another_index(code):
    """The draft made while turn 1 was in flight would go under turn 1's
    index once its refusal rewound the handle (or, after a `conflict`,
    after a turn the broker holds and this producer never sent): a halting
    handle refuses it instead, behind the give-up's abort."""
    s = session()
    s.received(welcome(), 0.0)
    handle = Handle("t", halts=True)
    accept(s, handle.turn(), handle.turn(a_turn(7)))
    made_before = handle.turn(a_turn(9))
    transmit(s)
    settle(s, reply("nack", seq=2, code=code, message="turn 1 refused"))
    with pytest.raises(Halted) as halted:
        accept(s, made_before)
    assert halted.value.refused.code == code and s.next_seq == 4  # seq 3 is the abort
    settle(s, ack(1, "t"))
    s.fill_window()
    assert transmit(s) == [("abort", 3, "t", None)]


# -- a kill as an end is taken ----------------------------------------------------------------------
class Killed(BaseException):
    """The process was killed at this write (SIGKILL): nothing after it ran."""


def killed(*args, **kwargs):
    raise Killed


def applied(s, now=1.0):
    """Transmit until nothing more goes, the broker applying each message; what went, in order."""
    went = []
    while sent := [message for out in transmit(s, now) for message in (out if isinstance(out, list) else [out])]:
        went += sent
        for _, seq, tid, _ in sent:
            settle(s, ack(seq, tid), now)
    return went


@pytest.mark.parametrize("killed_at", ["ledger", "spool"])
def test_a_producer_killed_as_it_takes_an_end_leaves_no_end_acked_that_its_ledger_never_recorded(tmp_path, monkeypatch,
                                                                                                  killed_at):
    """Killed at either write of an accepted `end` (its `sent` record, its
    spool record), the next run of the producer resends what its spool
    holds; an end it did not resend stays open at the broker, which hands
    the trajectory back, and that run ends it. Either way the checker finds
    the trained trajectory as the ledgers say it was sent."""
    def run(number):
        s = session(window=8)
        s.use_spool(Spool(tmp_path / "spool", "p", max_bytes=1 << 20))
        s.ledger = Ledger(tmp_path / f"run-{number}.jsonl")
        s.received(welcome(), float(number))
        return s

    first, handle, turns = run(0), Handle("t"), [a_turn(5), a_turn(7)]
    accept(first, *map(handle.turn, turns))
    target, write = {"ledger": (first.ledger, "write"), "spool": (first.spool, "append")}[killed_at]
    monkeypatch.setattr(target, write, killed)
    with pytest.raises(Killed):
        accept(first, handle.end())
    first.spool.close()  # what its death leaves of it
    first.ledger.close()

    second = run(1)
    second.fill_window()
    resent = applied(second)
    if not any(message[0] == "end" for message in resent):  # open at the broker with both turns: handed back, ended
        resumed = Handle("t")
        resumed.next_turn = len(turns)
        resumed.digests.earlier(turns, len(turns))
        accept(second, resumed.end())
        applied(second)
    second.spool.close()
    second.ledger.close()

    after = ContentDigest(PROMPT)
    for turn in turns:
        _, after = turn_record(after, turn)
    records = read_records(sorted(tmp_path.glob("run-*.jsonl")))
    report = check([*records, {"kind": "committed", "id": "t", "digest": after.hexdigest(), "gap": None}])
    assert (report.acked, report.corrupted) == (1, []), (
        f"rule 'an end acked after a restart is one a ledger recorded sent' not met: expected t acked and not corrupted, "
        f"got acked {report.acked}, corrupted {report.corrupted} (the next run resent {resent}; ledgers: {records})")


# -- liveness and overdue frames ---------------------------------------------------------------------
def test_the_broker_is_lost_after_the_heartbeat_timeout_and_back_at_any_reply(caplog):
    s = session(heartbeat_interval=1.0, heartbeat_timeout=3.0, now=100.0)
    with caplog.at_level(logging.INFO, logger="rollstream.producer"):
        s.tick(102.9)
        assert gauge(s, "broker_up") == 0 and not caplog.records  # never set: the facade sets it at start
        s.metrics.broker_up.set(1)
        s.tick(103.0)
        assert gauge(s, "broker_up") == 0
        s.tick(110.0)  # reported once
        assert [r.getMessage() for r in caplog.records] == ["broker inproc://broker silent for 3.0 s"]
        s.received(reply("pong", seq=1), 111.0)
        assert gauge(s, "broker_up") == 1 and caplog.records[-1].getMessage() == "broker inproc://broker answering again"
        s.tick(113.9)
        assert gauge(s, "broker_up") == 1


def test_overdue_frames_are_reported_once_a_reply_timeout_and_never_resent(caplog):
    s = session(heartbeat_interval=1.0, heartbeat_timeout=300.0)
    s.received(welcome(), 0.0)
    accept(s, Handle("a").turn())
    transmit(s, 0.0)
    with caplog.at_level(logging.WARNING, logger="rollstream.producer"):
        s.tick(9.9)
        assert not caplog.records
        s.tick(10.0)
        s.tick(15.0)
        assert len(caplog.records) == 1
        assert caplog.records[0].getMessage() == ("1 frames without a reply for 10.0 s; waiting "
                                                  "(the broker answers pings)")
        s.tick(20.0)
        assert len(caplog.records) == 2
    assert transmit(s, 20.0) == []


# -- holding --------------------------------------------------------------------------------------------
def test_an_end_waits_for_its_turns_and_memory_holds_only_the_window():
    s = session(window=2)
    s.received(welcome(), 0.0)
    handle = Handle("t")
    accept(s, handle.turn(), handle.turn())
    assert not s.has_room(0)
    futures = accept(s, handle.end())  # accepted past the window (the facade waits for room first): held back
    assert len(s.window) == 2 and len(s.intake) == 1 and s.in_memory == 3
    assert transmit(s) == [("turn", 1, "t", 0), ("turn", 2, "t", 1)]
    settle(s, reply("acks", ranges=[[1, 2]]))
    s.fill_window()
    assert transmit(s) == [("end", 3, "t", 2)]  # it says two turns were sent
    settle(s, ack(3, "t"))
    assert futures == [[Receipt("end", "t", None, 3, True)]] and s.unsettled == 0


def test_the_admission_the_broker_last_named_is_kept_until_its_next_answer():
    s = session()
    assert s.admit is None  # no limit until a broker names one
    s.received(welcome(admit=3), 0.1)
    assert s.admit == 3
    s.received(reply("pong", seq=0, window=64, admit=0), 0.2)
    assert s.admit == 0
    s.received(reply("acks", ranges=[[0, 0]], admit=2), 0.3)
    assert s.admit == 2
    s.received(reply("pong", seq=1, window=64), 0.4)  # a broker without a capacity (the bound was lifted)
    assert s.admit is None
