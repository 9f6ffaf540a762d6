"""Message builders shared by the broker tests: real encode -> decode round
trips, so the engine sees exactly what the service would hand it."""
import numpy as np

from rollstream.broker import core
from rollstream.common.codec import decode, encode
from rollstream.common.messages import PRODUCER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn


def turn_msg(tid, index, tokens=(10,), supports=None, forced=None, status="completed", seq=None, group=None,
             prompt=(1, 2), job=None, **turn_kw):
    turn = Turn.build(list(tokens), [-0.5] * len(tokens), supports=supports, forced_tokens=forced, status=status, **turn_kw)
    extra = {}
    if index == 0:
        extra["prompt_tokens"] = np.array(prompt, np.int32)
        if group:
            extra["group_id"], extra["group_size"] = group
    frames = encode_turn(tid, index, turn, seq=index if seq is None else seq, job=job, **extra)
    return decode(frames, PRODUCER_TO_BROKER)


def end_msg(tid, reward=1.0, seq=100, metadata=None, turns=None, job=None):
    """An `end`; with `reward=None` one whose reward comes later (`reward_msg`)."""
    fields = {"seq": seq, "trajectory_id": tid, **({} if reward is None else {"reward": reward}),
              **({} if job is None else {"job": job})}
    if metadata is not None:
        fields["metadata"] = metadata
    if turns is not None:
        fields["turns"] = turns
    return decode(encode(PRODUCER_TO_BROKER, "end", fields), PRODUCER_TO_BROKER)


def reward_msg(tid, reward, seq=300, job=None):
    fields = {"seq": seq, "trajectory_id": tid, "reward": reward, **({} if job is None else {"job": job})}
    return decode(encode(PRODUCER_TO_BROKER, "reward", fields), PRODUCER_TO_BROKER)


def abort_msg(tid, seq=200, reason="retry", again=None):
    fields = {"seq": seq, "trajectory_id": tid, "reason": reason, **({} if again is None else {"again": again})}
    return decode(encode(PRODUCER_TO_BROKER, "abort", fields), PRODUCER_TO_BROKER)


def handle_with_store(engine, store, message, wall):
    """`engine.handle`, given the stored digests it names, read from `store`
    (as the broker core reads them for a batch)."""
    keys = engine.stored_digests_needed([message])
    return engine.handle(message, wall, {key: store.turn_digest(*key) for key in keys})


def drive(steps, **answers):
    """Run one `BrokerCore` input to its end (`core.drive`) and return what
    it asked for, in order. Each request is answered as a healthy store and
    sockets would (commits and sends succeed, the store probes well, nothing
    measured), or by `answers[type name](request)` where given; a read is
    never answered by default."""
    healthy = {"Commit": lambda request: None, "Send": lambda request: core.Sent.TAKEN,
               "Probe": lambda request: True, "PruneDedup": lambda request: None, "Checkpoint": lambda request: None,
               "MeasureDisk": lambda request: (0, 1 << 40), "ArchiveStep": lambda request: None}
    healthy.update(answers)
    asked = []

    def recorded(answer):
        def perform(request):
            asked.append(request)
            return answer(request)
        return perform

    core.drive(steps, {getattr(core, name): recorded(answer) for name, answer in healthy.items()})
    return asked


def housekeep(broker, now, between=(), **answers):
    """One housekeeping pass at `now`, as the service runs it: its first
    half, the consumer messages `between` (what waited behind it), its
    second half. What it asked for, in order (`drive`)."""
    asked = drive(broker.housekeeping(now), **answers)
    if between:
        asked += drive(broker.consumer_read(list(between), now), **answers)
    return asked + drive(broker.finish_housekeeping(now), **answers)
