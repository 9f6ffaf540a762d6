"""The last wall of every receive loop: an exception no rule foresaw while
one message is handled refuses that message alone (`internal`, naming its
type and the digest of its frames), is counted and logged once, leaves the
rest of the batch its outcomes, and a connection that keeps causing them
is refused unread for a while. The failures are injected where a bug would
raise them (the merge, the content check, the decoder, a status read)."""
import asyncio
import logging

import msgpack
import numpy as np
import pytest
import zmq
from broker_helpers import drive, turn_msg
from test_broker_core import P, Q, at, core, produce
from test_consumer_session import deliver, sessions, welcome
from test_producer_live import PATIENCE, FakeBroker

from rollstream.broker import service as broker_service
from rollstream.broker.core import Send
from rollstream.broker.engine import State
from rollstream.broker.service import BrokerService
from rollstream.broker.settings import BrokerSettings
from rollstream.common.codec import decode, encode
from rollstream.common.failures import RULE_LIMIT, FailureLimit, frames_digest
from rollstream.common.messages import ADMIN_REQUESTS, BROKER_TO_CONSUMER, CONSUMER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn
from rollstream.producer import AsyncProducer


class Bug(RuntimeError):
    """What a bug raises: no rule of the protocol names it."""


def failing_for(original, tid: str, turn: int | None = None):
    """`original` (the engine's `_handle`, which handles each message,
    alone or in a turn stretch), raising `Bug` when handed a message of
    trajectory `tid` (its turn `turn` only, when given)."""
    def handle(message, *args, **kwargs):
        if message.fields.get("trajectory_id") == tid and turn in (None, message.fields.get("turn")):
            raise Bug(f"injected while handling {tid}")
        return original(message, *args, **kwargs)
    return handle


# -- the limit ------------------------------------------------------------------------
def test_a_peer_is_limited_past_the_allowed_failures_within_the_window_and_free_again_after_it():
    limit = FailureLimit(allowed=2, window=10.0)
    limit.failed("p", 0.0)
    limit.failed("p", 1.0)
    assert limit.limited("p", 1.0) is None  # two allowed
    limit.failed("p", 2.0)
    limited = limit.limited("p", 2.0)
    assert limited is not None and (limited.failures, limited.until) == (3, 10.0)
    assert limit.limited("q", 2.0) is None  # another peer is not
    refusal = limit.refusal("p", 4.0)
    assert refusal.code == "internal" and RULE_LIMIT in refusal.message
    assert "at most 2 failures within 10 s, this connection had 3" in refusal.message and "another 6.0 s" in refusal.message
    assert limit.limited("p", 9.9) is not None
    assert limit.limited("p", 10.1) is None  # the oldest of the three is out of the window


def test_a_limit_forgets_peers_whose_failures_are_old():
    limit = FailureLimit(allowed=1, window=5.0)
    for peer in ("a", "b"):
        limit.failed(peer, 0.0)
    limit.failed("c", 6.0)
    assert set(limit._failures) == {"c"}


def test_the_digest_names_the_frames_and_their_boundaries():
    assert frames_digest([b"ab", b"c"]) != frames_digest([b"a", b"bc"])
    assert frames_digest([b"ab", b"c"]) == frames_digest([memoryview(b"ab"), bytearray(b"c")])


