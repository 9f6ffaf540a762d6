"""The broker's composition (`broker.core.BrokerCore`) driven without
sockets, store or clock: what it asks for, in which order, and what goes out.
The whole state machine runs in tests/test_broker_state_machine.py; these
are the rules that live between the cores."""
from broker_helpers import drive, end_msg, housekeep, turn_msg
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rollstream.broker.core import BrokerCore, Commit, Probe, ReadDigests, Reload, Send, Sent, producer_live_for
from rollstream.broker.engine import PutTurn
from rollstream.broker.metrics import BrokerMetrics
from rollstream.broker.recovery import Rebuilt
from rollstream.broker.settings import BrokerSettings
from rollstream.broker.store import StoreUnavailable
from rollstream.common.clock import Clock
from rollstream.common.codec import content_digest, decode, encode
from rollstream.common.messages import BROKER_TO_CONSUMER, BROKER_TO_PRODUCER, CONSUMER_TO_BROKER, PRODUCER_TO_BROKER

P, Q, C = b"producer-p", b"producer-q", b"consumer"
NOTHING_STORED = Rebuilt([], (), {}, {}, {})


def core(**settings) -> BrokerCore:
    broker = BrokerCore(BrokerSettings(**settings), "b-1", BrokerMetrics(), disk_reserve=0)
    broker.restore(NOTHING_STORED, 0, 1 << 40)
    return broker


def at(t: float) -> Clock:
    return Clock(t, 1000.0 + t)


def hello(producer_id: str, **fields):
    return decode(encode(PRODUCER_TO_BROKER, "hello", {"producer_id": producer_id, **fields}), PRODUCER_TO_BROKER)


def produce(broker: BrokerCore, identity: bytes, messages, t: float, **answers) -> tuple[list, list]:
    """Hand `messages` from one connection to the core as one batch; what it
    asked for, and the producer replies it sent (decoded)."""
    for _ in messages:
        broker.frame_arrived(identity, 100, t)
    asked = drive(broker.producer_read([(identity, m, None) for m in messages], at(t)), **answers)
    return asked, [decode(r.frames, BROKER_TO_PRODUCER) for r in asked if isinstance(r, Send) and r.socket == "producer"]


def test_window_shares_status_and_forgetting_follow_one_liveness_rule():
    """With a heartbeat over 10 s, the window shares used to count producers
    heard within 30 s while `status` counted those heard within 3 heartbeat
    intervals, and neither forgot them before an hour. Now one rule holds."""
    broker = core(heartbeat_interval=20.0, window=64, max_in_flight=64)
    assert broker.producer_live_for == producer_live_for(20.0) == 60.0
    produce(broker, P, [hello("p", batch_acks=True)], t=0.0)
    produce(broker, Q, [hello("q")], t=40.0)
    housekeep(broker, at(50.0))  # p, silent for 50 s, is still live
    assert broker.status(at(50.0))["producers"] == 2 and broker.grants.fair == 32
    housekeep(broker, at(61.0))  # p is not: counted nowhere, and forgotten
    assert broker.status(at(61.0))["producers"] == 1 and broker.grants.fair == 64
    assert P not in broker.producers and P not in broker.hellos.batch_acks
    _, [pong] = produce(broker, P, [decode(encode(PRODUCER_TO_BROKER, "ping", {"seq": 7}), PRODUCER_TO_BROKER)], t=62.0)
    assert pong.type == "pong" and broker.status(at(62.0))["producers"] == 2  # heard again: live again


def test_a_resend_of_an_applied_turn_is_compared_with_the_digest_read_from_the_store():
    broker = core()
    first = turn_msg("t", 0, [10, 11], [[10, 3], [11]], seq=1)
    produce(broker, P, [first], t=0.0)
    stored = {("t", 0): content_digest(first)}
    asked, [ack] = produce(broker, P, [turn_msg("t", 0, [10, 11], [[10, 3], [11]], seq=2)], t=1.0,
                           ReadDigests=lambda request: {key: stored[key] for key in request.keys})
    assert [type(r) for r in asked][:2] == [ReadDigests, Commit] and asked[0].keys == [("t", 0)]  # read before merging
    assert ack.type == "ack" and ack["duplicate"] and ack["applied"]
    _, [nack] = produce(broker, P, [turn_msg("t", 0, [10, 12], [[10, 3], [12]], seq=3)], t=2.0,
                        ReadDigests=lambda request: {key: stored[key] for key in request.keys})
    assert nack.type == "nack" and nack["code"] == "conflict" and nack["seq"] == 3


