"""A restarted producer continues the trajectories it had open at its broker
(docs/protocol.md §3, "Open trajectories handed back"): the client's
listing, prefix read and resumed handle against a live broker."""
import asyncio

import numpy as np
import pytest
import zmq
from broker_process import BrokerProcess

from rollstream.common.checker import TurnRecord, delivered_digest, expected, read_records
from rollstream.common.codec import decode, encode
from rollstream.common.messages import BROKER_TO_CONSUMER, CONSUMER_TO_BROKER
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


def test_another_producer_id_is_handed_back_nothing(tmp_path):
    with BrokerProcess(tmp_path, vocab_size=1000) as broker:
        asyncio.run(first_run(broker.producer))

        async def other():
            async with AsyncProducer(broker.producer, "p2") as producer:
                return await producer.open_trajectories(timeout=30)

        assert asyncio.run(other()) == []
