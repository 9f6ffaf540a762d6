"""The `Consumer` shell against a scripted broker (a raw ROUTER): hello and
credit, heartbeats while the trainer is busy, an undecodable delivery handed
back, saying hello again after `unknown_consumer`, the ack of a committed
batch, a quarantine's refill, waiting and flushing, and the I/O thread's
failure. The decisions themselves (quarantine, expired and stale units, the
tail of a run) are the core's, in tests/test_consumer_core.py."""
import shutil
import tempfile

import msgpack
import numpy as np
import pytest
import zmq
from consumer_helpers import make_rollout

from rollstream.common.codec import decode, encode
from rollstream.common.errors import ClientFailed
from rollstream.common.messages import BROKER_TO_CONSUMER, CONSUMER_TO_BROKER
from rollstream.common.wire import encode_deliver
from rollstream.consumer import Consumer

PATIENCE = 60.0  # seconds before a wait gives up (only ever reached when something hangs)


class ScriptedBroker:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="rsb", dir="/tmp")
        self.endpoint = f"ipc://{self.dir}/c"
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.peer = None

    def expect(self, *types, timeout=10.0):
        """The next message of one of `types`, skipping heartbeats and credit
        top-ups unless asked for."""
        while True:
            if not self.sock.poll(int(timeout * 1000)):
                raise AssertionError(f"no {types} from the consumer")
            self.peer, *frames = self.sock.recv_multipart()
            message = decode(frames, CONSUMER_TO_BROKER)
            if message.type in types:
                return message
            assert message.type in ("heartbeat", "credit"), f"expected {types}, got {message.type} {dict(message.fields)}"

    def send(self, frames):
        self.sock.send_multipart([self.peer, *frames])

    def reply(self, mtype, fields):
        self.send(encode(BROKER_TO_CONSUMER, mtype, fields))

    def welcome(self):
        self.reply("welcome", {"broker_id": "scripted", "lease_timeout": 30.0, "heartbeat_interval": 0.2})

    def close(self):
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def broker():
    scripted = ScriptedBroker()
    yield scripted
    scripted.close()


def test_client_protocol_conduct(broker):
    rng = np.random.default_rng(1)
    trajectories = [make_rollout(rng, f"t{i}", sample_index=i).merged() for i in range(3)]
    consumer = Consumer(broker.endpoint, batch_size=2, prefetch=4, consumer_id="c-1")
    try:
        assert broker.expect("hello")["consumer_id"] == "c-1"
        broker.welcome()
        credit = broker.expect("credit")
        assert credit["unit"] == "trajectory" and 1 <= credit["n"] <= 4 - 2

        # the trainer is busy (nothing calls into the consumer): heartbeats keep coming
        for _ in range(3):
            broker.expect("heartbeat")

        frames = encode_deliver(trajectories[0], "L-bad")
        header = msgpack.unpackb(frames[0])
        header["crc32"] ^= 1
        broker.send([msgpack.packb(header), *frames[1:]])
        refused = broker.expect("nack")
        assert refused["leases"] == ["L-bad"] and refused["requeue"] is True and "crc_mismatch" in refused["reason"]

        broker.reply("nack", {"code": "unknown_consumer", "message": "who are you"})
        assert broker.expect("hello")["consumer_id"] == "c-1"
        broker.welcome()
        assert broker.expect("nack")["leases"] == ["L-bad"]  # never answered: resent to the new session
        broker.reply("nacked", {"leases": ["L-bad"]})

        for k, trajectory in enumerate(trajectories[1:]):
            broker.send(encode_deliver(trajectory, f"L{k}"))
        batch = consumer.next_batch(timeout=10)
        assert batch.trajectory_ids == ("t1", "t2")
        consumer.commit(batch)
        ack = broker.expect("ack")
        assert sorted(ack["leases"]) == ["L0", "L1"]
        broker.reply("acked", {"leases": ack["leases"]})
        broker.send(encode_deliver(trajectories[1], "L-again"))  # a late redelivery of a committed trajectory
        assert broker.expect("ack")["leases"] == ["L-again"]
        broker.reply("nack", {"code": "stale_lease", "message": "expired", "leases": ["L-again"]})
    finally:
        consumer.close()
    stats = consumer.stats()
    assert stats["undecodable"] == 1 and stats["duplicates"] == 1 and stats["acked"] == 2 and stats["stale_leases"] == 1
    assert stats["unsettled"] == 0


def test_a_consumer_whose_io_thread_dies_raises_client_failed(broker):
    """The same type a producer raises when its I/O loop dies."""
    def dies(now):
        raise OSError("the loop's socket broke")

    consumer = Consumer(broker.endpoint, batch_size=1, consumer_id="c-dies")
    try:
        consumer._core.due = dies
        with pytest.raises(ClientFailed, match=r"consumer 'c-dies' stopped: its I/O loop failed with OSError") as err:
            consumer.next_batch(timeout=PATIENCE)
        assert isinstance(err.value.__cause__, OSError)
        with pytest.raises(ClientFailed):
            consumer.wait_welcomed(timeout=PATIENCE)  # never welcomed
    finally:
        consumer.close()