def test_a_resend_whose_digest_cannot_be_read_is_refused_and_the_store_is_unavailable_from_there():
    broker = core()
    produce(broker, P, [turn_msg("t", 0, seq=1)], t=0.0)
    resend, fresh = turn_msg("t", 0, seq=2), turn_msg("u", 0, seq=3)
    _, replies = produce(broker, P, [resend, fresh], t=1.0,
                         ReadDigests=lambda request: {key: StoreUnavailable("I/O error") for key in request.keys})
    assert [(r.type, r["code"], r["seq"]) for r in replies] == [("nack", "unavailable", 2), ("nack", "unavailable", 3)]
    assert broker.unavailable and "u" not in broker.engine.entries
    asked = housekeep(broker, at(2.0))
    assert any(isinstance(r, Probe) for r in asked) and not broker.unavailable  # the probe succeeded


def test_a_failed_commit_refuses_the_whole_batch_and_rolls_memory_back_to_the_store():
    broker = core()
    asked, replies = produce(broker, P, [turn_msg("t", 0, seq=1), end_msg("t", seq=2)], t=0.0,
                             Commit=lambda request: StoreUnavailable("disk gone"), Reload=lambda request: NOTHING_STORED)
    assert [type(r) for r in asked[:2]] == [Commit, Reload]
    assert [(r.type, r["code"], r["seq"]) for r in replies] == [("nack", "unavailable", 1), ("nack", "unavailable", 2)]
    assert not broker.engine.entries and not broker.dispatcher.queues and broker.unavailable
    _, [refused] = produce(broker, P, [turn_msg("t", 0, seq=3)], t=0.5)  # no probe yet: refused before merging
    assert refused["code"] == "unavailable" and not broker.engine.entries
    housekeep(broker, at(1.0), Probe=lambda request: False)
    assert broker.unavailable
    asked = housekeep(broker, at(1.5), Probe=lambda request: True)
    assert not any(isinstance(r, Probe) for r in asked) and broker.unavailable  # probed at most once a second
    housekeep(broker, at(2.0), Probe=lambda request: True)
    assert not broker.unavailable


def test_a_reply_that_finds_its_producers_connection_gone_forgets_the_connection():
    """A send is answered with what became of it. Gone: the core forgets
    the connection (its grant, its hello's choices) as it does one silent
    past its liveness. Dropped because the producer is not reading: the
    connection stays."""
    broker = core(window=64, max_in_flight=64)
    produce(broker, P, [hello("p", batch_acks=True)], t=0.0)
    produce(broker, Q, [hello("q")], t=0.0)
    assert broker.grants.fair == 32
    produce(broker, Q, [turn_msg("q", 0, seq=1)], t=1.0, Send=lambda request: Sent.FULL)
    assert Q in broker.producers
    produce(broker, P, [turn_msg("p", 0, seq=1)], t=1.0, Send=lambda request: Sent.GONE)
    assert P not in broker.producers and P not in broker.hellos.batch_acks and Q in broker.producers
    housekeep(broker, at(2.0))
    assert broker.grants.fair == 64 and broker.status(at(2.0))["producers"] == 1


def test_a_heartbeat_held_behind_a_long_housekeeping_pass_keeps_the_consumers_leases():
    """A consumer last heard at 0 holds a lease; the next pass starts late,
    at 10 s (over three heartbeat intervals on), and the consumer's
    heartbeat arrives while its first half commits. Handed to the core
    between the halves, as the service does, it is heard before the second
    half judges silence: the consumer and its lease stay. Heard only after
    the pass, it comes too late."""
    def leased():
        broker = core(heartbeat_interval=1.0, lease_timeout=60.0)
        produce(broker, P, [turn_msg("t", 0, seq=1), end_msg("t", seq=2)], t=0.0)
        received = [(C, decode(encode(CONSUMER_TO_BROKER, kind, fields), CONSUMER_TO_BROKER), None)
                    for kind, fields in (("hello", {"consumer_id": "c"}), ("credit", {"n": 1, "unit": "trajectory"}))]
        drive(broker.consumer_read(received, at(0.0)))
        [delivery] = [decode(r.frames, BROKER_TO_CONSUMER) for r in drive(broker.deliver(at(0.0))) if isinstance(r, Send)]
        return broker, delivery["lease"]

    heartbeat = [(C, decode(encode(CONSUMER_TO_BROKER, "heartbeat", {}), CONSUMER_TO_BROKER), None)]
    broker, lease = leased()
    housekeep(broker, at(10.0), between=heartbeat)
    assert C in broker.dispatcher.consumers and lease in broker.dispatcher.leases
    late, lease = leased()
    housekeep(late, at(10.0))
    drive(late.consumer_read(heartbeat, at(10.0)))
    assert C not in late.dispatcher.consumers and lease not in late.dispatcher.leases
    assert late.dispatcher.queued_in("default") == 1  # requeued