# -- the broker's core ------------------------------------------------------------------
def test_a_turn_whose_merge_raises_is_refused_alone_and_the_rest_of_its_batch_is_acked(caplog):
    broker = core()
    broker.engine._handle = failing_for(broker.engine._handle, "b")
    batch = [turn_msg("a", 0, seq=1), turn_msg("b", 0, seq=2), turn_msg("c", 0, seq=3)]
    with caplog.at_level(logging.ERROR, logger="rollstream.broker"):
        _, replies = produce(broker, P, batch, t=0.0)
    assert [(r.type, r["seq"]) for r in replies] == [("ack", 1), ("nack", 2), ("ack", 3)]
    nack = replies[1]
    assert nack["code"] == "internal" and "a turn message" in nack["message"] and "Bug" in nack["message"]
    assert frames_digest(batch[1].frames) in nack["message"]
    assert broker.metrics.totals["internal_errors.producer"] == 1
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.frame_sizes == [len(f) for f in batch[1].frames] and record.exc_info[0] is Bug
    assert broker.engine.counts().get(State.OPEN) == 2  # a and c were merged; b changed nothing
    _, [ack] = produce(broker, P, [turn_msg("d", 0, seq=4)], t=1.0)  # and the core keeps serving
    assert ack.type == "ack"


def test_a_turn_of_a_stretch_whose_merge_raises_is_refused_alone_and_the_stretch_goes_on():
    """Turns 0-3 of one trajectory in one read go to the engine together
    (a turn stretch); turn 1 raising costs turn 1 alone: turn 0 is acked,
    turn 2 is then out of order (turn 1 was never applied) and so is turn 3,
    and a resent turn 1 is merged."""
    broker = core()
    broker.engine._handle = failing_for(broker.engine._handle, "s", turn=1)
    batch = [turn_msg("s", i, seq=i + 1) for i in range(4)]
    _, replies = produce(broker, P, batch, t=0.0)
    assert [(r.type, r["seq"], r.get("code")) for r in replies] == [
        ("ack", 1, None), ("nack", 2, "internal"), ("nack", 3, "out_of_order"), ("nack", 4, "out_of_order")]
    assert replies[2]["expected"] == 1 and broker.metrics.totals["internal_errors.producer"] == 1
    del broker.engine._handle  # the engine's own again
    _, [ack] = produce(broker, P, [turn_msg("s", 1, seq=5)], t=1.0)
    assert ack.type == "ack" and ack["applied"] is True


def test_a_connection_whose_messages_keep_failing_is_limited_and_others_are_not():
    broker = core()
    broker.engine._handle = failing_for(broker.engine._handle, "bad")
    allowed = broker.failures.allowed
    for i in range(allowed + 1):
        assert broker.limited("producer", P, float(i)) is None
        produce(broker, P, [turn_msg("bad", 0, seq=i)], t=float(i))
    refusal = broker.limited("producer", P, float(allowed + 1))
    assert refusal is not None and refusal.code == "internal" and RULE_LIMIT in refusal.message
    assert broker.limited("producer", Q, float(allowed + 1)) is None
    assert broker.limited("consumer", P, float(allowed + 1)) is None  # counted per endpoint and connection


def test_a_consumer_message_whose_handling_raises_gets_an_internal_nack():
    broker = core()
    original = broker._consumer_message

    def consumer_message(identity, message, *args):
        if message.type == "credit":
            raise Bug("injected in credit")
        return (yield from original(identity, message, *args))

    broker._consumer_message = consumer_message
    messages = [decode(encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "c"}), CONSUMER_TO_BROKER),
                decode(encode(CONSUMER_TO_BROKER, "credit", {"n": 1, "unit": "trajectory"}), CONSUMER_TO_BROKER),
                decode(encode(CONSUMER_TO_BROKER, "heartbeat", {}), CONSUMER_TO_BROKER)]
    asked = drive(broker.consumer_read([(b"c", m, None) for m in messages], at(0.0)))
    replies = [decode(r.frames, BROKER_TO_CONSUMER) for r in asked if isinstance(r, Send)]
    assert [r.type for r in replies][:2] == ["welcome", "nack"]
    assert replies[1]["code"] == "internal" and "a credit message" in replies[1]["message"]
    assert broker.metrics.totals["internal_errors.consumer"] == 1


