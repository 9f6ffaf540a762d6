"""A restarted producer continues the trajectories it had open at its broker
(docs/protocol.md §3, "Open trajectories handed back"): the client's
listing, prefix read and resumed handle against a live broker."""
import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest
import zmq
from broker_process import BrokerProcess
from engines import FakeSGLang
from waiting import wait_for

from rollstream.common.checker import TurnRecord, check, delivered_digest, expected, read_records
from rollstream.common.codec import decode, encode
from rollstream.common.messages import BROKER_TO_CONSUMER, CONSUMER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import trajectory_from_deliver
from rollstream.producer import AsyncProducer, Refused
from rollstream.producer.resume import Resumable

PROMPT = np.array([1, 2, 3], np.int32)


def deliveries(broker, count, timeout=60.0):
    """`count` deliveries read by a raw consumer, acked, by trajectory id."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.consumer)
    sock.send_multipart(encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "c"}))
    sock.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": count, "unit": "trajectory"}))
    got = {}
    try:
        while len(got) < count:
            assert sock.poll(int(timeout * 1000)), f"only {len(got)} of {count} deliveries came"
            message = decode(sock.recv_multipart(), BROKER_TO_CONSUMER)
            if message.type == "deliver":
                got[message["trajectory_id"]] = trajectory_from_deliver(message)
                sock.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [message["lease"]]}))
    finally:
        sock.close()
    return got


async def first_run(endpoint, ledger=None):
    """Two turns of `a` (with forced tokens and supports), one truncated turn
    of `b` (its turns are over), `c` ended without its reward; then the
    producer goes away as a killed one would, without ending them."""
    async with AsyncProducer(endpoint, "p1", ledger=ledger) as producer:
        a = producer.trajectory("a", PROMPT, group_id="g", group_size=2, sample_index=0)
        await a.turn([5, 6], [-0.5, -0.25], supports=[[5, 9], [6]], forced_tokens=[7], weight_version="3")
        await a.turn([8], [-0.5], supports=[[8]], forced_tokens=[4, 4], weight_version="4")
        b = producer.trajectory("b", PROMPT, group_id="g", group_size=2, sample_index=1)
        await b.turn([5], [-0.5], supports=[[5]], status="truncated", weight_version="4")
        c = producer.trajectory("c", PROMPT)
        await c.turn([5], [-0.5], supports=[[5]])
        await c.end()
        assert await producer.flush(30)


def test_a_restarted_producer_lists_reads_and_continues_its_open_trajectories(tmp_path):
    with BrokerProcess(tmp_path, vocab_size=1000) as broker:
        asyncio.run(first_run(broker.producer))

        async def second_run():
            async with AsyncProducer(broker.producer, "p1", ledger=tmp_path / "second.jsonl") as producer:
                listed = {r.trajectory_id: r for r in await producer.open_trajectories(timeout=30)}
                assert listed == {
                    "a": Resumable("a", 2, "open", "g", 2, 0),
                    "b": Resumable("b", 1, "terminal", "g", 2, 1),
                    "c": Resumable("c", 1, "scoring", None, None, None),
                }
                prefix = await producer.read_prefix("a", timeout=30)
                assert prefix.prompt_tokens.tolist() == PROMPT.tolist()
                assert prefix.tokens.tolist() == [5, 6, 7, 8, 4, 4]
                assert prefix.context.tolist() == [1, 2, 3, 5, 6, 7, 8, 4, 4]
                assert prefix.sampled_tokens().tolist() == [5, 6, 8]
                assert prefix.loss_mask.tolist() == [1, 1, 0, 1, 0, 0]
                assert prefix.forced_spans == ((2, 3), (4, 6))
                assert prefix.weight_version_spans == (("3", 0, 2), ("4", 3, 4))
                assert [t.tokens.tolist() for t in prefix.turns()] == [[5, 6], [8]]
                assert [t.forced_tokens.tolist() for t in prefix.turns()] == [[7], [4, 4]]
                with pytest.raises(Refused) as refused:
                    await producer.read_prefix("nobody", timeout=30)
                assert refused.value.code == "unknown_trajectory"
                a = producer.resume(listed["a"], prefix.prompt_tokens, earlier=prefix.turns())
                await a.turn([9], [-0.5], supports=[[9, 1]], weight_version="5")
                await a.end(1.0)
                b = producer.resume(listed["b"], PROMPT)
                await b.end(0.0)
                c = producer.resume(listed["c"], PROMPT)
                await c.reward(0.5)
                assert await producer.flush(30)

        asyncio.run(second_run())
        got = deliveries(broker, 3)
        a = got["a"]
        assert a.tokens.tolist() == [5, 6, 7, 8, 4, 4, 9]
        assert a.mask.ids.tolist() == [5, 9, 6, 7, 8, 4, 4, 9, 1]
        assert got["b"].tokens.tolist() == [5] and got["c"].reward == 0.5
        status = broker.status()
        assert status["resumed"] == {"continued": 3, "listed": 3}
        # The second run's ledger vouches for all of `a`, the turns the first run sent included.
        (sent,) = [r for r in read_records([tmp_path / "second.jsonl"]) if r["kind"] == "sent" and r["id"] == "a"]
        assert len(sent["turns"]) == 3
        assert expected(sent["prompt"], [TurnRecord(*t) for t in sent["turns"]]).digest == delivered_digest(a.arrays())


def test_a_prefix_hands_back_full_log_probs_and_the_continued_trajectory_keeps_them(tmp_path):
    """`open_trajectory` carries the merged `full_log_probs` (0.0 at forced
    tokens); the prefix's turns carry their own, so the continued
    trajectory is delivered with every value sent and the ledger of the
    second run vouches for it."""
    with BrokerProcess(tmp_path, vocab_size=1000) as broker:
        async def first():
            async with AsyncProducer(broker.producer, "p1") as producer:
                a = producer.trajectory("a", PROMPT)
                await a.turn([5, 6], [-0.5, -0.25], supports=[[5, 9], [6]], forced_tokens=[7],
                             full_log_probs=[-1.5, -0.75])
                assert await producer.flush(30)

        async def second():
            async with AsyncProducer(broker.producer, "p1", ledger=tmp_path / "second.jsonl") as producer:
                (listed,) = await producer.open_trajectories(timeout=30)
                prefix = await producer.read_prefix("a", timeout=30)
                assert prefix.full_log_probs.tolist() == [-1.5, -0.75, 0.0]
                assert [t.full_log_probs.tolist() for t in prefix.turns()] == [[-1.5, -0.75]]
                a = producer.resume(listed, prefix.prompt_tokens, earlier=prefix.turns())
                await a.turn([8], [-0.5], supports=[[8]], full_log_probs=[-0.625])
                await a.end(1.0)
                assert await producer.flush(30)

        asyncio.run(first())
        asyncio.run(second())
        (a,) = deliveries(broker, 1).values()
    assert a.full_log_probs.tobytes() == np.array([-1.5, -0.75, 0.0, -0.625], np.float32).tobytes()
    (sent,) = [r for r in read_records([tmp_path / "second.jsonl"]) if r["kind"] == "sent"]
    assert expected(sent["prompt"], [TurnRecord(*t) for t in sent["turns"]]).digest == delivered_digest(a.arrays())


def test_a_prefix_hands_back_mask_log_probs_and_the_continued_trajectory_keeps_them(tmp_path):
    """`open_trajectory` carries the merged `mask_log_probs` beside the
    mask's ids (0.0 at each forced token's singleton); each of the prefix's
    turns carries its own supports' share of them, so the continued
    trajectory is delivered with every value sent and the ledger of the
    second run vouches for it."""
    quarter, rest = float(np.log(np.float32(0.25))), float(np.log(np.float32(0.75)))
    with BrokerProcess(tmp_path, vocab_size=1000) as broker:
        async def first():
            async with AsyncProducer(broker.producer, "p1") as producer:
                a = producer.trajectory("a", PROMPT)
                await a.send(Turn.build([5, 6], [-0.5, -0.25], supports=[[5, 9], [6]], forced_tokens=[7],
                                        mask_log_probs=[-0.25, -1.5, -0.0625]))
                await a.send(Turn.build([8], [-0.5], supports=[[8, 2]], forced_tokens=[4, 4],
                                        mask_log_probs=[-0.5, -1.0]))
                assert await producer.flush(30)

        async def second():
            async with AsyncProducer(broker.producer, "p1", ledger=tmp_path / "second.jsonl") as producer:
                (listed,) = await producer.open_trajectories(timeout=30)
                prefix = await producer.read_prefix("a", timeout=30)
                assert prefix.mask.ids.tolist() == [5, 9, 6, 7, 8, 2, 4, 4]
                assert prefix.mask_log_probs.tolist() == [-0.25, -1.5, -0.0625, 0.0, -0.5, -1.0, 0.0, 0.0]
                earlier = prefix.turns()
                assert [t.mask.ids.tolist() for t in earlier] == [[5, 9, 6], [8, 2]]
                assert [t.mask_log_probs.tolist() for t in earlier] == [[-0.25, -1.5, -0.0625], [-0.5, -1.0]]
                a = producer.resume(listed, prefix.prompt_tokens, earlier=earlier)
                await a.send(Turn.build([3], [-0.25], supports=[[3, 1]], mask_log_probs=[quarter, rest],
                                        mask_log_probs_normalized=True))
                await a.end(1.0)
                assert await producer.flush(30)

        asyncio.run(first())
        asyncio.run(second())
        (a,) = deliveries(broker, 1).values()
    assert a.mask.ids.tolist() == [5, 9, 6, 7, 8, 2, 4, 4, 3, 1]
    assert a.mask_log_probs.tobytes() == np.array([-0.25, -1.5, -0.0625, 0.0, -0.5, -1.0, 0.0, 0.0, quarter, rest],
                                                  np.float32).tobytes()
    (sent,) = [r for r in read_records([tmp_path / "second.jsonl"]) if r["kind"] == "sent"]
    assert expected(sent["prompt"], [TurnRecord(*t) for t in sent["turns"]]).digest == delivered_digest(a.arrays())
    assert delivered_digest({**a.arrays(), "mask_log_probs": None}) != delivered_digest(a.arrays())


def test_another_producer_id_is_handed_back_nothing(tmp_path):
    with BrokerProcess(tmp_path, vocab_size=1000) as broker:
        asyncio.run(first_run(broker.producer))

        async def other():
            async with AsyncProducer(broker.producer, "p2") as producer:
                return await producer.open_trajectories(timeout=30)

        assert asyncio.run(other()) == []


def sglang_daemon(broker, fake, work, *extra):
    command = [sys.executable, "-m", "rollstream.app.cli", "producer", "--source", "sglang", "--sglang-url", fake.url,
               "--broker-endpoint", broker.producer, "--metrics-port", "0", "--producer-id", "engine",
               "--spool-dir", str(work / "spool"), "--prompts", str(work / "prompts.jsonl"), "--group-size", "2",
               "--turns", "3", "--response-tokens", "4", "--tool-tokens", "2", "--vocab-size", "1000",
               "--concurrency", "1", *extra]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(work / "producer.log", "ab"))


def by_sample(trajectories):
    """Delivered trajectories by their prompt and sample (the end of their ids: the run token differs)."""
    return {tid.rsplit("-", 2)[-2:][0] + "-" + tid.rsplit("-", 1)[-1]: t for tid, t in trajectories.items()}


@pytest.mark.slow
def test_the_sglang_source_continues_a_trajectory_from_its_prefix_byte_for_byte(tmp_path):
    """Against a stand-in whose answers are a function of the request: a run
    without a kill, then one killed while a later turn's request waits at the
    engine. The restarted daemon's request carries the trajectory's prefix
    (the prompt and every token so far), and every merged trajectory is
    byte-identical to the run without the kill."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    runs = {}
    for name in ("whole", "killed"):
        work = tmp_path / name
        work.mkdir()
        (work / "prompts.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
        with FakeSGLang(vocab_size=1000, seed=20) as fake, BrokerProcess(work / "broker", vocab_size=1000) as broker:
            if name == "killed":  # held at the first request of a later turn the whole run made
                later = next(i for i, call in enumerate(runs["whole"][1]) if len(call["input_ids"]) > 5 and i > 1)
                fake.hold(after=later)
                process = sglang_daemon(broker, fake, work)
                assert fake.holding.wait(60), "the daemon never reached the held request"
                process.kill()
                process.wait(60)
                fake.release()
                answered = len(fake.calls)
            process = sglang_daemon(broker, fake, work)
            assert process.wait(120) == 0, (work / "producer.log").read_text()
            runs[name] = (by_sample(deliveries(broker, 4)), list(fake.calls), broker.status())
            if name == "killed":
                assert broker.status()["resumed"] == {"listed": 1, "continued": 1}
                # the first request after the restart goes on from the prefix, as the whole run's did
                assert fake.calls[answered]["input_ids"] == runs["whole"][1][later]["input_ids"]
    whole, killed = runs["whole"][0], runs["killed"][0]
    assert sorted(whole) == sorted(killed) == ["0-0", "0-1", "1-0", "1-1"]
    for sample, trajectory in whole.items():
        other = killed[sample]
        for name in ("prompt_tokens", "tokens", "log_probs", "loss_mask"):
            assert getattr(trajectory, name).tobytes() == getattr(other, name).tobytes(), (sample, name)
        assert trajectory.mask.ids.tobytes() == other.mask.ids.tobytes()
        assert trajectory.mask.offsets.tobytes() == other.mask.offsets.tobytes()
        assert (trajectory.status, trajectory.reward, trajectory.weight_versions) == \
            (other.status, other.reward, other.weight_versions)


@pytest.mark.slow
def test_the_model_source_continues_what_a_killed_daemon_had_open_and_the_checker_reads_zero(tmp_path):
    """The `model` source (the demo LM) killed while trajectories are open:
    its restart continues them from their prefix, every trajectory comes
    out whole (three turns of exactly eight tokens, four tool tokens
    between), and the producer's and the consumer's ledgers check clean.

    A kill can land after the daemon spooled the last frames of every
    trajectory the broker still shows open; its restart then sends those
    and has nothing to continue. The run still has to come out whole and
    check clean, and the scenario is run again (on a fresh broker) until a
    restart did find open trajectories to continue."""
    for attempt in range(ATTEMPTS):
        status = _kill_and_restart_the_model_source(tmp_path / f"attempt-{attempt}")
        if status["resumed"].get("listed", 0):
            break
    assert status["resumed"]["continued"] >= 1 and status["resumed"]["listed"] == status["resumed"]["continued"]


ATTEMPTS = 5  # runs of a kill that leaves nothing open to continue, before the test gives up


def _kill_and_restart_the_model_source(tmp_path) -> dict:
    """One run of the scenario, checked whole; the broker's status after it."""
    from rollstream.consumer import Consumer

    work = tmp_path / "work"
    work.mkdir(parents=True)
    with BrokerProcess(tmp_path / "broker", vocab_size=4096) as broker:
        def daemon(run):
            command = [sys.executable, "-m", "rollstream.app.cli", "producer", "--source", "model",
                       "--broker-endpoint", broker.producer, "--metrics-port", "0", "--producer-id", "lm",
                       "--spool-dir", str(work / "spool"), "--trajectories", "8", "--group-size", "2", "--turns", "3",
                       "--response-tokens", "8", "--tool-tokens", "4", "--prompt-tokens", "8", "--vocab-size", "4096",
                       "--concurrency", "2", "--seed", "1", "--ledger", str(work / f"producer-{run}.jsonl")]
            return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(work / f"producer-{run}.log", "wb"))

        first = daemon(0)
        try:
            wait_for(lambda: broker.status()["counters"].get("frames.turn.applied", 0) >= 4 and broker.status()["open"],
                     timeout=120, what="trajectories open mid-way")
        finally:
            first.kill()
            first.wait(60)
        assert daemon(1).wait(180) == 0, (work / "producer-1.log").read_text()
        with Consumer(broker.consumer, batch_size=2, vocab_size=4096, ledger=work / "consumer.jsonl") as consumer:
            lengths = []
            for _ in range(4):
                batch = consumer.next_batch(timeout=60)
                lengths += batch.response_lengths.tolist()
                consumer.commit(batch)
            consumer.flush(60)
        status = broker.status()
        report = check(read_records([work]), broker.dead_letters(), broker_backlog=status["queued"])
    assert lengths == [3 * 8 + 2 * 4] * 8
    assert report.ok() and (report.committed, report.prompts, report.prompts_skipped) == (8, 4, [])
    return status


def test_the_blocking_producer_lists_reads_and_continues_too(tmp_path):
    from rollstream.producer import Producer

    with BrokerProcess(tmp_path, vocab_size=1000) as broker:
        asyncio.run(first_run(broker.producer))
        with Producer(broker.producer, "p1") as producer:
            listed = {r.trajectory_id: r for r in producer.open_trajectories(timeout=30)}
            assert sorted(listed) == ["a", "b", "c"]
            prefix = producer.read_prefix("a", timeout=30)
            a = producer.resume(listed["a"], prefix.prompt_tokens, earlier=prefix.turns())
            assert a.next_turn == 2
            assert a.turn([9], [-0.5], supports=[[9]]).result(30).applied
            assert a.end(1.0).result(30).applied
            assert producer.resume(listed["b"], PROMPT).end(0.0).result(30).applied
        assert deliveries(broker, 2)["a"].tokens.tolist() == [5, 6, 7, 8, 4, 4, 9]