def test_batched_acks_carry_ranges_and_only_the_outcomes_that_are_not_plainly_applied():
    broker = core()
    produce(broker, P, [hello("p", batch_acks=True)], t=0.0)
    messages = [turn_msg("a", 0, seq=1), turn_msg("b", 0, seq=2), turn_msg("a", 0, seq=4), end_msg("zz", seq=5)]
    _, replies = produce(broker, P, messages, t=1.0)
    acks, refusal = replies
    assert acks.type == "acks" and acks["ranges"] == [[1, 2], [4, 4]] and acks["window"] >= 1
    assert acks["outcomes"] == [{"seq": 4, "applied": True, "duplicate": True}]
    assert (refusal.type, refusal["code"], refusal["seq"]) == ("nack", "unknown_trajectory", 5)  # after the acks


def test_a_consumer_hello_settles_the_acks_before_it_in_the_batch_first():
    """A hello drops the connection's leases and requeues them: an ack
    earlier in the same batch must be committed and applied before that, or
    the acked trajectory would come back."""
    broker = core()
    produce(broker, P, [turn_msg("t", 0, seq=1), end_msg("t", seq=2)], t=0.0)

    def consumer(*messages):
        received = [(C, decode(encode(CONSUMER_TO_BROKER, kind, fields), CONSUMER_TO_BROKER), None) for kind, fields in messages]
        asked = drive(broker.consumer_read(received, at(1.0)))
        asked += drive(broker.deliver(at(1.0)))
        return asked, [decode(r.frames, BROKER_TO_CONSUMER) for r in asked if isinstance(r, Send)]

    _, [_, delivery] = consumer(("hello", {"consumer_id": "c"}), ("credit", {"n": 1, "unit": "trajectory"}))
    asked, replies = consumer(("ack", {"leases": [delivery["lease"]]}), ("hello", {"consumer_id": "c"}))
    assert [r.type for r in replies] == ["acked", "welcome"]
    assert isinstance(asked[0], Commit) and [type(e).__name__ for e in asked[0].effects] == ["Forget"]
    assert not broker.dispatcher.queues and "t" not in broker.engine.entries


def test_a_quiet_broker_keeps_house_every_few_seconds_and_a_producers_frames_bring_the_busy_pace_back():
    """Nothing connected: housekeeping every 5 s, or a tenth of the TTL when
    that is shorter (an expiry is at most that late); a producer's frame
    makes it 0.2 s again for a second; a connected producer that has gone
    quiet brings the pass forward only to the moment it is forgotten."""
    broker = core(heartbeat_interval=1.0)
    assert broker.quiet and broker.housekeeping_every(0.0) == 5.0
    assert core(trajectory_ttl=3.0).housekeeping_every(0.0) == 0.3
    assert core(trajectory_ttl=0.5).housekeeping_every(0.0) == 0.2  # never faster than a connected broker's pace
    produce(broker, P, [hello("p")], t=0.0)
    assert not broker.quiet and broker.housekeeping_every(0.0) == 0.2 and broker.housekeeping_every(0.9) == 0.2
    assert broker.housekeeping_every(1.0) == 5.0  # quiet since, and forgotten only at 30 s
    assert broker.housekeeping_every(broker.producer_live_for - 2.0) == 2.0
    housekeep(broker, at(broker.producer_live_for + 1.0))  # silent past its liveness: forgotten
    assert broker.quiet and broker.housekeeping_every(broker.producer_live_for + 1.0) == 5.0


