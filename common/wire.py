"""Typed helpers for the array-bearing messages: a `Turn` as a `turn` frame
and back, a `Trajectory` as a `deliver` frame and back. Producer, broker and
consumer all go through these, so the mapping exists once."""
from __future__ import annotations

from typing import Any, Mapping

from .buffers import Pieces
from .codec import PACK_DELIVERY_UP_TO_BYTES, SPLIT_FROM_BYTES, Message, encode, encode_arrived, packed_body, worth_packing
from .errors import LocalProtocolError
from .messages import BROKER_TO_CONSUMER, PRODUCER_TO_BROKER
from .trajectory import Gap, Trajectory, Turn


def encode_turn(
    trajectory_id: str,
    index: int,
    turn: Turn,
    *,
    seq: int | None,
    prompt_tokens=None,
    group_id: str | None = None,
    group_size: int | None = None,
    sample_index: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    job: str | None = None,
    crc: bool = False,
    checked: bool = True,
    may_pack: bool = False,
) -> list:
    """Frames of a `turn` message (turn 0 carries the prompt and group);
    `seq=None` leaves the header unnumbered (`codec.number_header`),
    `checked=False` trusts fields the caller has checked (`codec.check_values`),
    and with `may_pack` the arrays go in one frame when `worth_packing`."""
    fields: dict[str, Any] = {"trajectory_id": trajectory_id, "turn": index, "status": turn.status}
    if seq is not None:
        fields["seq"] = seq
    if index == 0 or prompt_tokens is not None or group_id is not None or sample_index is not None:
        for name, value in (("group_id", group_id), ("group_size", group_size), ("sample_index", sample_index)):
            if value is not None:
                fields[name] = value
    if turn.weight_version is not None:
        fields["weight_version"] = turn.weight_version
    if turn.weight_version_spans is not None:
        fields["weight_version_spans"] = [list(span) for span in turn.weight_version_spans]
    if turn.mask_log_probs_normalized:
        fields["mask_log_probs_normalized"] = True
    if metadata is not None:
        fields["metadata"] = metadata
    if job is not None:
        fields["job"] = job
    arrays = turn.arrays()
    if prompt_tokens is not None:
        arrays["prompt_tokens"] = prompt_tokens
    return encode(PRODUCER_TO_BROKER, "turn", fields, arrays, crc=crc, checked=checked, numbered=seq is not None,
                  packed=may_pack and worth_packing(arrays))


def turn_from_message(message: Message) -> Turn:
    """The `Turn` a decoded `turn` message carries (arrays stay zero-copy,
    with the CRCs decoding verified of its large ones)."""
    return Turn.from_arrays(message.arrays, status=message.fields["status"], weight_version=message.get("weight_version"),
                            weight_version_spans=message.get("weight_version_spans"), crcs=message.array_crcs,
                            arrived=message if "prompt_tokens" in message.arrays else None)


_IDENTITY = ("group_id", "group_size", "sample_index")


def encode_deliver(trajectory: Trajectory, lease: str, *, may_pack: bool = False, may_split: bool = False,
                   **extra: Any) -> list:
    """Frames of a `deliver` message for a finished trajectory (always CRC'd;
    with `may_split`, an array held as large pieces goes a frame per piece,
    unjoined, `SPLIT_FROM_BYTES`; otherwise, with `may_pack`, its arrays go
    in one frame when they are `PACK_DELIVERY_UP_TO_BYTES` at most, or when
    some are held in pieces, which a frame per array would join first: the
    pieces are then copied once, into that frame). With `may_pack`, a
    trajectory one message brought whole (`Trajectory.arrived_whole`) packed
    within `PACK_DELIVERY_UP_TO_BYTES`, or a frame per array beyond it, goes
    as the frames that message came in, by reference.

    `extra` adds optional header fields such as `group_left` or
    `delivery_count`."""
    fields: dict[str, Any] = {
        "lease": lease,
        "trajectory_id": trajectory.trajectory_id,
        "status": trajectory.status,
        "reward": trajectory.reward,
        "response_length": trajectory.response_length,
        "weight_versions": list(trajectory.weight_versions),
        "metadata": trajectory.metadata,
        "turns": trajectory.turns,
    }
    fields.update({name: getattr(trajectory, name) for name in _IDENTITY if getattr(trajectory, name) is not None})
    if trajectory.gap is not None:
        fields["gap"] = trajectory.gap.to_wire()
    if trajectory.weight_version_spans:
        fields["weight_version_spans"] = [[list(span) for span in spans] for spans in trajectory.weight_version_spans]
    fields.update(extra)
    if may_pack and (arrived := trajectory.arrived_whole) is not None and (
            (len(arrived.frames) == 2) == (sum(map(len, arrived.frames[1:])) <= PACK_DELIVERY_UP_TO_BYTES)):
        # One turn that arrived in the layout the rule below gives it anyway (packed up to the packing size, a frame
        # per array beyond it): as it arrived, by reference. Otherwise it goes below: one frame costs the consumer
        # less than packing costs the broker.
        frames = encode_arrived(BROKER_TO_CONSUMER, "deliver", fields, arrived)
        if frames is not None:
            return frames
    if may_pack:
        shapes = trajectory.merged_shapes()
        packed = None if shapes is None else packed_body(shapes)
        if packed is not None and (packed.body.nbytes <= PACK_DELIVERY_UP_TO_BYTES if trajectory.pending_turns == 1
                                   else not (may_split and packed.body.nbytes >= 2 * SPLIT_FROM_BYTES)):
            # Written in place, one copy: one turn's arrays as `worth_packing` packs them (larger ones go a frame
            # each, as they arrived); several turns' from their pieces (no array averages SPLIT_FROM_BYTES over them).
            trajectory.merge_into(packed.arrays)
            packed.crcs.update(trajectory.merged_crcs())
            return encode(BROKER_TO_CONSUMER, "deliver", fields, packed, crc=True)
        pieces = trajectory.arrays(parts_from=0)  # every array still held in pieces as the list of them
        held = [array for array in pieces.values() if isinstance(array, Pieces)]
        split = may_split and any(array.large(SPLIT_FROM_BYTES) for array in held)
        if not split and (held or worth_packing(pieces, PACK_DELIVERY_UP_TO_BYTES)):
            return encode(BROKER_TO_CONSUMER, "deliver", fields, pieces, crc=True, packed=True)
    arrays = trajectory.arrays(parts_from=SPLIT_FROM_BYTES if may_split else None)
    return encode(BROKER_TO_CONSUMER, "deliver", fields, arrays, crc=True)



def trajectory_from_deliver(message: Message) -> Trajectory:
    """Rebuild the delivered trajectory (its read-only arrays are taken as
    they are, zero-copy). Arrays that break a rule of the data model are a
    `RemoteProtocolError`: the delivery broke it."""
    gap = message.get("gap")
    try:
        trajectory = Trajectory.from_arrays(
            message["trajectory_id"],
            message.arrays,
            status=message["status"],
            turns=message.get("turns", 0),
            weight_versions=message["weight_versions"],
            weight_version_spans=message.get("weight_version_spans", ()),
            gap=Gap(gap["turn"], gap["field"]) if gap else None,
            metadata=message["metadata"],
            **{name: message.get(name) for name in _IDENTITY},
        )
    except LocalProtocolError as error:
        raise error.as_remote() from None
    trajectory.reward = message["reward"]
    return trajectory