def test_an_admin_request_whose_handling_raises_gets_an_internal_reply():
    broker = core()

    def status(now):
        raise Bug("injected in status")

    broker.status = status
    request = decode([msgpack.packb({"v": 1, "type": "status", "seq": 5})], ADMIN_REQUESTS)
    [send] = drive(broker.admin_request(b"a", [], request, None, at(0.0)))
    reply = msgpack.unpackb(send.frames[0])
    assert (reply["type"], reply["code"], reply["seq"]) == ("nack", "internal", 5)
    assert broker.metrics.totals["internal_errors.admin"] == 1


# -- the broker's shell -----------------------------------------------------------------
@pytest.fixture
def service(tmp_path):
    """A broker service on inproc endpoints, driven pass by pass from the test."""
    context = zmq.Context()
    settings = BrokerSettings(producer_endpoint="inproc://p", consumer_endpoint="inproc://c", admin_endpoint="inproc://a",
                              data_dir=str(tmp_path / "data"), metrics_port=0, vocab_size=1000)
    service = BrokerService(settings, context=context)
    service.start()
    service.peers = []  # the test's sockets, closed before the context terminates (which waits for them)
    try:
        yield service
    finally:
        for sock in service.peers:
            sock.close(linger=0)
        service.close()
        context.term()


def replies(service, sock, n: int) -> list:
    """The next `n` producer replies, running the broker one pass at a time until they came."""
    out = []
    for _ in range(1000):
        service.run_once(timeout_ms=10)
        while len(out) < n and sock.poll(0):
            out.append(msgpack.unpackb(sock.recv_multipart()[0]))
        if len(out) == n:
            return out
    raise AssertionError(f"{len(out)} of {n} replies came: {out}")


def producer_socket(service):
    sock = service.context.socket(zmq.DEALER)
    service.peers.append(sock)
    sock.connect("inproc://p")
    return sock


def turn_frames(tid: str, seq: int) -> list:
    return encode_turn(tid, 0, Turn.build([5], [-0.1], supports=[[5]]), seq=seq, prompt_tokens=np.array([1, 2], np.int32))


def test_a_frame_whose_decoding_raises_is_refused_and_the_broker_keeps_serving(service, monkeypatch):
    original = service._decode_producer_frames

    def decode_producer_frames(frames):
        message = original(frames)
        if message.get("trajectory_id") == "bad":
            raise Bug("injected in decoding")
        return message

    monkeypatch.setattr(service, "_decode_producer_frames", decode_producer_frames)
    sock = producer_socket(service)
    bad = turn_frames("bad", 1)
    sock.send_multipart(bad)
    sock.send_multipart(turn_frames("good", 2))
    nack, ack = replies(service, sock, 2)
    assert (nack["type"], nack["code"], nack["seq"]) == ("nack", "internal", 1)
    assert "a turn message" in nack["message"] and frames_digest(bad) in nack["message"]
    assert (ack["type"], ack["seq"], ack["applied"]) == ("ack", 2, True)
    assert service.metrics.totals["internal_errors.producer"] == 1


def test_a_content_check_that_raises_refuses_that_turn_alone(service, monkeypatch):
    """The packed check raising sends each turn to the check alone, which
    finds the one that raises."""
    original = broker_service.check_message_arrays

    def check_message_arrays(arrays, **kwargs):
        if arrays["tokens"][0] == 7:
            raise Bug("injected in the content check")
        return original(arrays, **kwargs)

    def messages_content_valid(batch, vocab_size=None):
        raise Bug("injected in the packed check")

    monkeypatch.setattr(broker_service, "check_message_arrays", check_message_arrays)
    monkeypatch.setattr(broker_service, "messages_content_valid", messages_content_valid)
    sock = producer_socket(service)
    sock.send_multipart(turn_frames("good", 1))
    sock.send_multipart(encode_turn("bad", 0, Turn.build([7], [-0.1], supports=[[7]]), seq=2,
                                    prompt_tokens=np.array([1, 2], np.int32)))
    got = {reply["seq"]: reply for reply in replies(service, sock, 2)}
    assert (got[1]["type"], got[1]["applied"]) == ("ack", True)
    assert (got[2]["type"], got[2]["code"]) == ("nack", "internal") and "content check" in got[2]["message"]


