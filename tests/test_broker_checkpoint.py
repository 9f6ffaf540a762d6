"""Trained is not finished: a checkpointing trainer's acks record its
trajectories as trained at a step, seals reclaim them, and a resume hands
back what was trained after the checkpoint, in order. `BrokerCore` driven
on a real store (restarts reopen it), with raw consumer messages."""
import pytest
from broker_helpers import end_msg, turn_msg

from rollstream.broker.core import BrokerCore, Send, Sent, drive
from rollstream.broker.engine import ENDED, TRAINED, TrainedAt
from rollstream.broker.metrics import BrokerMetrics
from rollstream.broker.recovery import rebuild
from rollstream.broker.settings import BrokerSettings
from rollstream.broker.store import Store
from rollstream.broker.store_io import StoreIO
from rollstream.common.clock import Clock
from rollstream.common.codec import decode, encode
from rollstream.common.messages import BROKER_TO_CONSUMER, BROKER_TO_PRODUCER, CONSUMER_TO_BROKER

P, C = b"producer", b"consumer"


class Node:
    """A broker core on a store in `directory`; `restart` reopens it as a new incarnation."""

    def __init__(self, directory, lease_timeout=60.0, **settings):
        self.directory, self.lease_timeout, self.now = directory, lease_timeout, 10.0
        self.settings = settings
        self.store = None
        self.restart()

    def restart(self):
        if self.store is not None:
            self.store.close()
        self.store = Store(self.directory)
        metrics = BrokerMetrics()
        self.io = StoreIO(self.store, self.directory, metrics)
        self.core = BrokerCore(BrokerSettings(data_dir=str(self.directory), lease_timeout=self.lease_timeout,
                                              **self.settings), "b", metrics, disk_reserve=0)
        self.core.restore(rebuild(self.store.open(), self.store), 0, 1 << 40)

    def run(self, steps, socket: str = "consumer") -> list:
        """Perform one core input (`drive`), the store's requests on the
        store; the messages it sent to `socket`, decoded."""
        schema = BROKER_TO_CONSUMER if socket == "consumer" else BROKER_TO_PRODUCER
        sent = []

        def send(request):
            if request.socket == socket:
                sent.append(decode(request.frames, schema))
            return Sent.TAKEN

        drive(steps, {**self.io.performers, Send: send})
        return sent

    def housekeep(self) -> None:
        """A housekeeping pass now, both halves, no consumer message waiting between them."""
        self.run(self.core.housekeeping(self.clock))
        self.run(self.core.finish_housekeeping(self.clock))

    @property
    def clock(self):
        return Clock(self.now, 1e6 + self.now)

    def producer_says(self, *messages) -> list:
        """Producer messages in one batch; the broker's answers, decoded."""
        return self.run(self.core.producer_read([(P, m, None) for m in messages], self.clock), "producer")

    def produce(self, *tids):
        messages = [m for tid in tids for m in (turn_msg(tid, 0, seq=1), end_msg(tid, seq=2))]
        self.run(self.core.producer_read([(P, m, None) for m in messages], self.clock))

    def say(self, kind, **fields) -> list:
        """One consumer message; everything the broker sent back (and delivered after it)."""
        message = decode(encode(CONSUMER_TO_BROKER, kind, fields), CONSUMER_TO_BROKER)
        out = self.run(self.core.consumer_read([(C, message, None)], self.clock))
        return out + self.run(self.core.deliver(self.clock))

    def hello(self, lineage="L1", run="R"):
        fields = {} if run is None else {"run": run, "lineage": lineage}
        [welcome] = self.say("hello", consumer_id="trainer", **fields)
        assert welcome.type == "welcome"

    def take(self, n) -> list:
        """Grant `n` credit; the deliveries, as (trajectory id, lease)."""
        return [(m["trajectory_id"], m["lease"]) for m in self.say("credit", n=n, unit="trajectory")]

    def train(self, step, taken) -> list:
        """Ack `taken` as the batch of `step`, in that order."""
        return self.say("ack", leases=[lease for _, lease in taken], trajectory_ids=[tid for tid, _ in taken],
                        step=step, positions=list(range(len(taken))))

    def state(self, tid):
        entry = self.core.engine.entries.get(tid)
        return None if entry is None else (entry.state, entry.trained)


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path / "data")
    yield n
    n.store.close()


