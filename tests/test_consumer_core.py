"""The consumer's whole composition (`consumer.core.ConsumerCore`) driven
without sockets, threads or clocks, as tests/test_broker_core.py drives the
broker's: the brokers are scripted messages through the real codec, the time
is a number, and a batch's check is its verdict (the violations a shell's
`checked_batch` would find). Checkpoints and seals, a resume handing back
every batch whole and in order across two brokers, quarantine with refill,
stale and expired units, credit, the tail of a run, and closing."""
import numpy as np
import pytest
from consumer_helpers import make_rollout

from rollstream.common.codec import decode, encode
from rollstream.common.errors import InvalidInput, InvalidState, Refused, TimedOut
from rollstream.common.messages import BROKER_TO_CONSUMER
from rollstream.common.trajectory import Trajectory, Turn
from rollstream.common.validation import RULE_TOKEN_VOCAB, BatchValidationError, Violation
from rollstream.common.wire import encode_deliver
from rollstream.consumer.core import ConsumerClosed, ConsumerCore, Form, HandOut, Refill, Wait


def core(brokers: int = 1, **kw) -> ConsumerCore:
    kw.setdefault("batch_size", 2)
    return ConsumerCore([f"ipc://b{i}" for i in range(brokers)], consumer_id="c", **kw)


def says(kind: str, **fields):
    """A broker's message as the consumer decodes it."""
    return decode(encode(BROKER_TO_CONSUMER, kind, fields), BROKER_TO_CONSUMER)


def welcome(c: ConsumerCore, broker: int = 0, now: float = 0.0, **fields) -> list:
    """`broker` welcomes the consumer's hello; what the consumer sends then."""
    c.due(now)
    fields = {"broker_id": f"b{broker}", "lease_timeout": 30.0, "heartbeat_interval": 10.0, "queued_counts": True,
              **fields}
    c.received(broker, says("welcome", **fields), now)
    return c.due(now)


def deliver(c: ConsumerCore, broker: int, tid: str, lease: str | None = None, now: float = 0.0, *,
            trajectory: Trajectory | None = None, **extra) -> None:
    trajectory = trajectory or make_rollout(np.random.default_rng(len(tid)), tid).merged()
    c.received(broker, decode(encode_deliver(trajectory, lease or f"L-{tid}", **extra), BROKER_TO_CONSUMER), now)


def ids(form: Form) -> tuple[str, ...]:
    return tuple(d.trajectory_id for d in form.deliveries)


def hand_out(c: ConsumerCore, now: float = 0.0, **take) -> Form:
    """The next batch, found valid by its check."""
    form = c.take(now, **take)
    assert isinstance(form, Form), form
    assert c.formed([]) == HandOut(form.seq)
    return form


def sent(c: ConsumerCore, now: float = 0.0, *kinds: str) -> list[tuple[int, str, dict]]:
    """What goes out now, of `kinds` (everything but heartbeats when none is named)."""
    return [(broker, kind, fields) for broker, kind, fields in c.due(now)
            if kind in kinds or (not kinds and kind != "heartbeat")]


def bad(sample: int) -> Violation:
    return Violation(RULE_TOKEN_VOCAB, sample, 0, 1, "token 5000 >= vocab_size 1000")


# -- checkpoints ------------------------------------------------------------------
def test_each_commit_is_acked_at_its_step_in_batch_order_and_a_seal_follows_its_acks():
    c = core()
    welcome(c)
    for tid in ("t0", "t1", "t2", "t3"):
        deliver(c, 0, tid)
    first = hand_out(c)
    assert c.commit(first.seq) == 1
    second = hand_out(c)
    with pytest.raises(InvalidInput, match="commit steps go forward: expected a step after 1, got 1"):
        c.commit(second.seq, 1)
    assert c.commit_step(second.seq, 7) == 7 and c.commit(second.seq, 7) == 7
    c.seal(7)
    out = sent(c, 0.0, "ack", "seal")
    assert [(kind, f.get("step"), f.get("trajectory_ids"), f.get("positions")) for _, kind, f in out] == [
        ("ack", 1, ["t0", "t1"], [0, 1]), ("ack", 7, ["t2", "t3"], [0, 1]), ("seal", 7, None, None)]
    # Sealed, but no ack answered yet: a state saved now still lists both batches, so a resume records them.
    assert [(b["step"], b["trajectory_ids"]) for b in c.state_dict()["batches"]] == [(1, ["t0", "t1"]),
                                                                                    (7, ["t2", "t3"])]
    c.received(0, says("acked", leases=["L-t0", "L-t1", "L-t2", "L-t3"]), 0.1)
    c.received(0, says("sealed", step=7, reclaimed=0), 0.1)
    state = c.state_dict()
    assert (state["step"], state["batches"], c.unsettled, c.unsealed) == (7, [], 0, 0)
    with pytest.raises(InvalidInput, match="not awaiting commit"):
        c.commit(second.seq)


