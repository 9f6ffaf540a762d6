"""What keeps the broker's periodic work proportional to what changed, not
to what it holds: the merge engine's indexes (counts by state, bytes in
memory, recency for expiry and eviction), the dispatcher's queue count, and
the receive path that keeps a held frame from pinning a shared buffer.
Each index is checked against a count made from scratch."""
import contextlib
import random
import time
from collections import Counter, OrderedDict
from types import SimpleNamespace

import numpy as np
import pytest
import zmq
from broker_helpers import abort_msg, end_msg, reward_msg, turn_msg

from rollstream.broker.dispatch import Dispatcher, DispatchSettings
from rollstream.broker.engine import (
    DEAD,
    ENDED,
    OPEN,
    SCORING,
    UNTRAINED,
    DeliveryUnit,
    EngineSettings,
    MergeEngine,
    _idle_since,
    held_bytes,
)
from rollstream.broker.flow import WindowGrants
from rollstream.broker.recovery import load_trajectory, rebuild
from rollstream.broker.service import BrokerService
from rollstream.broker.settings import BrokerSettings
from rollstream.broker.store import Store
from rollstream.common.clock import Clock
from rollstream.common.codec import decode, encode
from rollstream.common.jobs import job_of
from rollstream.common.messages import BROKER_TO_CONSUMER, CONSUMER_TO_BROKER, PRODUCER_TO_BROKER
from rollstream.common.sockets import SHARED_RECEIVE_BUFFER_BYTES, recv_parts, recv_routed
from rollstream.common.trajectory import Trajectory, Turn
from rollstream.common.wire import encode_turn


def check_indexes(engine: MergeEngine) -> None:
    """The engine's kept figures against the entries, counted from scratch."""
    entries = engine.entries.values()
    assert engine.counts() == {**dict.fromkeys(("open", "ended", "dead", "left", "trained", "scoring"), 0),
                               **Counter(e.state for e in entries)}
    assert +engine.untrained == Counter(job_of(e.trajectory_id) for e in entries if e.state in UNTRAINED)
    assert engine.bytes_in_memory == sum(held_bytes(e.trajectory) for e in entries if e.trajectory is not None)
    assert engine.evicted_open() == {e.trajectory_id for e in entries if e.state == OPEN and engine.needs_reload(e)}
    awaiting = [e for e in entries if e.state == ENDED and e.group_id in engine.groups
                and not engine.groups[e.group_id].deliverable]
    assert engine.awaiting_group() == len(awaiting)


@pytest.mark.parametrize("seed", range(6))
def test_counts_bytes_and_evictions_follow_every_change(seed, tmp_path):
    """Random frames, consumer outcomes, expiry and evictions (with reads
    back from a real store), the indexes checked after each."""
    rng = random.Random(seed)
    store = Store(tmp_path / "data")
    store.open()
    engine = MergeEngine(EngineSettings(trajectory_ttl=50.0, dedup_window=1000.0))

    def apply(effects):
        store.commit(list(effects))
        engine.saved()

    now, made, observed, shed_seen, awaited = 0.0, 0, set(), False, False
    for _ in range(300):
        now += rng.random()
        by_state = {state: [t for t, e in engine.entries.items() if e.state == state]
                    for state in (OPEN, ENDED, DEAD, SCORING)}
        # only what the dispatcher could hold: a group's members once the group is deliverable (or closed: revived)
        groups = [engine.groups.get(engine.entries[t].group_id or "") for t in by_state[ENDED]]
        by_state[ENDED] = [t for t, g in zip(by_state[ENDED], groups) if g is None or g.deliverable]
        action = rng.choice(["start", "start", "start", "turn", "turn", "turn", "end", "abort", "deliver", "dead", "revive",
                             "evict", "reload", "expire", "end_unscored", "reward"])
        if action == "start":
            made += 1
            group = (f"g{made // 3}", 3) if rng.random() < 0.3 else None
            apply(engine.handle(turn_msg(f"t{made}", 0, [5] * rng.randint(1, 9), forced=[7] * rng.randint(0, 3),
                                         group=group), now).effects)
        elif action == "turn" and by_state[OPEN]:
            tid = rng.choice(by_state[OPEN])
            supports = [[5, 6]] * rng.randint(1, 9) if rng.random() < 0.5 else None
            n = len(supports) if supports else rng.randint(1, 9)
            apply(engine.handle(turn_msg(tid, engine.entries[tid].next_turn, [5] * n, supports=supports), now).effects)
        elif action == "end" and by_state[OPEN]:
            apply(engine.handle(end_msg(rng.choice(by_state[OPEN])), now).effects)
        elif action == "end_unscored" and by_state[OPEN]:  # its reward comes later
            apply(engine.handle(end_msg(rng.choice(by_state[OPEN]), reward=None), now).effects)
        elif action == "reward" and by_state[SCORING]:
            apply(engine.handle(reward_msg(rng.choice(by_state[SCORING]), 0.5), now).effects)
        elif action == "abort" and by_state[OPEN]:
            apply(engine.handle(abort_msg(rng.choice(by_state[OPEN])), now).effects)
        elif action == "deliver" and by_state[ENDED]:
            apply(engine.delivered(rng.choice(by_state[ENDED]), now))
        elif action == "dead" and by_state[ENDED]:
            apply(engine.dead_letter(rng.choice(by_state[ENDED]), "refused", now))
        elif action == "revive" and by_state[DEAD]:
            apply(engine.revive(rng.choice(by_state[DEAD]), now))
        elif action == "evict":
            engine.evict(rng.randint(0, max(1, engine.bytes_in_memory)))
        elif action == "reload":
            stale = [e for e in engine.entries.values() if e.state in (OPEN, ENDED) and engine.needs_reload(e)]
            if stale:
                entry = rng.choice(stale)
                engine.reload(entry, load_trajectory(store, store.load_one(entry.trajectory_id)))
        elif action == "expire":
            apply(engine.expire(now + rng.choice([0.0, 30.0])))
        check_indexes(engine)
        awaited |= engine.awaiting_group() > 0
        observed |= {e.state for e in engine.entries.values()}
        shed_seen |= bool(engine.evicted_open())
    assert made > 30 and {OPEN, ENDED, DEAD} <= observed and shed_seen
    assert awaited
    store.close()
    store = Store(tmp_path / "data")
    restored = MergeEngine(EngineSettings(trajectory_ttl=50.0, dedup_window=1000.0))
    restored.restore(*rebuild(store.open(), store).engine_state())
    check_indexes(restored)
    assert restored.awaiting_group() == engine.awaiting_group()
    store.close()


