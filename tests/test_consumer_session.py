"""The consumer's protocol conduct (`consumer.session.Sessions`) driven
without sockets or clocks: hellos and their retry, heartbeats at half the
broker's interval, credit once welcomed, saying hello again after
`unknown_consumer`, deliveries of a dropped session ignored, undecodable
deliveries handed back, and closing."""
import numpy as np
import pytest
from consumer_helpers import make_rollout

from rollstream.common.codec import Message, decode
from rollstream.common.errors import InvalidState, ProtocolError
from rollstream.common.messages import BROKER_TO_CONSUMER
from rollstream.common.wire import encode_deliver
from rollstream.consumer.assembly import Assembler
from rollstream.consumer.session import Sessions, SessionState


def sessions(brokers: int = 1) -> Sessions:
    return Sessions(Assembler(brokers, batch_size=1, unit="trajectory"), [f"ipc://b{i}" for i in range(brokers)],
                    consumer_id="c", hello_timeout=5.0)


def kinds(out) -> list[tuple[int, str]]:
    return [(broker, kind) for broker, kind, _ in out]


def welcome(interval: float = 2.0) -> Message:
    return Message("welcome", {"broker_id": "b", "lease_timeout": 30.0, "heartbeat_interval": interval}, {})


def refusal(code: str, **fields) -> Message:
    return Message("nack", {"code": code, "message": "x", **fields}, {})


def deliver(tid: str, lease: str) -> Message:
    return decode(encode_deliver(make_rollout(np.random.default_rng(1), tid).merged(), lease), BROKER_TO_CONSUMER)


def test_hello_goes_once_and_again_only_after_the_hello_timeout():
    s = sessions(2)
    assert kinds(s.due(0.0, closing=False)) == [(0, "hello"), (1, "hello")]
    assert s.due(4.0, closing=False) == []
    assert kinds(s.due(5.5, closing=False)) == [(0, "hello"), (1, "hello")]
    _, _, fields = s.due(11.0, closing=False)[0]
    assert fields == {"consumer_id": "c", "packed_arrays": True, "split_arrays": True, "queued_counts": True}


def test_a_consumer_of_a_job_names_it_and_fails_on_a_broker_that_does_not_keep_jobs_apart():
    s = Sessions(Assembler(1, batch_size=1, unit="trajectory"), ["ipc://b0"], consumer_id="c", hello_timeout=5.0,
                 job="eval")
    [(_, _, hello)] = s.due(0.0, closing=False)
    assert hello["job"] == "eval"
    with pytest.raises(InvalidState, match="rule 'a broker keeps jobs apart' not met: .* did not echo job 'eval'"):
        s.received(0, welcome(), 1.0)
    s.received(0, Message("welcome", {**welcome().fields, "job": "eval"}, {}), 1.0)
    assert s.sessions[0].state == SessionState.WELCOMED


def test_a_welcome_opens_credit_and_heartbeats_at_half_the_interval():
    s = sessions()
    s.due(0.0, closing=False)
    s.received(0, welcome(interval=2.0), 1.0)
    assert s.sessions[0].state == SessionState.WELCOMED
    first = s.due(1.0, closing=False)
    assert ("credit" in [kind for _, kind, _ in first]) and "heartbeat" not in [kind for _, kind, _ in first]
    assert kinds(s.due(1.9, closing=False)) == []
    assert kinds(s.due(2.0, closing=False)) == [(0, "heartbeat")]
    assert kinds(s.due(2.5, closing=False)) == []
    assert kinds(s.due(3.0, closing=False)) == [(0, "heartbeat")]


def test_unknown_consumer_drops_what_the_broker_forgot_and_says_hello_again():
    s = sessions()
    s.due(0.0, closing=False)
    s.received(0, welcome(), 0.0)
    s.due(0.0, closing=False)
    s.received(0, deliver("t", "L1"), 0.1)
    assert s.assembler.complete == 1
    s.received(0, refusal("unknown_consumer"), 0.2)
    assert s.sessions[0].state == SessionState.NEW and s.assembler.complete == 0
    assert kinds(s.due(0.3, closing=False)) == [(0, "hello")]
    s.received(0, deliver("u", "L2"), 0.4)  # from the session the broker dropped: not ours any more
    assert s.assembler.complete == 0
    s.received(0, refusal("unknown_consumer"), 0.5)  # a second one before the welcome changes nothing
    assert s.sessions[0].state == SessionState.HELLO_SENT