def test_a_state_saved_after_a_seal_lists_a_batch_whose_commit_no_broker_answered_and_a_resume_records_it():
    """Checkpoint 2 is sealed while its broker has not answered the commit of
    step 2 (it forgot this consumer), and the state is saved at step 3: it
    lists batch 2, and the resume from it tells every broker it is trained."""
    c = core()
    welcome(c)
    for tid in ("t0", "t1", "t2", "t3", "t4", "t5"):
        deliver(c, 0, tid)
    c.commit(hand_out(c).seq)
    two, three = hand_out(c), hand_out(c)  # with the trainer: their leases survive a lost session
    c.due(0.1)
    c.received(0, says("acked", leases=["L-t0", "L-t1"]), 0.1)
    c.received(0, says("nack", code="unknown_consumer", message="who are you"), 0.2)
    c.commit(two.seq)
    c.seal(2)
    c.commit(three.seq)
    assert "ack" not in [kind for _, kind, _ in sent(c, 0.3)]  # they wait for the broker to know us again
    state = c.state_dict()
    assert [b["step"] for b in state["batches"]] == [2, 3]
    again = core(resume=state)
    [(_, kind, resume)] = [out for out in welcome(again) if out[1] == "resume"]
    assert resume == {"step": 3, "keep": 2, "trained": [[2, 0, "t2"], [2, 1, "t3"], [3, 0, "t4"], [3, 1, "t5"]]}


def test_a_resume_hands_back_every_batch_whole_and_in_order_across_two_brokers_then_new_data():
    """Each broker hands back its part of each batch trained after the
    checkpoint (which position of which step it holds), answering and
    delivering in any order; the batches come out as they were trained, each
    at its step, once every broker answered and all of a batch is here. New
    data waits for credit until a broker answered and heard this lineage."""
    trained = [("a0", "b0", "a1"), ("b1", "a2", "b2"), ("a3", "b3", "a4")]
    state = core(batch_size=3).state_dict()  # checkpoint 0, before any step
    c = core(brokers=2, batch_size=3, resume=state)
    assert c.resumed_from == 0 and c.epoch == 1
    first_out = welcome(c, 0) + welcome(c, 1)
    assert {kind for _, kind, _ in first_out} == {"resume"}  # no credit and no policy before the answers
    replay = {broker: [[step, position, tid] for step, batch in enumerate(trained, 1)
                       for position, tid in enumerate(batch) if tid[0] == "ab"[broker]] for broker in (0, 1)}
    c.received(1, says("resumed", step=0, replay=replay[1], epoch=0), 0.1)
    for tid in ("b2", "b0", "b3", "b1"):
        deliver(c, 1, tid, replay=True)
    assert c.take(0.2) == Wait(None)  # broker 0 has not answered
    assert [kind for broker, kind, _ in sent(c, 0.2) if broker == 1] == ["policy", "credit"]
    c.received(0, says("resumed", step=0, replay=replay[0], epoch=0), 0.3)
    for tid in ("a1", "a0", "a3", "a2"):  # a4 is late
        deliver(c, 0, tid, replay=True)
    first = hand_out(c, 0.4)
    assert (ids(first), first.replayed_step) == (trained[0], 1)
    with pytest.raises(InvalidInput, match="a replayed batch is committed at the step it was trained at: expected 1"):
        c.commit(first.seq, 5)
    assert c.commit(first.seq) == 1
    second = hand_out(c, 0.5)
    c.release(second.seq)  # not trained: the next batch again
    assert ids(hand_out(c, 0.6)) == trained[1] and c.commit(second.seq + 1) == 2
    assert c.take(0.7) == Wait(None)  # a4 is not here yet
    deliver(c, 0, "a4", replay=True)
    third = hand_out(c, 0.8)
    assert (ids(third), third.replayed_step, c.commit(third.seq)) == (trained[2], 3, 3)
    deliver(c, 0, "fresh", queued=0)
    deliver(c, 1, "fresh-2", queued=0)
    deliver(c, 0, "fresh-3", queued=0)
    fresh = hand_out(c, 0.9)
    assert fresh.replayed_step is None and ids(fresh) == ("fresh", "fresh-2", "fresh-3")
    assert c.commit(fresh.seq) == 4


