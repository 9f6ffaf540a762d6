"""Jobs kept apart end to end: real producer clients and consumers of two
jobs on one broker process, the same trajectory and group ids in both, a
broker restart between producing and consuming, and a trainer's state that
belongs to one job refused by a consumer of another."""
import pytest
from consumer_helpers import VOCAB

from rollstream.common.admin import AdminClient
from rollstream.common.errors import InvalidInput
from rollstream.consumer import Consumer
from rollstream.producer import Producer

pytestmark = pytest.mark.slow  # live brokers


def produce(endpoint: str, job: str | None, first_token: int) -> None:
    """A group `g` of two trajectories `t0`, `t1`; `first_token` tells the jobs' data apart."""
    options = {} if job is None else {"job": job}
    with Producer(endpoint, f"producer-{job}", vocab_size=VOCAB, **options) as producer:
        for i in range(2):
            traj = producer.trajectory(f"t{i}", [1, 2], group_id="g", group_size=2, sample_index=i)
            traj.turn([first_token + i], [-0.5], supports=[[first_token + i]])
            traj.end(reward=float(first_token))
        producer.flush(30)


def take_all(consumer: Consumer) -> dict[str, list[int]]:
    """One batch, committed: its response tokens by trajectory id."""
    batch = consumer.next_batch(timeout=30)
    consumer.commit(batch)
    consumer.flush(30)
    return {tid: batch.sample(i)["response_tokens"].tolist() for i, tid in enumerate(batch.trajectory_ids)}


def test_two_jobs_with_the_same_ids_stay_apart_across_a_broker_restart(brokers):
    broker = brokers()
    produce(broker.producer, None, 100)
    produce(broker.producer, "eval", 200)
    assert broker.status()["queued_by_job"] == {"default": 2, "eval": 2}
    broker.kill()
    broker.start()  # what the store holds comes back, each trajectory in its job
    assert broker.status()["queued_by_job"] == {"default": 2, "eval": 2}
    with AdminClient(broker.admin, timeout=5.0) as admin:  # what `rollstream status` prints from
        assert admin.status()["queued_by_job"] == {"default": 2, "eval": 2}
    with Consumer(broker.consumer, batch_size=2, vocab_size=VOCAB, job="eval", checkpointed=False) as evaluation:
        assert take_all(evaluation) == {"t0": [200], "t1": [201]}
    trainer = Consumer(broker.consumer, batch_size=2, vocab_size=VOCAB)
    batch = trainer.next_batch(timeout=30)
    assert batch.trajectory_ids == ("t0", "t1") and batch.response_tokens.tolist() == [100, 101]
    trainer.commit(batch)
    state = trainer.state_dict()
    trainer.flush(30)
    trainer.close()
    assert state["job"] == "default"
    with pytest.raises(InvalidInput, match="rule 'a run resumes in its own job' violated: the state belongs to job "
                                           "'default', this consumer reads job 'eval'"):
        Consumer(broker.consumer, batch_size=2, vocab_size=VOCAB, job="eval", resume=state)
    assert broker.status()["queued"] == 0 and broker.status()["unsealed"] == 2  # the trainer's, kept until sealed


def test_a_job_name_that_breaks_the_rule_is_refused_before_anything_connects():
    with pytest.raises(InvalidInput, match=r"a job name must match .* got 'two words'"):
        Consumer("ipc:///tmp/none", batch_size=1, job="two words")
    with pytest.raises(InvalidInput, match=r"a job name must match .* got ''"):
        Producer("ipc:///tmp/none", "p", job="")