def test_with_only_consumers_connected_housekeeping_waits_for_the_next_lease_expiry_or_heartbeat_deadline():
    """No producer sending: the next pass comes when a consumer would have been
    silent three heartbeat intervals or the oldest lease runs out, whichever
    is first, never sooner than the busy pace nor later than the quiet one."""
    broker = core(heartbeat_interval=2.0, lease_timeout=4.5)
    produce(broker, P, [turn_msg("t", 0, seq=1), end_msg("t", seq=2)], t=0.0)
    housekeep(broker, at(broker.producer_live_for + 1.0))  # the producer is forgotten
    assert broker.quiet
    start = broker.producer_live_for + 2.0

    def consumer(kind, fields, t):
        message = decode(encode(CONSUMER_TO_BROKER, kind, fields), CONSUMER_TO_BROKER)
        drive(broker.consumer_read([(C, message, None)], at(t)))
        drive(broker.deliver(at(t)))

    consumer("hello", {"consumer_id": "c"}, start)
    assert not broker.quiet and broker.housekeeping_every(start) == 5.0  # silent for 6 s from `start`: later than 5
    assert broker.housekeeping_every(start + 2.0) == 4.0
    assert broker.housekeeping_every(start + 5.95) == 0.2
    consumer("credit", {"n": 1, "unit": "trajectory"}, start + 1.0)  # a lease out until start + 5.5
    assert broker.housekeeping_every(start + 1.0) == 4.5
    assert broker.housekeeping_every(start + 5.0) == 0.5


def test_a_consumer_that_asks_is_told_what_waits_queued_in_its_welcome_deliveries_and_news_and_can_revoke():
    """`queued_counts`: the welcome, every delivery and the `revoked` answer
    say how many trajectories of the job wait queued; a `queued` message
    comes only when what the connection was last told was empty and is not
    now, or the reverse. A connection that did not ask hears none of it."""
    broker = core()

    def consumer(identity, *messages, t=1.0):
        received = [(identity, decode(encode(CONSUMER_TO_BROKER, kind, fields), CONSUMER_TO_BROKER), None)
                    for kind, fields in messages]
        asked = drive(broker.consumer_read(received, at(t)))
        asked += drive(broker.deliver(at(t)))
        return [decode(r.frames, BROKER_TO_CONSUMER) for r in asked if isinstance(r, Send)]

    def ended(*tids, t=1.0):
        produce(broker, P, [m for i, tid in enumerate(tids) for m in (turn_msg(tid, 0, seq=10 * i),
                                                                    end_msg(tid, seq=10 * i + 1))], t=t)
        return [decode(r.frames, BROKER_TO_CONSUMER) for r in drive(broker.deliver(at(t))) if isinstance(r, Send)]

    ended("a", "b", "c")
    [welcome] = consumer(C, ("hello", {"consumer_id": "c", "queued_counts": True}))
    assert welcome["queued_counts"] is True and welcome["queued"] == 3
    [plain] = consumer(b"old", ("hello", {"consumer_id": "old"}))
    assert "queued" not in plain.fields and "queued_counts" not in plain.fields
    first, second = consumer(C, ("credit", {"n": 2, "unit": "trajectory"}))
    assert [first["queued"], second["queued"]] == [1, 1]  # what is left once this pass has gone out
    # "old" takes the last one: C was told 1, and nothing waits now: one message says so, and no more.
    old_delivery, news = consumer(b"old", ("credit", {"n": 5, "unit": "trajectory"}))
    assert old_delivery.type == "deliver" and "queued" not in old_delivery.fields
    assert news.type == "queued" and news["n"] == 0
    assert consumer(C, ("heartbeat", {})) == []
    consumer(b"old", ("revoke", {}))  # "old" holds 4 credit; gone, so the next ones wait queued
    news = ended("d", "e", t=2.0)
    assert [(m.type, m["n"]) for m in news] == [("queued", 2)]  # to C only: "old" did not ask
    assert ended("f", t=2.5) == []  # C was told it is not empty: nothing new to say
    [revoked] = consumer(C, ("credit", {"n": 1, "unit": "trajectory"}), ("revoke", {"seq": 4}))
    assert revoked.type == "revoked" and revoked["queued"] == 3 and revoked["seq"] == 4
    # The credit granted in the same batch went with the revoke: nothing was delivered.
    assert broker.dispatcher.consumers[C].trajectory_credit == 0 and broker.dispatcher.queued_in("default") == 3