def test_a_replayed_batch_that_fails_its_check_is_refused_whole_and_handed_back_next_again():
    state = core().state_dict()
    c = core(resume=state, on_invalid="quarantine")  # a batch handed back validates whole, whatever the policy
    welcome(c)
    c.received(0, says("resumed", step=0, replay=[[1, 0, "x"], [1, 1, "y"]], epoch=0), 0.0)
    deliver(c, 0, "x", replay=True)
    deliver(c, 0, "y", replay=True)
    form = c.take(0.1)
    assert ids(form) == ("x", "y") and form.replayed_step == 1
    with pytest.raises(BatchValidationError, match=r"sample 1 \(y\)"):
        c.formed([bad(1)])
    assert ids(hand_out(c, 0.2)) == ("x", "y")


def test_a_resume_no_broker_can_serve_is_refused_by_name():
    c = core(resume=core().state_dict())
    welcome(c)
    c.received(0, says("nack", code="checkpoint_gone", message="reclaimed what the run trained through step 2"), 0.1)
    with pytest.raises(Refused, match="cannot resume from step 0: reclaimed what the run trained through step 2"):
        c.take(0.2)


def test_bad_resume_states_and_arguments_are_refused_with_the_rule():
    with pytest.raises(InvalidInput, match="format must be"):
        core(resume={"run": "r"})
    with pytest.raises(InvalidInput, match="resume needs checkpointed=True"):
        core(checkpointed=False, resume={})
    with pytest.raises(InvalidInput, match="on_invalid must be one of"):
        core(on_invalid="ignore")
    with pytest.raises(InvalidInput, match="max_staleness is an integer >= 0"):
        core(max_staleness=-1)
    with pytest.raises(InvalidInput, match="commit takes a step only when checkpointed"):
        core(checkpointed=False).commit(0, 3)
    with pytest.raises(InvalidState, match="state_dict needs a checkpointing consumer"):
        core(checkpointed=False).state_dict()


# -- quarantine -------------------------------------------------------------------
def group_member(tid: str, *, vocab_token: int = 5) -> Trajectory:
    t = Trajectory(tid, [1, 2], group_id="g", group_size=3)
    t.append_turn(Turn.build([vocab_token], [-0.1], supports=[[vocab_token]]))
    t.reward = 0.0
    return t


def test_quarantine_dead_letters_the_failing_member_and_the_batch_keeps_its_groups_valid_members():
    c = core(unit="group", on_invalid="quarantine")
    welcome(c)
    for k, tid in enumerate(("g-0", "g-bad", "g-1")):
        deliver(c, 0, tid, f"L{k}", trajectory=group_member(tid), group_left=0)
    deliver(c, 0, "solo", "L-solo")
    form = c.take(0.1)
    assert ids(form) == ("g-0", "g-bad", "g-1", "solo")
    assert c.formed([bad(1)]) == Refill(("g-bad",))
    [(_, _, nack)] = sent(c, 0.1, "nack")
    assert nack["leases"] == ["L1"] and nack["requeue"] is False
    assert nack["reason"] == f"sample 1 (g-bad) token 0: rule '{RULE_TOKEN_VOCAB}' violated: token 5000 >= vocab_size 1000"
    again = c.take(0.2)
    assert again.seq == form.seq and ids(again) == ("g-0", "g-1", "solo")  # checked again, as one batch
    assert c.formed([]) == HandOut(form.seq)
    assert c.stats()["rejected"] == 1
    deliver(c, 0, "g-bad", "L-again", trajectory=group_member("g-bad"), group_left=0)  # redelivered: refused alike
    assert [f["leases"] for _, _, f in sent(c, 0.3, "nack")] == [["L-again"]]


