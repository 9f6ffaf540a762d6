"""Exactly-once across restarts: scenarios that cross a broker restart with
a trainer kill, with real broker and trainer processes on ipc://."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
from broker_process import BrokerProcess
from consumer_helpers import VOCAB, RawProducer, clean, make_rollout
from waiting import wait_for

from rollstream.consumer.client import Consumer

# A trainer that takes one batch, waits for the word, commits it, waits for
# the broker's confirmation and kills itself at once (the window between a
# commit and the next checkpoint, made as narrow as it gets).
TRAINER = textwrap.dedent("""
    import os, pathlib, signal, sys, time
    from rollstream.common.errors import TimedOut
    from rollstream.consumer.client import Consumer
    endpoint, work, n = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3])
    consumer = Consumer(endpoint, batch_size=n, prefetch=n + 1, vocab_size={vocab})
    batch = consumer.next_batch(timeout=60)
    (work / "taken.tmp").write_text(" ".join(batch.trajectory_ids))
    os.replace(work / "taken.tmp", work / "taken")  # whole when it appears: the test reads it at once
    while not (work / "go").exists():
        time.sleep(0.02)
    consumer.commit(batch)
    (work / "committed").write_text("")
    try:
        consumer.flush(timeout=60)
    except TimedOut:
        pass
    os.kill(os.getpid(), signal.SIGKILL)
""").format(vocab=VOCAB)


def test_a_commit_after_a_broker_restart_settles_by_id_so_a_killed_trainer_gets_nothing_twice(tmp_path):
    """The deterministic stale-lease scenario: the trainer holds a batch
    when the broker is killed (its leases die with that incarnation),
    commits it while the broker is down, and is killed as soon as the
    restarted broker has answered; a new trainer starts. With the commit
    settling by trajectory id the batch is gone; with leases alone the
    commit changes nothing, the batch comes back and is trained a second
    time."""
    n = 4
    rng = np.random.default_rng(7)
    broker = BrokerProcess(tmp_path / "broker", lease_timeout=600).start()
    trainer = None
    try:
        producer = RawProducer(broker.producer)
        producer.send([make_rollout(rng, f"t{i}", sample_index=i) for i in range(n)])
        producer.close()
        work = tmp_path / "trainer"
        work.mkdir()
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, broker.consumer, str(work), str(n)],
                                   stdout=subprocess.DEVNULL, stderr=open(work / "log", "wb"))
        wait_for(lambda: (work / "taken").exists(), 60, "the trainer to take its batch")
        trained = set((work / "taken").read_text().split())
        assert len(trained) == n
        broker.kill()  # the batch's leases die with this incarnation
        (work / "go").write_text("")
        wait_for(lambda: (work / "committed").exists(), 60, "the trainer to commit")
        broker.start()
        assert trainer.wait(60) == -signal.SIGKILL
        with Consumer(broker.consumer, batch_size=1, vocab_size=VOCAB) as again:
            again.wait_welcomed(30)
            received = []
            try:
                while True:
                    received += again.next_batch(timeout=3).trajectory_ids
            except TimeoutError:
                pass
        assert not set(received) & trained, f"trained twice: {sorted(set(received) & trained)}"
        status = broker.status()
        assert (status["queued"], status["leased"]) == (0, 0), status
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
        broker.__exit__()


# -- the trainer's checkpoint: real pipelines (rollstream.app.harness) ----------------------------------------------
FAST_BROKER = ("--heartbeat-interval", "0.5")
FAST_PRODUCER = ("--heartbeat-interval", "0.5", "--heartbeat-timeout", "2")


def checkpointed_run(*, trajectories: int, broker_kill_at: float | None = None, **trainer_faults):
    """One producer, a trainer of two ranks checkpointing every step with
    `trainer_faults` on its first start (restarted, resuming, once it dies),
    and a broker kill once `broker_kill_at` of the plan is acked; the
    checker's report, with the faults done."""
    from rollstream.app.harness import VOCAB, LoopbackNode, Pipeline

    done = []
    with LoopbackNode("rs-ckpt-", VOCAB, broker_args=FAST_BROKER) as node:
        pipeline = Pipeline(node, dp_size=2, batch_size=2)
        pipeline.trainer.start(**trainer_faults)
        pipeline.trainer.wait_welcomed(60)
        pipeline.add_producer(0, trajectories=trajectories, extra=("--rate", "20", *FAST_PRODUCER))

        def inject() -> None:
            if broker_kill_at is not None and "broker" not in done and pipeline.counts.acked >= broker_kill_at * trajectories:
                node.kill_broker()
                node.restart_broker()
                done.append("broker")
            if pipeline.trainer.lost:
                pipeline.trainer.restart()
                done.append("trainer")

        drained = pipeline.run(240, inject)
        report = pipeline.finish()
    assert drained, f"not drained: status {pipeline.status}, counts {pipeline.counts}"
    assert report.counts() == clean(report), report.summary()
    return report, done


def test_a_trainer_killed_between_a_commit_and_its_next_checkpoint_trains_those_batches_again_as_they_were():
    report, done = checkpointed_run(trajectories=24, die_after_commit=3)
    assert done == ["trainer"]
    assert report.resumed_from_step == 2 and report.replayed >= 1 and report.replayed_batches_identical is True
    assert report.lineage()["lineage_lost"] == report.lineage()["lineage_duplicated"] == 0


def test_a_trainer_killed_after_saving_a_checkpoint_and_before_sealing_it_loses_nothing():
    report, done = checkpointed_run(trajectories=24, die_before_seal=2)
    assert done == ["trainer"]
    assert report.resumed_from_step == 2 and report.replayed == 0  # its checkpoint holds everything it trained
    assert report.acked == report.committed


def test_a_broker_restart_and_a_trainer_resume_together():
    report, done = checkpointed_run(trajectories=32, broker_kill_at=0.4, die_after_commit=4)
    assert sorted(done) == ["broker", "trainer"]
    assert report.resumed_from_step == 3 and report.replayed_batches_identical is True
