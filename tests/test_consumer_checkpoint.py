"""The data position in the model's checkpoint, through the `Consumer`
shell against live brokers: a trainer resumed from checkpoint N gets back
what it trained after N in the same batches, then new data, and with
deterministic math reaches the same weights as a run that never stopped. The
rules themselves (what a state lists, how a resume is rebuilt across
brokers, refusals, closing) are the core's, in tests/test_consumer_core.py."""

import threading

import numpy as np
import pytest
import torch
from consumer_helpers import VOCAB, RawProducer, make_rollout
from waiting import wait_for

from rollstream.consumer import Consumer, ConsumerClosed

# How long a batch, a welcome or a broker's answer may take on a machine
# running other work: a bound on a failing wait, not a timing assertion.
WAIT = 120.0


def produce(broker, n, prefix="t", seed=0):
    rng = np.random.default_rng(seed)
    producer = RawProducer(broker.producer)
    try:
        producer.send([make_rollout(rng, f"{prefix}{i}", sample_index=i) for i in range(n)])
    finally:
        producer.close()


def consumer(endpoints, **kw):
    c = Consumer(endpoints, batch_size=3, vocab_size=VOCAB, **kw)
    c.wait_welcomed(WAIT)
    return c


def step(weights: torch.Tensor, batch) -> torch.Tensor:
    """One deterministic update that depends on every token of the batch and on its order."""
    order = torch.arange(1, len(batch.trajectory_ids) + 1, dtype=torch.float64)
    seen = torch.zeros_like(weights)
    for k, tokens in enumerate(batch.response_tokens.split(batch.response_lengths.tolist())):
        seen.index_add_(0, tokens.long().cpu() % weights.numel(), torch.full((tokens.numel(),), float(order[k]),
                                                                       dtype=torch.float64))
    return weights * 0.9 + 0.01 * seen


@pytest.mark.slow  # live brokers
def test_a_resume_hands_back_first_what_the_brokers_confirmed(brokers):
    """`commit` queues the acks, `flush` waits for the brokers' answers. The
    broker goes down after the commit of step 2 was flushed and before the
    one of step 3 could leave, and the trainer dies: resumed from checkpoint
    1, it gets batch 2 back first, as it was, and batch 3's trajectories as
    new data, trained once."""
    broker = brokers()
    produce(broker, 12)
    first = consumer(broker.consumer)
    one = first.next_batch(timeout=WAIT)
    first.commit(one)
    state = first.state_dict()  # saved with checkpoint 1
    first.sealed(1)
    first.flush(WAIT)
    two, three = first.next_batch(timeout=WAIT), first.next_batch(timeout=WAIT)
    first.commit(two)
    first.flush(WAIT)
    broker.terminate()
    first.commit(three)  # queued; its broker never answers
    first.close(0)  # the trainer dies
    broker.start()
    again = consumer(broker.consumer, resume=state)
    assert again.next_batch(timeout=WAIT).trajectory_ids == two.trajectory_ids
    fresh = [again.next_batch(timeout=WAIT).trajectory_ids for _ in range(2)]
    assert sorted(t for ids in fresh for t in ids) == sorted({f"t{i}" for i in range(12)} - {*one.trajectory_ids,
                                                                                             *two.trajectory_ids})
    assert set(three.trajectory_ids) <= {t for ids in fresh for t in ids}
    again.close(WAIT)


@pytest.mark.slow  # live brokers
def test_a_resumed_trainer_reaches_the_weights_of_a_run_that_never_stopped(brokers):
    """Two runs over the same data on two brokers: one straight through
    four steps, one saving its weights with `state_dict()` at step 2,
    stopped after step 4 and resumed from the step-2 checkpoint. Back at
    step 4 the weights are equal; trained on batches other than the ones
    handed back (the two swapped), they are not."""
    straight, stopped = brokers(), brokers()
    produce(straight, 30)
    produce(stopped, 30)
    weights, history = torch.zeros(VOCAB, dtype=torch.float64), []
    with consumer(straight.consumer) as run:
        for _ in range(4):
            batch = run.next_batch(timeout=WAIT)
            weights = step(weights, batch)
            history.append(batch)
            run.commit(batch)
    uninterrupted = weights

    weights = torch.zeros(VOCAB, dtype=torch.float64)
    run = consumer(stopped.consumer)
    for n in range(1, 5):
        batch = run.next_batch(timeout=WAIT)
        weights = step(weights, batch)
        run.commit(batch)
        if n == 2:
            checkpoint = {"weights": weights.clone(), "data": run.state_dict()}
    run.flush(WAIT)
    run.close(WAIT)
    weights = checkpoint["weights"]
    with consumer(stopped.consumer, resume=checkpoint["data"]) as run:
        for _ in range(2):
            batch = run.next_batch(timeout=WAIT)
            weights = step(weights, batch)
            run.commit(batch)
    assert torch.equal(weights, uninterrupted)

    swapped = step(step(checkpoint["weights"], history[3]), history[2])
    assert not torch.equal(swapped, uninterrupted)  # the comparison sees a batch handed back out of place


def test_a_consumer_closed_while_the_trainer_holds_a_batch_says_so_on_commit_and_on_seal(brokers):
    """Another thread (a stop signal's handler) closes the consumer while the
    trainer trains: the commit and the seal that follow name the close, and
    the batch it held is delivered again."""
    broker = brokers()
    produce(broker, 6)
    first = consumer(broker.consumer)
    first.commit(first.next_batch(timeout=WAIT))
    held = first.next_batch(timeout=WAIT)
    threading.Thread(target=first.close, args=(WAIT,)).start()
    wait_for(lambda: first._core.closing, WAIT, "the close to begin")
    with pytest.raises(ConsumerClosed, match=f"batch seq={held.seq} went back to its brokers"):
        first.commit(held)
    with pytest.raises(ConsumerClosed, match="the seal of step 1 was not sent"):
        first.sealed(1)
    again = consumer(broker.consumer, checkpointed=False)
    assert sorted(again.next_batch(timeout=WAIT).trajectory_ids) == sorted(held.trajectory_ids)
    again.close()
