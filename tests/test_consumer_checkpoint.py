"""The data position in the model's checkpoint, against live brokers: a
trainer resumed from checkpoint N gets back what it trained after N in the
same batches, then new data, and with deterministic math reaches the same
weights as a run that never stopped."""

import threading

import numpy as np
import pytest
import torch
from consumer_helpers import VOCAB, RawProducer, make_rollout
from waiting import wait_for

from rollstream.common.errors import InvalidInput, Refused
from rollstream.consumer import Consumer, ConsumerClosed

pytestmark = pytest.mark.slow  # live brokers

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
    c.wait_ready(WAIT)
    return c


def step(weights: torch.Tensor, batch) -> torch.Tensor:
    """One deterministic update that depends on every token of the batch and on its order."""
    order = torch.arange(1, len(batch.trajectory_ids) + 1, dtype=torch.float64)
    seen = torch.zeros_like(weights)
    for k, tokens in enumerate(batch.response_tokens.split(batch.response_lengths.tolist())):
        seen.index_add_(0, tokens.long().cpu() % weights.numel(), torch.full((tokens.numel(),), float(order[k]),
                                                                       dtype=torch.float64))
    return weights * 0.9 + 0.01 * seen


def test_a_resumed_trainer_gets_back_what_it_trained_after_its_checkpoint_in_the_same_batches(brokers):
    broker = brokers()
    produce(broker, 18)
    first = consumer(broker.consumer)
    trained = {}
    for n in range(1, 6):
        batch = first.next_batch(timeout=WAIT)
        first.commit(batch)
        trained[n] = batch.trajectory_ids
        if n == 2:
            state = first.state_dict()  # saved with checkpoint 2
            first.sealed(2)
    first.flush(WAIT)
    first.close(WAIT)  # or crashed: what it committed is durable
    assert state["step"] == 2 and [b["trajectory_ids"] for b in state["batches"]] == [list(trained[1]),
                                                                                       list(trained[2])]
    assert state["batches"][0]["sample_indices"] == [int(t[1:]) for t in trained[1]]
    again = consumer(broker.consumer, resume=state)
    assert again.resumed_from == 2
    replayed = []
    for n in (3, 4, 5):
        batch = again.next_batch(timeout=WAIT)
        replayed.append(batch.trajectory_ids)
        again.commit(batch)
    assert replayed == [trained[3], trained[4], trained[5]]
    fresh = again.next_batch(timeout=WAIT)  # then new data, never anything trained before
    assert not set(fresh.trajectory_ids) & {t for ids in trained.values() for t in ids}
    again.commit(fresh)
    assert again.state_dict()["step"] == 6
    again.close()


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


def test_a_state_saved_after_a_seal_lists_a_batch_whose_commit_no_broker_answered(brokers):
    """Checkpoint 2 is sealed while no broker has answered the commit of
    step 2 (its broker is down), and the trainer dies after saving
    checkpoint 3. That state still lists batch 2, so the resume records it
    as trained: it never comes back as new data to weights that trained it."""
    broker = brokers()
    produce(broker, 12)
    first = consumer(broker.consumer)
    one = first.next_batch(timeout=WAIT)
    first.commit(one)
    first.flush(WAIT)
    two, three = first.next_batch(timeout=WAIT), first.next_batch(timeout=WAIT)
    broker.terminate()
    first.commit(two)
    first.sealed(2)  # checkpoint 2 is durable
    first.commit(three)
    state = first.state_dict()  # saved with checkpoint 3
    assert [b["step"] for b in state["batches"]] == [2, 3]
    first.close(0)  # the trainer dies: no ack of step 2 or 3 ever reaches the broker
    broker.start()
    again = consumer(broker.consumer, resume=state)
    fresh = again.next_batch(timeout=WAIT)
    taken = {*one.trajectory_ids, *two.trajectory_ids, *three.trajectory_ids}
    assert set(fresh.trajectory_ids) == {f"t{i}" for i in range(12)} - taken
    again.commit(fresh)
    again.flush(WAIT)
    assert (broker.status()["ready"], broker.status()["leased"]) == (0, 0)
    again.close(WAIT)


def test_a_resume_across_brokers_rebuilds_each_batch_in_its_order(brokers):
    """Batches that interleave two brokers' trajectories, whichever broker
    answers first: the brokers take turns, and each trajectory is produced
    once the one before it is buffered at the consumer, so a batch holds
    them in the order they were produced. Resumed from before the first
    step, the consumer gets each broker's part of each batch back from it
    and hands the batches out again as they were trained, each in its order."""
    a, b = brokers(), brokers()
    producers = {"a": RawProducer(a.producer), "b": RawProducer(b.producer)}
    rng = np.random.default_rng(0)
    first = consumer([a.consumer, b.consumer])
    state = first.state_dict()  # checkpoint 0: before any step
    trained = []
    try:
        for n in range(9):
            name = "ab"[n % 2]
            tid = f"{name}{n // 2}"
            producers[name].send([make_rollout(rng, tid, sample_index=n)])
            wait_for(lambda: first.stats()["ready"] == n % 3 + 1, WAIT, f"{tid} to be buffered at the consumer")
            if n % 3 == 2:
                batch = first.next_batch(timeout=WAIT)
                first.commit(batch)
                trained.append(batch.trajectory_ids)
    finally:
        for producer in producers.values():
            producer.close()
    first.flush(WAIT)
    first.close(WAIT)
    assert trained == [("a0", "b0", "a1"), ("b1", "a2", "b2"), ("a3", "b3", "a4")]
    again = consumer([a.consumer, b.consumer], resume=state)
    assert [again.next_batch(timeout=WAIT).trajectory_ids for _ in range(3)] == trained
    again.close(WAIT)


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


def test_a_checkpoint_whose_batches_were_reclaimed_is_refused_by_name(brokers):
    broker = brokers()
    produce(broker, 12)
    first = consumer(broker.consumer, keep_checkpoints=1)
    old = first.state_dict()
    for n in range(1, 3):
        first.commit(first.next_batch(timeout=WAIT))
        first.sealed(n)
    first.flush(WAIT)
    first.close(WAIT)
    again = consumer(broker.consumer, resume=old)
    with pytest.raises(Refused, match="checkpoint_gone.*reclaimed what the run trained through step 2"):
        again.next_batch(timeout=WAIT)
    again.close()


def test_bad_resume_states_and_steps_are_refused_with_the_rule():
    with pytest.raises(InvalidInput, match="format must be"):
        Consumer("ipc:///tmp/none", batch_size=1, resume={"run": "r"})
    with pytest.raises(InvalidInput, match="resume needs checkpointed=True"):
        Consumer("ipc:///tmp/none", batch_size=1, checkpointed=False, resume={})



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
    wait_for(lambda: first._closing, WAIT, "the close to begin")
    with pytest.raises(ConsumerClosed, match=f"batch seq={held.seq} went back to its brokers"):
        first.commit(held)
    with pytest.raises(ConsumerClosed, match="the seal of step 1 was not sent"):
        first.sealed(1)
    again = consumer(broker.consumer, checkpointed=False)
    assert sorted(again.next_batch(timeout=WAIT).trajectory_ids) == sorted(held.trajectory_ids)
    again.close()
