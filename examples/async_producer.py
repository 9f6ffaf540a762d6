"""The rollout loop's producer, on asyncio: four samples of one prompt (a
group), each of three turns (one with forced tokens, one of an engine's
arrays as they are, one from an SGLang reply), sent to a broker this script
starts on loopback, with the producer's spool in a temporary directory. A
consumer then takes the group, delivered whole once its four samples ended.

    .venv/bin/python examples/async_producer.py
"""
import asyncio
import tempfile

import numpy as np

from rollstream.app.harness import LoopbackNode
from rollstream.consumer import Consumer
from rollstream.producer import AsyncProducer

VOCAB = 1000  # the broker and the consumer check every id against it

# What an engine hands back for a turn: two sampled tokens, their log-probs and supports ({11, 13} and {12}).
tokens = np.array([11, 12], dtype=np.int32)
log_probs = np.array([-0.7, -0.1], dtype=np.float32)
mask_ids = np.array([11, 13, 12], dtype=np.int32)
mask_offsets = np.array([0, 2, 3], dtype=np.int64)
# An SGLang /generate reply asked with return_sampling_mask:
response = {"output_ids": [30], "meta_info": {"output_token_sampling_mask": [[30, 7, 8]],
                                              "output_token_sampling_logprobs": [-0.2],
                                              "finish_reason": {"type": "stop"}}}


async def produce(endpoint: str, spool_dir: str) -> list:
    """Send the group; the broker's receipt of each sample's end."""
    receipts = []
    async with AsyncProducer(endpoint, producer_id="rollout-7", spool_dir=spool_dir) as producer:
        for i in range(4):  # a group is delivered once all group_size samples have ended
            traj = producer.trajectory(f"traj-{i}", prompt_tokens=[1, 2, 3], group_id="p0", group_size=4, sample_index=i)
            await traj.turn([10], [-0.1], supports=[[10, 4]], forced_tokens=[20, 21])  # waits for room, returns a future
            # An engine's arrays as they are (int32 tokens and ids, int64 offsets, float32 log-probs): not copied.
            await traj.turn(tokens, log_probs, mask_ids=mask_ids, mask_offsets=mask_offsets)
            await traj.sglang(response["output_ids"], response["meta_info"])          # an SGLang /generate reply
            receipt = await traj.end_and_wait(reward=1.0)  # Receipt(applied=True, ...); a nack raises Refused(code, ...)
            receipts.append(receipt)
    return receipts


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rollstream-spool-") as spool_dir, \
            LoopbackNode("rollstream-example-", VOCAB) as node:
        receipts = asyncio.run(produce(node.endpoints["producer"], spool_dir))
        with Consumer(node.endpoints["consumer"], batch_size=1, unit="group", vocab_size=VOCAB) as consumer:
            batch = consumer.next_batch(timeout=120)
            consumer.commit(batch)
            consumer.flush(120)
    assert all(receipt.applied for receipt in receipts), receipts
    assert sorted(batch.trajectory_ids) == [f"traj-{i}" for i in range(4)] and set(batch.group_ids) == {"p0"}
    # Per sample: [10] + forced [20, 21], the engine's [11, 12], SGLang's [30]: 4 of the 6 in the loss.
    assert batch.response_lengths.tolist() == [6] * 4 and int(batch.loss_mask.sum()) == 4 * 4
    print(f"ok: {len(receipts)} samples acked, delivered as one group of {len(batch)} with "
          f"{int(batch.response_lengths.sum())} response tokens")


if __name__ == "__main__":
    main()