def test_a_quarantined_unit_is_replaced_by_the_next_ready_one():
    c = core(on_invalid="quarantine")
    welcome(c)
    for tid in ("t0", "t1", "t2"):
        deliver(c, 0, tid)
    assert ids(c.take(0.0)) == ("t0", "t1")
    assert c.formed([bad(0)]) == Refill(("t0",))
    assert ids(c.take(0.1)) == ("t1", "t2")


def test_under_raise_the_whole_batch_goes_back_and_the_error_names_the_trajectory():
    c = core()
    welcome(c)
    for tid in ("t0", "t1"):
        deliver(c, 0, tid)
    c.take(0.0)
    with pytest.raises(BatchValidationError, match=r"sample 1 \(t1\) token 0"):
        c.formed([bad(1)])
    assert [(f["leases"], f["requeue"]) for _, _, f in sent(c, 0.1, "nack")] == [(["L-t0", "L-t1"], True)]


def test_a_batch_that_could_not_be_packed_goes_back_and_the_verdict_follows_its_form():
    c = core()
    welcome(c)
    for tid in ("t0", "t1"):
        deliver(c, 0, tid)
    with pytest.raises(InvalidState, match="no batch awaits a verdict"):
        c.formed([])
    c.take(0.0)
    with pytest.raises(InvalidState, match="awaits its verdict"):
        c.take(0.0)
    c.abandon()  # the shell's packing raised
    assert [f["leases"] for _, _, f in sent(c, 0.1, "nack")] == [["L-t0", "L-t1"]]
    assert c.stats()["held"] == 0


# -- staleness and leases -----------------------------------------------------------
def versioned(tid: str, version: str) -> Trajectory:
    t = Trajectory(tid, [1, 2])
    t.append_turn(Turn.build([5, 6], [-0.1, -0.2], supports=[[5, 1], [6]], weight_version=version))
    t.reward = 0.0
    return t


def test_a_prefetched_unit_that_fell_behind_the_bound_is_dead_lettered_stale_when_a_batch_is_formed():
    c = core(batch_size=1, max_staleness=1, checkpointed=False)
    welcome(c)
    c.publish(2)
    for tid, version in (("v1", "step-1"), ("v3", "step-3")):
        deliver(c, 0, tid, trajectory=versioned(tid, version))
    [(_, _, policy)] = sent(c, 0.0, "policy")
    assert (policy["version"], policy["max_staleness"]) == (2, 1)
    c.publish(3)  # v1 is two behind now
    assert ids(hand_out(c, 0.1)) == ("v3",)
    assert c.pending  # the shell wakes its I/O thread for the nack
    [(_, _, nack)] = sent(c, 0.1, "nack")
    assert (nack["leases"], nack["reason"], nack["requeue"]) == (["L-v1"], "stale", False)
    assert c.stats()["stale"] == 1


def test_a_unit_whose_lease_ran_out_while_the_trainer_was_busy_is_not_handed_out():
    c = core(batch_size=1, prefetch=2)
    c.due(0.0)
    c.received(0, says("welcome", broker_id="b", lease_timeout=0.3, heartbeat_interval=10.0), 0.0)
    deliver(c, 0, "late", "L-late", now=0.1)
    assert c.take(0.5) == Wait(None)  # its lease ran out at 0.4: the broker is redelivering it
    assert c.stats()["expired_in_buffer"] == 1
    c.abandon()
    deliver(c, 0, "late", "L-again", now=0.6)  # the broker's redelivery
    assert ids(hand_out(c, 0.7)) == ("late",)