def test_an_ack_with_a_step_keeps_the_trajectories_as_trained_across_a_restart(node):
    node.produce("a", "b", "c")
    node.hello()
    taken = node.take(2)
    [acked] = node.train(1, taken)
    assert acked.type == "acked" and sorted(acked["leases"]) == sorted(lease for _, lease in taken)
    assert [node.state(tid) for tid, _ in taken] == [(TRAINED, TrainedAt("R", "L1", 1, 0, 0)),
                                                     (TRAINED, TrainedAt("R", "L1", 1, 1, 0))]
    node.restart()
    assert [node.state(tid) for tid, _ in taken] == [(TRAINED, TrainedAt("R", "L1", 1, 0, 0)),
                                                     (TRAINED, TrainedAt("R", "L1", 1, 1, 0))]
    node.hello()
    assert [tid for tid, _ in node.take(5)] == ["c"]  # trained ones are never delivered again as new data
    assert node.core.status(node.clock)["queued"] == 0


def test_a_plain_ack_of_a_trajectory_a_step_already_recorded_is_answered_acked_and_changes_nothing(node):
    """A redelivery the consumer acks at once without a step (it had
    committed the trajectory) can reach the broker after the commit that
    recorded it as trained, settled by id: not a stale lease."""
    node.produce("a")
    node.hello()
    taken = node.take(1)
    node.train(1, taken)
    [acked] = node.say("ack", leases=["a-lease-of-an-earlier-broker"], trajectory_ids=["a"])
    assert acked.type == "acked" and acked["leases"] == ["a-lease-of-an-earlier-broker"]
    assert node.state("a") == (TRAINED, TrainedAt("R", "L1", 1, 0, 0))


def test_seals_reclaim_what_was_trained_at_or_before_the_keep_th_latest_checkpoint(node):
    node.produce("s1", "s2", "s3")
    node.hello()
    for step in (1, 2, 3):
        node.train(step, node.take(1))
    [sealed] = node.say("seal", step=1, keep=2)
    assert (sealed.type, sealed["reclaimed"]) == ("sealed", 0)  # one checkpoint kept: nothing to reclaim yet
    [sealed] = node.say("seal", step=2, keep=2)
    assert sealed["reclaimed"] == 1 and node.state("s1") is None and node.state("s2")[0] == TRAINED
    node.restart()
    node.hello()
    [sealed] = node.say("seal", step=3, keep=2)
    assert sealed["reclaimed"] == 1 and node.state("s2") is None and node.state("s3")[0] == TRAINED
    node.produce("s1")
    assert node.state("s1") is None  # remembered: a producer's resend is a duplicate, not new data


def test_a_resume_hands_back_what_was_trained_after_the_checkpoint_in_order(node):
    node.produce("a", "b", "c", "d", "e")
    node.hello("L1")
    node.train(1, node.take(1))  # a
    node.say("seal", step=1, keep=2)
    node.train(2, node.take(2))  # b c
    node.train(3, node.take(2))  # d e
    node.restart()  # both restart: the broker, and the trainer from checkpoint 1
    node.hello("L2")
    resumed, *replayed = node.say("resume", step=1, keep=2, trained=[[1, 0, "a"]])
    assert resumed.type == "resumed" and resumed["replay"] == [[2, 0, "b"], [2, 1, "c"], [3, 0, "d"], [3, 1, "e"]]
    assert [(m.type, m["trajectory_id"], m["replay"]) for m in replayed] == [
        ("deliver", tid, True) for tid in "bcde"]
    node.train(2, [(m["trajectory_id"], m["lease"]) for m in replayed[:2]])
    assert node.state("b") == (TRAINED, TrainedAt("R", "L2", 2, 0, 0))
    resumed, *_ = node.say("resume", step=1, keep=2, trained=[[1, 0, "a"]])  # sent again: only what is left
    assert resumed["replay"] == [[3, 0, "d"], [3, 1, "e"]]
    node.hello("L3")  # a third incarnation falls back to checkpoint 1 again: all of it comes back
    resumed, *_ = node.say("resume", step=1, keep=2, trained=[[1, 0, "a"]])
    assert [entry[2] for entry in resumed["replay"]] == ["b", "c", "d", "e"]


def test_a_resume_records_what_its_checkpoint_trained_even_if_the_commit_never_arrived(node):
    node.produce("a", "b")
    node.hello("L1")
    node.take(1)  # a: trained into checkpoint 1, but the trainer died before its ack left
    node.restart()
    node.hello("L2")
    [resumed] = node.say("resume", step=1, keep=2, trained=[[1, 0, "a"]])
    assert resumed["replay"] == [] and node.state("a") == (TRAINED, TrainedAt("R", "L2", 1, 0))  # epoch unknown to a resume
    assert [tid for tid, _ in node.take(5)] == ["b"]