def test_an_engine_restored_from_entries_is_indexed_and_refuses_to_restore_twice():
    engine = MergeEngine()
    engine.handle(turn_msg("a", 0, [5, 5]), 1.0)
    engine.handle(turn_msg("b", 0, [5]), 2.0)
    engine.handle(end_msg("b"), 3.0)
    fresh = MergeEngine()
    units = fresh.restore(list(engine.entries.values()), (), {}, {"a": 0, "b": 1})  # as recovery hands them over
    check_indexes(fresh)
    assert fresh.counts()[OPEN] == 1 and fresh.bytes_in_memory == engine.bytes_in_memory > 0
    assert [unit.trajectory_ids for unit in units] == [("b",)]
    with pytest.raises(ValueError, match="fills an empty engine"):
        fresh.restore([], (), {}, {})


def test_expiry_counts_from_the_last_frame_in_the_order_trajectories_went_idle():
    engine = MergeEngine(EngineSettings(trajectory_ttl=10.0))
    for i, tid in enumerate(["first", "second", "third"]):
        engine.handle(turn_msg(tid, 0), float(i))
    engine.handle(turn_msg("first", 1), 8.0)  # continued: now the most recent
    expired = engine.expire(12.5)
    assert sorted(e.trajectory_id for e in expired) == ["second", "third"]
    assert engine.entries["first"].state == OPEN and engine.counts()[DEAD] == 2
    assert [e.trajectory_id for e in engine.expire(18.5)] == ["first"]


def test_idle_groups_are_made_deliverable_in_the_order_they_went_idle():
    engine = MergeEngine(EngineSettings(trajectory_ttl=10.0))
    engine.handle(turn_msg("a1", 0, group=("G1", 3)), 0.0)
    engine.handle(turn_msg("b1", 0, group=("G2", 3)), 1.0)
    engine.handle(abort_msg("b1"), 2.0)
    engine.handle(abort_msg("a1"), 8.0)  # G1 was touched last
    engine.expire(12.5)
    assert "G2" not in engine.groups and "G1" in engine.groups
    engine.expire(18.5)
    assert not engine.groups
    check_indexes(engine)


def test_expiry_looks_no_further_than_the_first_recent_entry():
    """The idle scan stops at the first entry updated since the cutoff, so a
    pass over 50,000 busy trajectories reads one (an entry behind it that
    is older cannot exist: every update moves its entry to the back)."""
    ordered = OrderedDict((name, SimpleNamespace(updated_at=at)) for name, at in [("a", 1.0), ("b", 5.0), ("c", 2.0)])
    assert [key for key, _ in _idle_since(ordered, 3.0)] == ["a"]
    assert _idle_since(ordered, 0.5) == []