def test_an_undecodable_delivery_goes_back_requeued_only_when_its_bytes_were_damaged():
    s = sessions()
    s.due(0.0, closing=False)
    s.received(0, welcome(), 0.0)
    s.due(0.0, closing=False)
    s.undecodable(0, {"type": "deliver", "lease": "L-crc"}, ProtocolError("crc_mismatch", "bad crc"))
    s.undecodable(0, {"type": "deliver", "lease": "L-dtype"}, ProtocolError("dtype", "float64"))
    s.undecodable(0, {"type": "ack"}, ProtocolError("malformed", "junk"))  # not a delivery: only logged
    settled = {tuple(fields["leases"]): fields for _, kind, fields in s.due(0.1, closing=False) if kind == "nack"}
    assert settled[("L-crc",)]["requeue"] is True  # damaged on the way: the broker sends it again
    assert settled[("L-dtype",)]["requeue"] is False and "dtype: float64" in settled[("L-dtype",)]["reason"]
    assert s.assembler.stats.undecodable == 2


def test_closing_sends_no_hello_and_no_credit():
    s = sessions()
    assert s.due(0.0, closing=True) == []
    s.due(0.1, closing=False)
    s.received(0, welcome(), 0.2)
    assert [kind for _, kind, _ in s.due(0.2, closing=True)] == []


def test_a_published_policy_goes_to_every_welcomed_broker_once_and_again_after_a_new_welcome():
    s = sessions(2)
    s.max_staleness = 3
    s.due(0.0, closing=False)
    s.publish(7, per_step=16)
    assert [k for k in kinds(s.due(0.1, closing=False)) if k[1] == "policy"] == []  # nobody welcomed yet
    s.received(0, welcome(), 0.2)
    policies = [(b, f) for b, kind, f in s.due(0.3, closing=False) if kind == "policy"]
    assert policies == [(0, {"version": 7, "share": 0.5, "max_staleness": 3, "per_step": 16})]
    assert not [k for k in kinds(s.due(0.4, closing=False)) if k[1] == "policy"]  # said once
    s.received(1, welcome(), 0.5)
    s.publish(8, per_step=16)
    assert sorted(b for b, kind, _ in s.due(0.6, closing=False) if kind == "policy") == [0, 1]
    s.received(0, welcome(), 0.7)  # a new session of broker 0 (it restarted): it hears the policy again
    assert [(b, f["version"]) for b, kind, f in s.due(0.8, closing=False) if kind == "policy"] == [(0, 8)]


def test_the_bound_in_force_is_the_lowest_the_trainer_or_a_broker_named():
    s = sessions(2)
    assert s.bound() is None and s.stale_below() is None
    s.publish(10)
    assert s.stale_below() is None  # no bound anywhere
    s.received(1, Message("policy", {"version": 10, "max_staleness": 4}, {}), 0.0)
    assert (s.bound(), s.stale_below()) == (4, 6)
    s.max_staleness = 2
    assert (s.bound(), s.stale_below()) == (2, 8)


def test_a_policy_the_broker_could_not_persist_is_sent_again():
    s = sessions(1)
    s.due(0.0, closing=False)
    s.received(0, welcome(), 0.1)
    s.publish(3)
    assert [kind for _, kind, _ in s.due(0.2, closing=False)].count("policy") == 1
    s.received(0, refusal("unavailable"), 0.3)
    assert [kind for _, kind, _ in s.due(0.4, closing=False)].count("policy") == 1


def test_admission_shares_follow_each_brokers_demand_and_never_fall_under_the_floor():
    s = sessions(2)
    s.due(0.0, closing=False)
    for broker in (0, 1):
        s.received(broker, welcome(), 0.1)
    s.publish(3, per_step=8)
    assert [f["share"] for _, kind, f in s.due(0.2, closing=False) if kind == "policy"] == [0.5, 0.5]  # none said yet
    # broker 0's node is busy (it holds 12 and made 4 new trajectories wait), broker 1's is idle
    s.received(0, Message("policy", {"version": 3, "held": 12, "waiting": 4}, {}), 0.3)
    s.received(1, Message("policy", {"version": 3, "held": 0, "waiting": 0}, {}), 0.3)
    s.publish(4, per_step=8)
    shares = {b: f["share"] for b, kind, f in s.due(0.4, closing=False) if kind == "policy"}
    # raw 16/16 and 0/16; the idle one floored at 0.25 of an equal share (0.125), then both renormalised
    assert shares == pytest.approx({0: 1 / 1.125, 1: 0.125 / 1.125})
    s.received(1, Message("policy", {"version": 4, "held": 4, "waiting": 12}, {}), 0.5)  # its producers are back
    s.received(0, Message("policy", {"version": 4, "held": 16, "waiting": 0}, {}), 0.5)
    s.publish(5, per_step=8)
    shares = {b: f["share"] for b, kind, f in s.due(0.6, closing=False) if kind == "policy"}
    assert shares == pytest.approx({0: 0.5, 1: 0.5})
