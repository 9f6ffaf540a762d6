"""The synthetic source's policy versions and rewards: the version its
trainer last wrote, rewards in levels whose top grows likelier as that
version rises (so groups tie more and more, as a learning policy's do);
and, against a live broker, a turn the broker refuses: its trajectory is
given up, never continued with a later turn under the refused index."""
import asyncio
import threading

import msgpack
import numpy as np
import pytest
import zmq
from test_broker_faults import threaded_broker
from test_internal_failures import Bug
from test_producer_live import PATIENCE

from rollstream.common.checker import broker_backlog, check, read_records
from rollstream.consumer import Consumer
from rollstream.producer import AsyncProducer
from rollstream.producer.settings import ProducerSettings
from rollstream.producer.source import drive
from rollstream.producer.synthetic import SyntheticSource


def source(tmp_path, **settings) -> SyntheticSource:
    return SyntheticSource(ProducerSettings(vocab_size=1000, **settings), "p")


def test_the_version_is_the_label_the_trainer_last_wrote(tmp_path):
    assert source(tmp_path).version() is None  # no version file: unversioned turns, as before
    path = tmp_path / "policy.version"
    versioned = source(tmp_path, version_file=str(path))
    assert versioned.version() == "0"  # not written yet: the initial weights
    path.write_text("7")
    assert versioned.version() == "7"
    path.write_text("e1:9")  # after a resume the label names the lineage epoch
    assert versioned.version() == "e1:9"
    path.write_text("")  # being replaced
    assert versioned.version() == "0"


def test_rewards_in_levels_reach_the_top_more_often_as_the_version_rises(tmp_path):
    levels, rng = source(tmp_path, reward_levels=3, seed=1), np.random.default_rng(1)
    early = [levels.reward(rng, "step-0") for _ in range(4000)]
    late = [levels.reward(rng, "step-4") for _ in range(4000)]
    assert set(early) == {0.0, 0.5, 1.0}
    # the top level with chance 1 - 2^-(v+1): 0.5 at version 0, 0.97 at version 4
    assert abs(np.mean(np.array(early) == 1.0) - 0.5) < 0.03
    assert abs(np.mean(np.array(late) == 1.0) - 0.96875) < 0.01
    continuous = source(tmp_path).reward(rng, None)
    assert 0.0 <= continuous < 1.0 and continuous not in (0.0, 0.5, 1.0)


def admin(context, request: str) -> dict:
    """One admin request to the threaded broker and its reply."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("inproc://a")
    try:
        sock.send(msgpack.packb({"v": 1, "type": request}))
        assert sock.poll(int(PATIENCE * 1000)), f"no reply to admin {request}"
        return msgpack.unpackb(sock.recv())
    finally:
        sock.close()


@pytest.mark.parametrize("window, released", [(1, "at once"), (64, "once the episode returned")])
def test_a_turn_the_broker_refuses_gives_its_trajectory_up_and_no_later_turn_takes_its_index(tmp_path, window, released):
    """The broker refuses turn 1 of the first trajectory (`internal`) while
    the source streams on without waiting for receipts: with a window of one
    frame its turn 2 waits for room and is taken only after the refusal
    rewound the handle to turn 1; with a wide window the refusal comes once
    all its turns and its end were taken. Either way the trajectory is
    given up (aborted, `given_up` in the ledger) rather than delivered with
    script turn 2 as its turn 1, or left open behind an end the broker
    refuses; the others are trained and the checker reads zero."""
    refused, gate = [], threading.Event()
    if released == "at once":
        gate.set()
    trajectories = 3
    with threaded_broker(tmp_path, vocab_size=1000) as (service, _thread, context):
        original = service.core.engine._handle  # every message's, alone or in a turn stretch

        def handle(message, *args, **kwargs):  # on the broker's thread
            if message.type == "turn" and message.get("turn") == 1 and not refused:
                refused.append(message["trajectory_id"])
                gate.wait(PATIENCE)
                raise Bug(f"injected while handling turn 1 of {message['trajectory_id']}")
            return original(message, *args, **kwargs)

        service.core.engine._handle = handle
        settings = ProducerSettings(vocab_size=1000, trajectories=trajectories, turns=3, prompt_tokens=6,
                                    response_tokens=6, tool_tokens=2, concurrency=1, seed=7, window=window)
        synthetic = SyntheticSource(settings, "roller")

        async def episode(traj, job, stopping):
            try:
                return await synthetic.episode(traj, job, stopping)
            finally:
                gate.set()

        async def produce():
            async with AsyncProducer("inproc://p", "roller", context=context, window=window, vocab_size=1000,
                                     ledger=tmp_path / "producer.jsonl") as producer:
                await drive(producer, settings, synthetic.prompts, episode, stopping=asyncio.Event(),
                            continues=synthetic.continues)
                assert await producer.flush(PATIENCE), "the producer's frames were not all settled"
                return producer.metrics.totals

        totals = asyncio.run(produce())
        with Consumer("inproc://c", batch_size=1, vocab_size=1000, ledger=tmp_path / "consumer.jsonl",
                      context=context) as consumer:
            for _ in range(trajectories - 1):
                consumer.commit(consumer.next_batch(timeout=PATIENCE))
            consumer.flush(PATIENCE)
        status, dead = admin(context, "status"), admin(context, "dead_letters")["items"]
    records = read_records([tmp_path / "producer.jsonl", tmp_path / "consumer.jsonl"])
    [tid] = refused
    issued = {record["id"] for record in records if record["kind"] == "issued"}
    committed = {record["id"] for record in records if record["kind"] == "committed"}
    given_up = [(record["id"], record["reason"]) for record in records if record["kind"] == "given_up"]
    assert given_up == [(tid, "turn 1 refused: internal")] and committed == issued - {tid}, (
        f"rule 'a trajectory whose turn was refused is given up, never trained' not met: expected {tid!r} given up and "
        f"the other {trajectories - 1} trained, got given up {given_up}, trained {sorted(committed)}")
    assert (status["open"], status["queued"], status["counters"].get("trajectories.aborted")) == (0, 0, 1), status
    assert totals["given_up.internal"] == 1
    report = check(records, dead, broker_backlog=broker_backlog(status))
    assert report.ok() and (report.acked, report.committed, report.prompts) == (
        trajectories - 1, trajectories - 1, trajectories), report.summary()