def test_eviction_takes_ready_ones_newest_first_then_open_ones_least_recently_continued_then_leased_ones():
    """Consumers take ready ones oldest first: the newest are needed last.
    Leased ones are mostly acked before they are needed again."""
    engine = MergeEngine()
    for i, tid in enumerate(["o1", "o2", "r1", "l1", "r2", "l2"]):
        engine.handle(turn_msg(tid, 0, [5] * 100), float(i))
    for tid in ["r1", "l1", "r2", "l2"]:
        engine.handle(end_msg(tid), 10.0)
    engine.handle(turn_msg("o1", 1, [5] * 100), 11.0)  # o2 is now the least recently continued
    order = []

    def in_memory():
        return {t for t, e in engine.entries.items() if not engine.needs_reload(e)}

    while True:
        held = in_memory()
        engine.evict(engine.bytes_in_memory - 1, leased={"l1", "l2"})
        gone = held - in_memory()
        if not gone:
            break
        order += sorted(gone)
    assert order == ["r2", "r1", "o2", "o1", "l2", "l1"]
    assert in_memory() == set() and engine.evicted_open() == {"o1", "o2"} and engine.bytes_in_memory == 0
    assert engine.entries["o1"].trajectory.is_shed and engine.entries["r1"].trajectory is None
    check_indexes(engine)


def test_a_trajectory_knows_its_size_before_and_after_its_turns_are_written():
    traj = Trajectory("t", [1, 2, 3])
    traj.append_turn(Turn.build([4, 5], [-0.1, -0.2], supports=[[4, 9], [5]], forced_tokens=[6, 7, 8]))
    traj.append_turn(Turn.build([9], [-0.3], supports=[[9, 1, 2]]))
    pending = traj.nbytes
    written = sum(array.nbytes for array in traj.arrays().values())  # reading writes the pending turns
    assert pending == traj.nbytes == written


def test_dispatcher_keeps_its_queue_count_through_splits_retracts_and_requeues():
    dispatcher = Dispatcher(DispatchSettings(max_deliveries=5))

    def check():
        assert dispatcher.queued_trajectories == sum(dispatcher.queued().values())

    dispatcher.enqueue(DeliveryUnit(("a", "b", "c"), "g", 3))
    dispatcher.enqueue(DeliveryUnit(("d",)))
    dispatcher.hello(b"c1", "c1", 0.0)
    dispatcher.credit(b"c1", 2, "trajectory")
    deliveries = dispatcher.deliveries(0.0)  # takes two of the group's three: the rest goes back in front
    check()
    assert [d.trajectory_id for d in deliveries] == ["a", "b"] and dispatcher.queued_trajectories == 2
    dispatcher.retract([deliveries[0].lease])
    check()
    settled, _ = dispatcher.end_leases([deliveries[1].lease])
    dispatcher.requeue(settled)
    check()
    assert dispatcher.queued_trajectories == 4


def test_small_received_frames_are_copied_out_and_large_ones_kept_zero_copy_by_either_end():
    context = zmq.Context()
    try:
        server = context.socket(zmq.ROUTER)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = context.socket(zmq.DEALER)
        client.connect(f"tcp://127.0.0.1:{port}")
        small, large = b"s" * 100, np.ones(SHARED_RECEIVE_BUFFER_BYTES + 1, np.uint8).tobytes()
        client.send_multipart([b"header", small, large])
        assert server.poll(10_000)
        identity, header, got_small, got_large = recv_routed(server)
        assert type(header) is bytes and type(got_small) is bytes and got_small == small
        assert isinstance(got_large, memoryview) and got_large.tobytes() == large
        # The other way, to a DEALER (consumers and producers): the same parts, each kept the same way.
        server.send_multipart([identity, b"reply", large, small])
        server.send_multipart([identity, b"second"])
        assert client.poll(10_000)
        reply, got_large, got_small = recv_parts(client)
        assert reply == b"reply" and type(got_small) is bytes and got_small == small
        assert isinstance(got_large, memoryview) and got_large.tobytes() == large
        assert client.poll(10_000) and recv_parts(client) == [b"second"]
        with pytest.raises(zmq.Again):
            recv_parts(client)
    finally:
        context.destroy(linger=0)


