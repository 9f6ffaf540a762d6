"""The blocking producer, for rollout code without asyncio: four worker
threads share one `Producer`, each sending trajectories whose calls return
`concurrent.futures.Future`s at once; then one turn the broker refuses (an
id outside the vocabulary) and the corrected turn sent in its place. The
broker runs on loopback, started here; a consumer takes every trajectory.

    .venv/bin/python examples/blocking_producer.py
"""
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rollstream.app.harness import LoopbackNode
from rollstream.consumer import Consumer
from rollstream.producer import Producer, Refused

VOCAB = 1000
WORKERS, PER_WORKER = 4, 3


def rollouts(producer: Producer, worker: int) -> list:
    """One worker's trajectories: every frame sent without waiting; the futures of their ends."""
    rng = np.random.default_rng(worker)
    ends = []
    for k in range(PER_WORKER):
        supports = [sorted(rng.choice(VOCAB, size=4, replace=False).tolist()) for _ in range(5)]
        tokens = [support[0] for support in supports]  # the sampler's pick from each support
        traj = producer.trajectory(f"w{worker}-{k}", prompt_tokens=[1, 2, 3])
        traj.turn(tokens, [-1.4] * len(tokens), supports=supports)   # blocks only while the window is full
        ends.append(traj.end(reward=float(k)))                      # a concurrent.futures.Future of its receipt
    return ends


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rollstream-spool-") as spool_dir, \
            LoopbackNode("rollstream-example-", VOCAB) as node:
        with Producer(node.endpoints["producer"], "rollout-blocking", spool_dir=spool_dir) as producer:
            with ThreadPoolExecutor(WORKERS) as pool:
                ends = [end for worker_ends in pool.map(lambda w: rollouts(producer, w), range(WORKERS))
                        for end in worker_ends]
            receipts = [end.result(timeout=120) for end in ends]  # each durable at the broker once resolved

            traj = producer.trajectory("corrected", prompt_tokens=[1, 2, 3])
            try:
                traj.turn_and_wait([VOCAB], [-0.1], supports=[[VOCAB]], timeout=120)  # outside the vocabulary
            except Refused as refused:
                code = refused.code
            else:
                raise AssertionError("the broker must refuse an id outside its vocabulary")
            assert traj.next_turn == 0  # the refused turn is the next one again: send the corrected turn
            traj.turn_and_wait([7], [-0.1], supports=[[7]], timeout=120)
            receipts.append(traj.end_and_wait(reward=0.0, timeout=120))
        with Consumer(node.endpoints["consumer"], batch_size=len(receipts), vocab_size=VOCAB) as consumer:
            batch = consumer.next_batch(timeout=120)
            consumer.commit(batch)
            consumer.flush(120)
    assert all(receipt.applied for receipt in receipts), receipts
    assert sorted(batch.trajectory_ids) == sorted(receipt.trajectory_id for receipt in receipts)
    print(f"ok: {len(receipts)} trajectories from {WORKERS} threads acked and delivered; "
          f"the out-of-vocabulary turn refused ({code}) and its correction applied")


if __name__ == "__main__":
    main()