# -- turn stretches -------------------------------------------------------------------------
_ITEMS = st.tuples(st.sampled_from([P, Q]), st.sampled_from(["a", "b"]), st.sampled_from(["turn", "turn", "turn", "end", "ping"]),
                   st.integers(0, 3), st.integers(0, 1))


def _answered(reads, *, stretches: bool, reads_fail: bool, **settings) -> tuple[list, dict]:
    """Every reply the core sends for `reads` (each a list of (connection,
    trajectory, kind, turn index, content variant)), read after read, and
    the trajectories it holds after: with turn stretches, or with each
    message handed to the engine alone. With `reads_fail`, the store cannot
    read a stored digest back."""
    broker = core(**settings)
    if not stretches:
        broker._stretch_end = lambda received, start: start + 1
    stored: dict[tuple[str, int], bytes] = {}  # what a store would read back: each committed turn's digest

    def commit(request: Commit) -> None:
        for effect in request.effects:
            if isinstance(effect, PutTurn):
                stored[(effect.trajectory_id, effect.turn)] = effect.digest or content_digest(effect.message)

    answered, seq = [], 0
    for t, read in enumerate(reads):
        received = []
        for identity, tid, kind, index, variant in read:
            seq += 1
            if kind == "turn":  # the second variant's version has no order: a staleness bound refuses it
                message = turn_msg(tid, index, tokens=(10 + variant,), seq=seq, weight_version=("3", "draft")[variant])
            elif kind == "end":
                message = end_msg(tid, seq=seq, turns=index + 1)
            else:
                message = decode(encode(PRODUCER_TO_BROKER, "ping", {"seq": seq}), PRODUCER_TO_BROKER)
            broker.frame_arrived(identity, 4096, float(t))
            received.append((identity, message, None))
        asked = drive(broker.producer_read(received, at(float(t))), Commit=commit,
                      ReadDigests=lambda request: {key: StoreUnavailable("cannot read") if reads_fail else stored[key]
                                                   for key in request.keys})
        answered.append([(r.identity, decode(r.frames, BROKER_TO_PRODUCER).fields) for r in asked
                         if isinstance(r, Send) and r.socket == "producer"])
    held = {tid: (entry.state, entry.next_turn, [applied for _, applied, _ in entry.outcomes])
            for tid, entry in broker.engine.entries.items()}
    return answered, held


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_ITEMS, max_size=8), max_size=4), st.sampled_from([64 << 30, 16_000]), st.booleans(),
       st.sampled_from([None, 2]))
# A resend whose digest cannot be read, then the next turn: the store stops before that turn.
@example([[(P, "a", "turn", 0, 0), (P, "a", "turn", 1, 0)], [(P, "a", "turn", 1, 0), (P, "a", "turn", 2, 0)]], 64 << 30, True,
         None)
# Turns of one trajectory from two connections, one after the other.
@example([[(P, "a", "turn", 0, 0), (Q, "a", "turn", 1, 0)]], 64 << 30, False, None)
# Under a staleness bound, a stretch's second turn names a version without an order.
@example([[(P, "a", "turn", 0, 0), (P, "a", "turn", 1, 0), (P, "a", "turn", 2, 1)]], 64 << 30, False, 2)
def test_a_read_is_answered_alike_with_turn_stretches_and_with_each_message_alone(reads, max_disk_bytes, reads_fail,
                                                                                    max_staleness):
    """Whether a message may enter is asked of a whole stretch before the
    engine merges it, so a stretch must form only where that cannot depend
    on the turns before it (`BrokerCore._stretch_end`): reads of turns in
    and out of order, resends with the same and other content, ends and
    pings from two connections, under a disk budget that runs out as they
    arrive, with a store that cannot read a resend's digest back (which
    stops the store for the rest of the read), and under a staleness bound
    that refuses a turn whose version has no order, are answered reply for
    reply and leave the same trajectories."""
    settings_ = {"max_disk_bytes": max_disk_bytes, "reads_fail": reads_fail, "max_staleness": max_staleness}
    assert _answered(reads, stretches=True, **settings_) == _answered(reads, stretches=False, **settings_)