@contextlib.contextmanager
def driven_service(tmp_path, **settings):
    """A broker service on inproc endpoints that the test drives itself
    (`run_once`, and housekeeping passes through `_housekeep`), with the time it chooses."""
    context = zmq.Context()
    service = BrokerService(BrokerSettings(producer_endpoint="inproc://p", consumer_endpoint="inproc://c",
                                           admin_endpoint="inproc://a", data_dir=str(tmp_path / "data"),
                                           metrics_port=0, **settings), context=context)
    service.start()
    try:
        yield service, context
    finally:
        service.close()
        context.destroy(linger=0)


def test_a_long_pass_does_not_drop_a_consumer_whose_heartbeats_wait_unread(tmp_path):
    """A consumer holding a lease, whose heartbeat arrives while the broker
    is busy: when housekeeping next runs, long after 3 heartbeat intervals,
    it reads the waiting heartbeat between its halves, before judging the
    consumer silent; the consumer and its lease stay. (Heartbeat intervals
    of 30 s leave setting up a minute and a half on a busy machine.)"""
    with driven_service(tmp_path, heartbeat_interval=30.0, lease_timeout=3600.0) as (service, context):
        settings = service.settings
        consumer, producer = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        consumer.connect("inproc://c")
        producer.connect("inproc://p")
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "trainer"}))
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 1, "unit": "trajectory"}))
        for message in (turn_msg("a", 0, seq=0), end_msg("a", seq=1)):
            producer.send_multipart(message.frames)
        deadline = time.monotonic() + 60
        while not service.core.dispatcher.leases and time.monotonic() < deadline:
            service.run_once(timeout_ms=50)
        [lease] = service.core.dispatcher.leases
        now = Clock.read()
        # the wall clock jumps (NTP): nobody is dropped
        service._housekeep(now._replace(wall=now.wall + 3600))
        assert len(service.core.dispatcher.consumers) == 1
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "heartbeat", {}))
        assert service.sockets["consumer"].poll(10_000), "the heartbeat never reached the broker's socket"  # not read
        later = Clock(now.mono + 10 * settings.heartbeat_interval, now.wall)  # only the monotonic clock runs liveness
        service._housekeep(later)
        assert len(service.core.dispatcher.consumers) == 1 and lease in service.core.dispatcher.leases
        silent = later._replace(mono=later.mono + 10 * settings.heartbeat_interval)
        service._housekeep(silent)  # silent: dropped, its lease requeued
        assert not service.core.dispatcher.consumers and not service.core.dispatcher.leases


def test_a_leased_trajectory_is_evicted_last_and_read_back_when_delivered_again(tmp_path):
    """Over the budget with one trajectory out on a lease and another
    arriving, the broker evicts the open one and then the leased one
    rather than pause producers: a consumer's prefetch does not hold memory.
    Given back, the leased one is read back from the store and delivered
    again as it was."""
    with driven_service(tmp_path, max_memory_bytes=20_000) as (service, context):
        service._next_housekeeping = float("inf")

        def until(sock, schema, wanted):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                service.run_once(timeout_ms=20)
                while sock.poll(0):
                    message = decode(sock.recv_multipart(), schema)
                    if message.type == wanted:
                        return message
            raise AssertionError(f"no {wanted} within 10 s")

        consumer, producer = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        consumer.connect("inproc://c")
        producer.connect("inproc://p")
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "trainer"}))
        until(consumer, BROKER_TO_CONSUMER, "welcome")
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 1, "unit": "trajectory"}))
        tokens = np.arange(3000, dtype=np.int32)
        turn = Turn.build(tokens, np.full(3000, -0.5, np.float32))  # about 30 KB held
        producer.send_multipart(encode_turn("a", 0, turn, seq=0, prompt_tokens=np.ones(4, np.int32)))
        producer.send_multipart(encode(PRODUCER_TO_BROKER, "end", {"seq": 1, "trajectory_id": "a", "reward": 1.0}))
        first = until(consumer, BROKER_TO_CONSUMER, "deliver")
        engine = service.core.engine
        assert not engine.needs_reload(engine.entries["a"])  # leased, and within the budget: kept
        producer.send_multipart(encode_turn("b", 0, turn, seq=2, prompt_tokens=np.ones(4, np.int32)))
        deadline = time.monotonic() + 10
        while "b" not in engine.entries and time.monotonic() < deadline:
            service.run_once(timeout_ms=20)
        assert engine.evicted_open() == {"b"} and engine.needs_reload(engine.entries["a"])
        assert service.core.memory.reading and engine.bytes_in_memory <= 20_000
        reloads = service.metrics.totals["reloads"]
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "nack", {"leases": [first["lease"]], "reason": "test",
                                                                    "requeue": True}))
        until(consumer, BROKER_TO_CONSUMER, "nacked")
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 1, "unit": "trajectory"}))
        again = until(consumer, BROKER_TO_CONSUMER, "deliver")
        assert again["trajectory_id"] == "a" and again["delivery_count"] == 2
        assert again.arrays["tokens"].tolist() == tokens.tolist()
        assert {name: values.tolist() for name, values in again.arrays.items()} == {
            name: values.tolist() for name, values in first.arrays.items()}
        assert service.metrics.totals["reloads"] == reloads + 1


