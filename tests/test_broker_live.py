"""Live-broker behaviour over time: lease loss, groups, expiry, transports."""
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from broker_process import BrokerProcess
from waiting import wait_for

from rollstream.broker.service import BrokerService
from rollstream.broker.settings import BrokerSettings
from rollstream.common.codec import decode, encode
from rollstream.common.messages import (
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    CONSUMER_TO_BROKER,
    PRODUCER_TO_BROKER,
)
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn
from rollstream.consumer import Consumer
from rollstream.producer import Producer

PATIENCE = 60.0  # seconds before a wait gives up (only ever reached when something hangs)


def dealer(endpoint, context=None):
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def recv(sock, schema, timeout=10_000):
    assert sock.poll(timeout), "no message"
    return decode(sock.recv_multipart(), schema)


def recv_alive(sock, schema, timeout=10.0):
    """Receive while heartbeating, as a live consumer does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.send_multipart(encode(CONSUMER_TO_BROKER, "heartbeat", {}))
        if sock.poll(100):
            return decode(sock.recv_multipart(), schema)
    raise AssertionError("no message")


def produce(sock, tid, seq, group=None, end=True):
    extra = {"prompt_tokens": np.array([1, 2], np.int32)}
    if group:
        extra["group_id"], extra["group_size"] = group
    sock.send_multipart(encode_turn(tid, 0, Turn.build([5], [-0.1], supports=[[5]]), seq=seq, **extra))
    assert recv(sock, BROKER_TO_PRODUCER)["applied"]
    if end:
        sock.send_multipart(encode(PRODUCER_TO_BROKER, "end", {"seq": seq + 1, "trajectory_id": tid, "reward": 1.0}))
        assert recv(sock, BROKER_TO_PRODUCER)["applied"]


def consumer(endpoint, name, credit, unit="trajectory"):
    sock = dealer(endpoint)
    sock.send_multipart(encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": name}))
    assert recv(sock, BROKER_TO_CONSUMER).type == "welcome"
    sock.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": credit, "unit": unit}))
    return sock


@pytest.mark.slow
def test_leases_of_a_silent_consumer_go_to_the_next_one(tmp_path):
    with BrokerProcess(tmp_path, heartbeat_interval=0.3, lease_timeout=30) as broker:
        producer = dealer(broker.producer)
        produce(producer, "t", 1)
        first = consumer(broker.consumer, "first", 1)
        delivery = recv(first, BROKER_TO_CONSUMER)
        assert delivery.type == "deliver" and delivery["delivery_count"] == 1
        second = consumer(broker.consumer, "second", 1)
        redelivered = recv_alive(second, BROKER_TO_CONSUMER)  # "first" never heartbeats again
        assert redelivered["trajectory_id"] == "t" and redelivered["delivery_count"] == 2
        second.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [redelivered["lease"]]}))
        assert recv_alive(second, BROKER_TO_CONSUMER).type == "acked"
        first.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [delivery["lease"]]}))
        assert recv(first, BROKER_TO_CONSUMER)["code"] == "unknown_consumer"  # it was declared dead


@pytest.mark.slow
def test_expired_lease_is_redelivered_and_late_ack_is_stale(tmp_path):
    with BrokerProcess(tmp_path, lease_timeout=0.5) as broker:
        produce(dealer(broker.producer), "t", 1)
        sock = consumer(broker.consumer, "slow", 2)
        first = recv(sock, BROKER_TO_CONSUMER)
        second = recv_alive(sock, BROKER_TO_CONSUMER)
        assert second["trajectory_id"] == "t" and second["lease"] != first["lease"]
        sock.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [first["lease"]]}))
        reply = recv(sock, BROKER_TO_CONSUMER)
        assert (reply["code"], reply["leases"]) == ("stale_lease", [first["lease"]])
        assert broker.status()["counters"]["redeliveries"] >= 1


def test_group_is_delivered_whole_with_members_that_left(tmp_path):
    with BrokerProcess(tmp_path) as broker:
        producer = dealer(broker.producer)
        produce(producer, "g0", 1, group=("G", 3))
        produce(producer, "g1", 10, group=("G", 3), end=False)
        sock = consumer(broker.consumer, "grouped", 1, unit="group")
        produce(producer, "g2", 20, group=("G", 3))
        assert not sock.poll(300)  # g1 still open: the group waits
        producer.send_multipart(encode(PRODUCER_TO_BROKER, "abort", {"seq": 30, "trajectory_id": "g1", "reason": "retry"}))
        assert recv(producer, BROKER_TO_PRODUCER)["applied"]
        deliveries = [recv(sock, BROKER_TO_CONSUMER), recv(sock, BROKER_TO_CONSUMER)]
        assert sorted(d["trajectory_id"] for d in deliveries) == ["g0", "g2"]
        assert {(d["group_id"], d["group_size"], d["group_left"]) for d in deliveries} == {("G", 3, 1)}


@pytest.mark.slow
def test_idle_open_trajectory_expires_to_dead_letters(tmp_path):
    with BrokerProcess(tmp_path, trajectory_ttl=0.5) as broker:
        producer = dealer(broker.producer)
        produce(producer, "idle", 1, end=False)
        wait_for(lambda: broker.status()["dead"], 10, "the idle trajectory to expire to dead letters")
        status = broker.status()
        assert status["dead"] == 1 and status["open"] == 0 and status["counters"]["trajectories.expired"] == 1
        producer.send_multipart(encode(PRODUCER_TO_BROKER, "end", {"seq": 5, "trajectory_id": "idle", "reward": 1.0}))
        reply = recv(producer, BROKER_TO_PRODUCER)  # too late: not taken, and not a duplicate of anything taken
        assert reply["applied"] is False and reply["reason"] == "expired" and "duplicate" not in reply.fields


def test_tcp_endpoints(tmp_path):
    broker = BrokerProcess(tmp_path, endpoints_file=tmp_path / "endpoints.json")
    broker.producer = broker.consumer = broker.admin = "tcp://127.0.0.1:0"  # the system picks; the file says which
    with broker:
        assert all(endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
                   for endpoint in (broker.producer, broker.consumer, broker.admin))
        produce(dealer(broker.producer), "t", 1)
        delivery = recv(consumer(broker.consumer, "tcp", 1), BROKER_TO_CONSUMER)
        assert delivery["trajectory_id"] == "t"


def test_inproc_endpoints_in_one_process(tmp_path):
    context = zmq.Context()
    settings = BrokerSettings(producer_endpoint="inproc://p", consumer_endpoint="inproc://c", admin_endpoint="inproc://a",
                              data_dir=str(tmp_path / "data"), metrics_port=0)
    service = BrokerService(settings, context=context)
    service.start()
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        produce(dealer("inproc://p", context), "t", 1)
        sock = dealer("inproc://c", context)
        sock.send_multipart(encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "in"}))
        assert recv(sock, BROKER_TO_CONSUMER).type == "welcome"
        sock.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 1, "unit": "trajectory"}))
        assert recv(sock, BROKER_TO_CONSUMER)["trajectory_id"] == "t"
        admin = dealer("inproc://a", context)
        admin.send(msgpack.packb({"v": 1, "type": "status"}))
        assert msgpack.unpackb(admin.recv())["leased"] == 1
    finally:
        service.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_a_lease_acked_twice_in_one_burst_is_settled_once(tmp_path):
    with BrokerProcess(tmp_path) as broker:
        produce(dealer(broker.producer), "t", 1)
        sock = consumer(broker.consumer, "twice", 1)
        lease = recv(sock, BROKER_TO_CONSUMER)["lease"]
        for _ in range(2):
            sock.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [lease]}))
        replies = [recv_alive(sock, BROKER_TO_CONSUMER), recv_alive(sock, BROKER_TO_CONSUMER)]
        assert sorted(r.type for r in replies) == ["acked", "nack"]
        assert next(r for r in replies if r.type == "nack")["code"] == "stale_lease"
        assert broker.status()["counters"]["trajectories.delivered"] == 1


def send_trajectory(endpoint, producer_id, tid):
    """Turn 0 and the end of `tid` through the library's producer: their receipts."""
    with Producer(endpoint, producer_id) as producer:
        traj = producer.trajectory(tid, [1, 2])
        turn = traj.turn_and_wait(np.array([5, 6], np.int32), np.array([-0.1, -0.2], np.float32), timeout=PATIENCE)
        return turn, traj.end_and_wait(1.0, timeout=PATIENCE)