def test_a_limited_producer_connection_is_answered_unread(service, monkeypatch):
    monkeypatch.setattr(service.core.engine, "_handle", failing_for(service.core.engine._handle, "bad"))
    sock = producer_socket(service)
    allowed = service.core.failures.allowed
    for seq in range(allowed + 1):
        sock.send_multipart(turn_frames("bad", seq))
        [nack] = replies(service, sock, 1)
        assert nack["code"] == "internal" and RULE_LIMIT not in nack["message"]
    sock.send_multipart(turn_frames("good", 100))
    [refused] = replies(service, sock, 1)
    assert (refused["code"], refused["seq"]) == ("internal", 100) and RULE_LIMIT in refused["message"]
    other = producer_socket(service)  # another connection is served
    other.send_multipart(turn_frames("good", 101))
    [ack] = replies(service, other, 1)
    assert (ack["type"], ack["applied"]) == ("ack", True)


# -- the consumer -----------------------------------------------------------------------
def test_a_delivery_whose_handling_raises_is_nacked_and_counted(caplog):
    s = sessions()
    s.due(0.0, closing=False)
    s.received(0, welcome(), 0.0)
    s.due(0.0, closing=False)
    message = deliver("t", "L-1")
    with caplog.at_level(logging.ERROR, logger="rollstream.consumer"):
        s.failed_inside(0, "deliver", message.fields, message.frames, Bug("injected in assembly"))
    [nack] = [fields for _, kind, fields in s.due(0.1, closing=False) if kind == "nack"]
    assert nack["leases"] == ["L-1"] and nack["requeue"] is False
    assert nack["reason"].startswith("internal: handling a deliver message") and "Bug" in nack["reason"]
    assert s.assembler.stats.internal_errors == 1
    assert [r.exc_info[0] for r in caplog.records] == [Bug]


def test_a_delivery_already_taken_in_is_not_refused_when_a_later_step_raises():
    s = sessions()
    s.due(0.0, closing=False)
    s.received(0, welcome(), 0.0)
    s.due(0.0, closing=False)
    message = deliver("t", "L-1")
    s.received(0, message, 0.1)
    s.failed_inside(0, "deliver", message.fields, message.frames, Bug("after it was buffered"))
    assert [kind for _, kind, _ in s.due(0.2, closing=False) if kind == "nack"] == []
    assert s.assembler.complete == 1 and s.assembler.stats.internal_errors == 1


# -- the producer -----------------------------------------------------------------------
def test_a_reply_whose_handling_raises_is_dropped_counted_and_its_frame_sent_again():
    """As a lost reply: the frame it answered goes again once a later ping
    is answered, and that answer settles it."""
    async def main(fake):
        async with AsyncProducer(fake.endpoint, "p-bug", context=fake.context, batch_acks=False, reply_timeout=60.0,
                                 heartbeat_interval=0.1, heartbeat_timeout=30.0) as producer:
            session = producer._session
            original, failed = session.received, []

            def received(reply, now):
                if reply.type == "ack" and not failed:
                    failed.append(reply["seq"])
                    raise Bug("injected in the producer's session")
                return original(reply, now)

            session.received = received
            traj = producer.trajectory("t", [1, 2])
            receipt = await asyncio.wait_for(await traj.turn([5], [-0.5], supports=[[5, 6]]), PATIENCE)
            return receipt, failed, producer.metrics
    with FakeBroker() as fake:
        receipt, failed, metrics = asyncio.run(main(fake))
    assert receipt.applied and len(failed) == 1
    assert metrics.totals["internal_errors"] == 1 and sum(metrics.resends.values.values()) == 1
    assert [kind for kind, _ in fake.seen].count("turn") == 2