# -- credit ---------------------------------------------------------------------------
def test_credit_goes_where_trajectories_wait_within_the_prefetch_and_parked_credit_is_taken_back():
    c = core(brokers=2, batch_size=2, prefetch=4)  # at most 4 units buffered or promised, 2 of them promised

    def credit(out) -> list[tuple[int, str, int]]:
        assert c.stats()["complete"] + c.assembler.credit.outstanding <= 4
        return [(b, kind, f.get("n", 0)) for b, kind, f in out if kind in ("credit", "revoke")]

    assert credit(welcome(c, 1, queued=0)) == [(1, "credit", 1)]  # a standing window at an empty broker
    assert credit(welcome(c, 0, queued=5)) == [(0, "credit", 1)]  # the rest of the room, where trajectories wait
    deliver(c, 0, "t0", queued=4)
    assert credit(c.due(0.1)) == [(0, "credit", 1)]
    deliver(c, 0, "t1", queued=3)
    assert credit(c.due(0.1)) == [(0, "credit", 1)]
    deliver(c, 0, "t2", queued=2)
    assert credit(c.due(0.1)) == [(1, "revoke", 0)]  # broker 0 waits for the unit parked at broker 1
    c.received(1, says("revoked", queued=0), 0.2)
    assert credit(c.due(0.2)) == [(0, "credit", 1)]
    deliver(c, 0, "t3", queued=1)
    assert credit(c.due(0.3)) == []  # the prefetch is full
    hand_out(c, 0.4)
    assert credit(c.due(0.4)) == [(0, "credit", 1), (1, "credit", 1)]


# -- the tail of a run, and timeouts --------------------------------------------------
def test_partial_after_hands_out_the_ready_units_smaller_but_never_empty_and_a_deadline_ends_the_wait():
    c = core(batch_size=3)
    welcome(c)
    assert c.take(0.0, deadline=5.0, partial_at=1.0) == Wait(1.0)
    assert c.take(1.5, deadline=5.0, partial_at=1.0) == Wait(5.0)  # nothing ready: no batch at all
    with pytest.raises(TimedOut, match="0 of 3 units complete"):
        c.take(5.0, deadline=5.0, partial_at=1.0)
    deliver(c, 0, "a")
    deliver(c, 0, "b")
    with pytest.raises(TimedOut, match="2 of 3 units complete"):
        c.take(6.0, deadline=6.0)  # without it, only a full batch
    assert ids(hand_out(c, 7.0, partial_at=7.0)) == ("a", "b")


# -- closing -----------------------------------------------------------------------------
def test_a_closed_core_gives_back_what_the_trainer_holds_and_refuses_commit_and_seal_by_name():
    c = core(batch_size=1)
    welcome(c)
    for tid in ("t0", "t1"):
        deliver(c, 0, tid)
    c.commit(hand_out(c).seq)
    held = hand_out(c)
    c.close()
    assert [(kind, f["leases"], f.get("requeue")) for _, kind, f in sent(c, 0.1)] == [
        ("ack", ["L-t0"], None), ("nack", ["L-t1"], True)]
    with pytest.raises(ConsumerClosed, match=f"batch seq={held.seq} went back to its brokers"):
        c.commit(held.seq)
    with pytest.raises(ConsumerClosed, match="the seal of step 1 was not sent"):
        c.seal(1)
    with pytest.raises(ConsumerClosed, match="the consumer is closed"):
        c.take(0.2)
    c.received(0, says("nack", code="unknown_consumer", message="who are you"), 0.3)
    assert sent(c, 10.0) == []  # no hello, no credit once closing


# -- what arrived ------------------------------------------------------------------------
def test_a_message_whose_handling_raises_what_no_rule_foresaw_costs_that_message_alone():
    c = core()
    welcome(c)
    delivered = c.assembler.delivered

    def fails(broker, fields, arrays, now):
        if fields["trajectory_id"] == "bug":
            raise RuntimeError("injected")
        return delivered(broker, fields, arrays, now)

    c.assembler.delivered = fails
    deliver(c, 0, "bug")
    deliver(c, 0, "fine")
    [(_, _, nack)] = sent(c, 0.1, "nack")
    assert nack["leases"] == ["L-bug"] and nack["reason"].startswith("internal: handling a deliver message")
    assert (c.stats()["internal_errors"], c.stats()["complete"]) == (1, 1)
    assert c.stats()["ready"] == 1  # the older name of `complete`, kept for one version
    jobless = core(job="eval")
    jobless.due(0.0)
    with pytest.raises(InvalidState, match="did not echo job 'eval'"):  # a rule enforced on purpose: raised
        jobless.received(0, says("welcome", broker_id="b", lease_timeout=30.0, heartbeat_interval=1.0), 0.0)