def test_a_replay_lease_that_runs_out_is_not_queued_again(tmp_path):
    node = Node(tmp_path / "data", lease_timeout=2.0)
    node.produce("a", "b")
    node.hello("L1")
    node.train(1, node.take(1))
    node.hello("L2")
    resumed, replayed = node.say("resume", step=0, keep=2, trained=[])
    assert replayed["trajectory_id"] == "a"
    for _ in range(3):  # past the lease timeout, heartbeating
        node.now += 1.0
        node.say("heartbeat")
        node.housekeep()
    assert not node.core.dispatcher.leases
    assert node.state("a")[0] == TRAINED and [tid for tid, _ in node.take(5)] == ["b"]
    node.train(1, [("a", replayed["lease"])])  # its commit settles it by id all the same
    assert node.state("a") == (TRAINED, TrainedAt("R", "L2", 1, 0, 0))
    node.store.close()


def test_a_resume_from_a_reclaimed_checkpoint_is_refused_by_name(node):
    node.produce("a", "b")
    node.hello()
    node.train(1, node.take(1))
    node.train(2, node.take(1))
    node.say("seal", step=1, keep=1)
    node.say("seal", step=2, keep=1)
    node.hello("L2")
    [refused] = node.say("resume", step=1, keep=1, trained=[], seq=4)
    assert (refused.type, refused["code"], refused["seq"]) == ("nack", "checkpoint_gone", 4)
    assert "reclaimed what the run trained through step 2" in refused["message"]


def test_a_step_from_a_session_that_named_no_run_is_refused_and_changes_nothing(node):
    node.produce("a")
    node.hello(run=None)
    taken = node.take(1)
    [refused] = node.train(1, taken)
    assert (refused.type, refused["code"], refused["leases"]) == ("nack", "not_checkpointed", [taken[0][1]])
    assert node.state("a")[0] == ENDED
    [refused] = node.say("seal", step=1, keep=2)
    assert refused["code"] == "not_checkpointed"


def test_unsealed_data_has_its_own_budget_shown_in_status_and_past_it_the_oldest_steps_go(tmp_path):
    node = Node(tmp_path / "data")
    node.produce(*[f"t{i}" for i in range(6)])
    node.hello()
    for step in (1, 2, 3):
        node.train(step, node.take(2))
    size = node.core.engine.entries["t0"].stored_bytes
    assert size > 0 and node.core.engine.trained_bytes == 6 * size
    status = node.core.status(node.clock)
    assert (status["unsealed"], status["unsealed_bytes"], status["oldest_unsealed_step"]) == (6, 6 * size, 1)
    node.housekeep()
    assert node.core.disk.used == node.core.disk_bytes - 6 * size  # trained data does not count against producers
    node.restart()  # the figures come back from the store (its records: the frames and a table of their lengths)
    assert 6 * size <= node.core.engine.trained_bytes <= 6 * (size + 64)
    size = node.core.engine.trained_bytes / 6
    node.core.settings.max_unsealed_bytes = int(3 * size)  # down to nine tenths of it: the two oldest steps go
    node.housekeep()
    status = node.core.status(node.clock)
    assert (status["unsealed"], status["oldest_unsealed_step"]) == (2, 3)
    assert status["counters"]["trajectories.unsealed_reclaimed"] == 4
    node.hello("L2")
    [refused] = node.say("resume", step=1, keep=2, trained=[])
    assert refused["code"] == "checkpoint_gone"
    node.store.close()


def test_what_a_resume_reclaims_is_counted_and_a_step_trained_again_stays_the_oldest(node):
    node.produce("a", "b")
    node.hello("L1")
    node.train(1, node.take(1))
    node.train(2, node.take(1))
    node.hello("L2")
    resumed, replayed = node.say("resume", step=1, keep=1, trained=[[1, 0, "a"]])
    assert resumed["replay"] == [[2, 0, "b"]] and node.state("a") is None  # the only checkpoint kept is 1
    node.train(2, [("b", replayed["lease"])])
    status = node.core.status(node.clock)
    assert status["counters"]["trajectories.delivered"] == 1
    assert (status["unsealed"], status["oldest_unsealed_step"]) == (1, 2)