def test_commit_of_an_unknown_batch_is_refused(broker):
    rng = np.random.default_rng(2)
    with Consumer(broker.endpoint, batch_size=1) as consumer:
        broker.expect("hello")
        broker.welcome()
        broker.expect("credit")
        broker.send(encode_deliver(make_rollout(rng, "x").merged(), "L"))
        batch = consumer.next_batch(timeout=10)
        consumer.commit(batch)
        broker.reply("acked", {"leases": broker.expect("ack")["leases"]})
        with pytest.raises(ValueError, match="not awaiting commit"):
            consumer.commit(batch)


def test_quarantine_dead_letters_a_log_prob_above_0_that_an_older_broker_stored(broker):
    """A broker recovers stored turns without checking their content again,
    so a log-prob of +0.5 an older broker took is delivered as stored: the
    consumer's batch validation refuses it, and under quarantine it is
    nacked for good (dead-lettered) while the batch goes on without it."""
    from rollstream.common.mask import SamplingMask
    from rollstream.common.trajectory import Trajectory, Turn
    from rollstream.common.validation import RULE_LOG_PROBS

    old = Trajectory("old", [1, 2])
    old.append_turn(Turn(np.array([5], np.int32), np.array([0.5], np.float32), None, SamplingMask.from_supports([[5]])))
    old.reward = 0.0
    good = make_rollout(np.random.default_rng(4), "good").merged()
    with Consumer(broker.endpoint, batch_size=1, vocab_size=1000, on_invalid="quarantine") as consumer:
        broker.expect("hello")
        broker.welcome()
        broker.expect("credit")
        broker.send(encode_deliver(old, "L-old"))
        broker.send(encode_deliver(good, "L-good"))
        batch = consumer.next_batch(timeout=10)
        assert batch.trajectory_ids == ("good",)
        refused = broker.expect("nack")
        assert refused["leases"] == ["L-old"] and refused["requeue"] is False
        assert RULE_LOG_PROBS in refused["reason"] and "log_prob is 0.5" in refused["reason"]
        broker.reply("nacked", {"leases": ["L-old"]})
        consumer.commit(batch)
        broker.reply("acked", {"leases": broker.expect("ack")["leases"]})


def test_wait_welcomed_returns_once_welcomed_and_flush_once_the_broker_confirms_commits(broker):
    rng = np.random.default_rng(4)
    with Consumer(broker.endpoint, batch_size=1) as consumer:
        with pytest.raises(TimeoutError, match=f"no welcome within 0.3 s from .*{broker.endpoint}"):
            consumer.wait_welcomed(timeout=0.3)
        broker.expect("hello")
        broker.welcome()
        consumer.wait_welcomed(timeout=10)
        broker.expect("credit")
        broker.send(encode_deliver(make_rollout(rng, "f").merged(), "L-f"))
        consumer.commit(consumer.next_batch(timeout=10))
        ack = broker.expect("ack")
        with pytest.raises(TimeoutError, match="1 settlement"):
            consumer.flush(timeout=0.3)  # sent, not yet confirmed
        broker.reply("acked", {"leases": ack["leases"]})
        consumer.flush(timeout=10)
        assert consumer.stats()["unsettled"] == 0 and consumer.stats()["acked"] == 1


def test_committing_a_batch_that_is_not_awaiting_commit_says_so_even_with_a_step(tmp_path):
    from consumer_helpers import deliveries

    from rollstream.common.errors import InvalidInput
    from rollstream.consumer import Batch

    stranger = Batch.from_deliveries(deliveries(np.random.default_rng(0), 1), seq=99)
    checkpointing = Consumer(f"ipc://{tmp_path}/nobody", batch_size=1)
    deleting = Consumer(f"ipc://{tmp_path}/nobody", batch_size=1, checkpointed=False)
    try:
        with pytest.raises(InvalidInput, match="batch seq=99 is not awaiting commit here"):
            checkpointing.commit(stranger, step=3)
        with pytest.raises(InvalidInput, match="commit takes a step only when checkpointed"):
            deleting.commit(stranger, step=3)
    finally:
        checkpointing.close(timeout=0)
        deleting.close(timeout=0)


def test_a_consumer_over_more_brokers_than_zmqs_default_socket_limit_makes_a_context_with_room(broker, monkeypatch):
    """400 brokers take 1,202 sockets, past the 1,023 of zmq's shared
    context: the consumer makes a context of its own with room, raises the
    soft limit on open files where the hard limit allows, and still talks to
    the one broker that answers. A hard limit too low is refused by name."""
    import resource

    silent = [f"ipc://{broker.dir}/nobody-{i}" for i in range(399)]  # nothing binds these: connects just wait
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        with Consumer([broker.endpoint, *silent], batch_size=1, vocab_size=1000, device="cpu") as consumer:
            assert consumer._own_context and consumer._context is not zmq.Context.instance()
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 2 * 1202
            broker.expect("hello", timeout=PATIENCE)
            broker.welcome()
            assert broker.expect("credit", timeout=PATIENCE)["n"] >= 1
        assert consumer._context.closed
        monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 2000))
        with pytest.raises(ValueError, match=r"open files for every socket.*hard limit is 2000"):
            Consumer([broker.endpoint, *silent], batch_size=1, vocab_size=1000, device="cpu")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