def test_a_rebuild_reads_its_turns_opening_each_segment_once(tmp_path, monkeypatch):
    """Twelve turns of one trajectory, interleaved with another's and spread
    over two segment files: rebuilding it opens two files, not twelve, and
    gives back every token in order."""
    from rollstream.broker import store as store_module
    from rollstream.common import segments as segments_module

    store = store_module.Store(tmp_path / "data")
    store.open()
    engine = MergeEngine()
    for index in range(12):
        for tid in ("a", "b"):
            reply = engine.handle(turn_msg(tid, index, [index] * 20), 1.0)
            store.commit(list(reply.effects))
    store.segments.rotate()  # later records land in a second file
    for index in range(12, 14):
        store.commit(list(engine.handle(turn_msg("a", index, [index] * 20), 1.0).effects))
    opened = []
    real_open = segments_module.os.open
    monkeypatch.setattr(segments_module.os, "open", lambda path, *a: (opened.append(path), real_open(path, *a))[1])
    rebuilt = load_trajectory(store, store.load_one("a"))
    assert rebuilt.tokens.tolist() == [i for i in range(14) for _ in range(20)]
    assert len(opened) == 2
    store.close()


def test_grants_share_the_bound_and_a_late_joiner_starts_with_what_is_left():
    grants = WindowGrants(window=256, max_in_flight=1024)
    early = [f"p{i}".encode() for i in range(4)]
    grants.active(4)
    assert [grants.grant(p) for p in early] == [256] * 4  # the whole bound is told
    late = [f"q{i}".encode() for i in range(4)]
    grants.active(8)
    assert [grants.grant(q) for q in late] == [1] * 4  # nothing left over: one frame each until the others shrink
    assert [grants.grant(p) for p in early] == [128] * 4  # their next answers tell them the fair share
    assert [grants.grant(q) for q in late] == [128] * 4  # and the room they left goes to the late ones
    assert grants.told == 1024
    grants.forget(early[0])
    grants.active(7)
    assert grants.grant(late[0]) == 146 and grants.told <= 1024


def test_grants_never_tell_more_than_the_bound_plus_one_frame_per_connection():
    rng = random.Random(7)
    grants = WindowGrants(window=64, max_in_flight=200)
    connections: list[bytes] = []
    for _ in range(2000):
        if not connections or rng.random() < 0.05:
            connections.append(f"c{len(connections)}".encode())
        elif rng.random() < 0.02:
            grants.forget(connections.pop(rng.randrange(len(connections))))
        grants.active(len(connections))
        if connections:
            assert 1 <= grants.grant(rng.choice(connections)) <= 64
        assert grants.told <= 200 + len(connections)


@pytest.mark.parametrize("limit, per_batch", [(0, [1, 1, 1, 1, 1]), (20_000, [1, 1, 1, 1, 1]), (60_000, [3, 2]),
                                              (1 << 30, [5])])
def test_a_read_takes_no_more_frames_once_it_holds_read_max_bytes(tmp_path, limit, per_batch):
    """Five 24 KB turns waiting: each read takes frames until it holds
    `read_max_bytes` (the frame that crosses it is the last), and always at least one."""
    with driven_service(tmp_path, read_max_bytes=limit) as (service, context):
        producer = context.socket(zmq.DEALER)
        producer.connect("inproc://p")
        turn = Turn.build(np.arange(3000, dtype=np.int32), np.zeros(3000, np.float32))
        for i in range(5):
            producer.send_multipart(encode_turn(f"t{i}", 0, turn, seq=i, prompt_tokens=np.ones(4, np.int32)))
        # Waiting at the broker's socket, not read: inproc flushes each message as it is sent, so once the first is
        # readable all five are.
        assert service.sockets["producer"].poll(10_000), "the turns never reached the broker's socket"
        taken = []
        while sum(taken) < 5 and len(taken) < 10:
            before = len(service.core.engine.entries)
            service._serve_producers(Clock.read())
            taken.append(len(service.core.engine.entries) - before)
        assert taken == per_batch