@pytest.mark.slow
@pytest.mark.parametrize("taken", ["trained", "sealed", "deleted"])
def test_a_producer_resending_a_trajectory_acked_by_its_trainer_is_told_duplicate_not_applied(tmp_path, taken):
    """docs/protocol.md, "Remembered ids": once a trainer acked it, a
    producer's resend (here: a producer restarted with the same frames) is
    answered `applied: false, duplicate: true`, the same while the broker
    keeps the trained data for a resume, after a seal reclaimed it, and
    after a commit that deleted it."""
    with BrokerProcess(tmp_path) as broker:
        first = send_trajectory(broker.producer, "p", "t")
        assert [(r.applied, r.duplicate) for r in first] == [(True, False), (True, False)]
        with Consumer(broker.consumer, batch_size=1, checkpointed=taken != "deleted", keep_checkpoints=1) as trainer:
            batch = trainer.next_batch(timeout=PATIENCE)
            trainer.commit(batch)
            if taken == "sealed":
                trainer.sealed(1)
            trainer.flush(PATIENCE)
        assert batch.trajectory_ids == ("t",) and broker.status()["unsealed"] == (taken == "trained")
        again = send_trajectory(broker.producer, "p", "t")
        assert [(r.kind, r.applied, r.duplicate, r.reason) for r in again] == [("turn", False, True, None),
                                                                                ("end", False, True, None)]
        assert broker.status()["queued"] == 0  # nothing reopened
