"""The wire codec (docs/protocol.md §2): a msgpack header plus one raw
little-endian frame per array.

Decoding is strict and runs its checks in the protocol's order, raising a
`RemoteProtocolError` with the reply code of the first failure (what arrived
broke the rule); encoding refuses what would break one with a
`LocalProtocolError`. Arrays are wrapped zero-copy and read-only. No pickle
anywhere: arrays never enter msgpack.
"""
from __future__ import annotations

import math
import operator
import threading
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import msgpack
import msgspec
import numpy as np
import xxhash

from .contract import ARRAYS, DEFAULT_MAX_MESSAGE_BYTES, PROTOCOL_VERSION
from .errors import InvalidInput, LocalProtocolError, ProtocolError, RemoteProtocolError
from .messages import CRC32, MessageSpec, Schema
from .validation import RULE_ALIGNED, check_message_arrays

_crc32_combine: Callable[[int, int, int], int] | None
try:  # the same CRC-32 as zlib's, faster where ISA-L is available (docs/performance.md)
    from isal.isal_zlib import crc32 as _crc32_update
    from isal.isal_zlib import crc32_combine as _crc32_combine
except ImportError:  # pragma: no cover - platforms without an isal wheel
    from zlib import crc32 as _crc32_update
    _crc32_combine = None


class _Packers(threading.local):
    """A msgpack Packer per thread, reused for every header: `packb` builds
    a Packer per call, a cost a small header does not amortise
    (docs/performance.md)."""

    def __init__(self):
        self.pack = msgpack.Packer(use_bin_type=True).pack


_PACKERS = _Packers()


class Message:
    """A decoded message: its type, known header fields and arrays, and the
    received frames (when decoded: a store keeps them verbatim). Treated as
    immutable; a plain slotted class because one is made per frame."""

    __slots__ = ("type", "fields", "arrays", "frames", "crc32", "array_crcs", "get")

    def __init__(self, type: str, fields: Mapping[str, Any], arrays: Mapping[str, np.ndarray], frames: tuple = (),
                 crc32: int | None = None, array_crcs: Mapping[str, int] | None = None):
        self.type, self.fields, self.arrays, self.frames = type, fields, arrays, frames
        self.crc32 = crc32  # the CRC of its array frames, when decoding verified one
        self.array_crcs = array_crcs  # then also the CRC of each array of `CRC_KEPT_FROM_BYTES` or more, by name
        self.get: Callable[..., Any] = fields.get  # `get(name, default=None)`: the fields' own, one call on hot paths

    def __repr__(self) -> str:
        return f"Message({self.type!r}, fields={dict(self.fields)!r}, arrays={sorted(self.arrays)})"

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


def _buffer(frame) -> bytes | memoryview:
    """A zero-copy, read-only byte view of a frame: bytes (as they are), a
    memoryview or a zmq.Frame. Either way `len()` is its size in bytes, and
    arrays wrapped around it are read-only without further calls."""
    kind = type(frame)
    if kind is bytes:
        return frame
    if kind is not memoryview or frame.ndim != 1 or frame.format != "B":  # a received frame's buffer already is
        frame = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
        if frame.format != "B" or frame.ndim != 1:
            frame = frame.cast("B")
    return frame if frame.readonly else frame.toreadonly()


def _bytes_view(arr: np.ndarray) -> memoryview:
    """The array's bytes in C order, zero-copy when it is C-contiguous."""
    if arr.flags.c_contiguous:
        return arr.data.cast("B") if arr.size else memoryview(b"")  # a view with a zero in its shape cannot be cast
    return np.ascontiguousarray(arr).data.cast("B")


def _schema_error(message: str) -> LocalProtocolError:
    """A schema rule broken, as the checks encoding and decoding share raise
    it (`decode` turns it into a `RemoteProtocolError`)."""
    return LocalProtocolError("schema", message)


def _remote_schema_error(message: str) -> RemoteProtocolError:
    """A schema rule broken by what arrived (checks only decoding makes)."""
    return RemoteProtocolError("schema", message)


def _check_fields(spec: MessageSpec, header: Mapping[str, Any], array_names: frozenset) -> dict:
    """Known fields of `header`, checked against `spec`; unknown keys are dropped."""
    fields = {}
    kinds = spec.kinds
    for name, value in header.items():
        kind = kinds.get(name)
        if kind is None:  # the envelope (v, type, arrays, crc32) or a key from a newer peer
            continue
        if not kind.accepts(value):
            raise _schema_error(f"{spec.type}.{name} must be {kind.describe}, got {type(value).__name__} {value!r:.80}")
        fields[name] = value
    if not spec.required_names <= fields.keys():
        missing = [name for name in spec.required if name not in fields]
        raise _schema_error(f"{spec.type} is missing required field(s) {missing}")
    _check_arrays_and_rules(spec, fields, array_names)
    return fields


def _check_arrays_and_rules(spec: MessageSpec, fields: Mapping[str, Any], array_names: frozenset) -> None:
    """The arrays a message type may and must carry, and its cross-field rules."""
    if not array_names <= spec.array_names:
        unknown = array_names - spec.array_names
        raise _schema_error(f"{spec.type} may not carry array(s) {sorted(unknown)}; allowed: {sorted(spec.array_names)}")
    if not spec.required_arrays <= array_names:
        absent = [name for name in spec.arrays if name not in array_names]
        raise _schema_error(f"{spec.type} is missing required array(s) {absent}")
    for rule in spec.rules:
        problem = rule(fields, array_names)
        if problem:
            raise _schema_error(f"{spec.type}: {problem}")


def check_values(schema: Schema, mtype: str, values: Mapping[str, Any]) -> None:
    """Each of `values` (those not None) against its kind in the message
    type's spec, as decoding checks it (`LocalProtocolError("schema")` naming the
    field): for a sender that checks a trajectory's fields once and then
    encodes its turns unchecked."""
    spec = _spec(schema, mtype)
    for name, value in values.items():
        if value is not None and not spec.kinds[name].accepts(value):
            kind = spec.kinds[name]
            raise _schema_error(f"{spec.type}.{name} must be {kind.describe}, got {type(value).__name__} {value!r:.80}")


def _spec(schema: Schema, mtype) -> MessageSpec:
    if not isinstance(mtype, str):
        raise _schema_error(f"type must be a string, got {type(mtype).__name__}")
    spec = schema.specs.get(mtype)
    if spec is None:
        raise _schema_error(f"unknown message type {mtype!r} for {schema.name}; expected one of {sorted(schema.specs)}")
    return spec


def crc32_of(buffers: Sequence) -> int:
    """zlib CRC-32 over `buffers` in order, as the protocol's crc32 field."""
    crc = 0
    for buf in buffers:
        crc = _crc32_update(buf, crc)
    return crc


# A verified frame this large keeps its own CRC-32 (`Message.array_crcs`), so
# that sending its bytes on unjoined, as a piece of a delivery
# (`SPLIT_FROM_BYTES`), combines it rather than reads them again. Keeping it
# costs a combine (under a microsecond) instead of nothing.
CRC_KEPT_FROM_BYTES = 64 << 10


def _crc32_keeping_large(buffers: Sequence) -> tuple[int, dict[int, int] | None]:
    """`crc32_of(buffers)`, and the CRC of each buffer of at least
    `CRC_KEPT_FROM_BYTES` by its index (None when there is none)."""
    if _crc32_combine is None:
        return crc32_of(buffers), None
    crc, kept = 0, None
    for i, buf in enumerate(buffers):
        if len(buf) < CRC_KEPT_FROM_BYTES:
            crc = _crc32_update(buf, crc)
            continue
        own = _crc32_update(buf)
        crc = _crc32_combine(crc, own, len(buf))
        if kept is None:
            kept = {}
        kept[i] = own
    return crc, kept


def crc32_joined(parts: Sequence[tuple[int, int]]) -> int | None:
    """The CRC-32 of buffers end to end, from each one's `(crc, nbytes)`,
    none of them read; None where CRCs cannot be combined (zlib alone)."""
    if _crc32_combine is None:
        return None
    value = 0
    for crc, size in parts:
        value = _crc32_combine(value, crc, size)
    return value


def crc32_continued(head: Sequence, tail: Sequence, tail_crc: int | None) -> int:
    """`crc32_of([*head, *tail])`; given `tail_crc`, the CRC of `tail` (a
    received message's verified `crc32`), without reading `tail` again."""
    if tail_crc is None or _crc32_combine is None:
        return crc32_of([*head, *tail])
    return _crc32_combine(crc32_of(head), tail_crc, sum(map(len, tail)))


# -- encoding -----------------------------------------------------------------
def encode(
    schema: Schema,
    mtype: str,
    fields: Mapping[str, Any] | None = None,
    arrays: "Mapping[str, np.ndarray | list[np.ndarray]] | PackedBody | None" = None,
    *,
    crc: bool = False,
    checked: bool = True,
    numbered: bool = True,
    packed: bool = False,
) -> list:
    """Frames `[header, buf_0, ...]` for one message, checked against `schema`.

    Arrays must already have their contract dtypes (nothing is converted);
    frames are zero-copy views, so the arrays must not change until sent.
    Raises `LocalProtocolError` when the message would break the schema.
    `checked=False` skips the header check for replies built from fields
    that were themselves checked (the broker's acks, on its hot path).
    A 1-D array may be given as a list of parts: it travels as one frame
    per part, its entry saying how many (docs/protocol.md §2, `split_arrays`),
    so a sender holding it in pieces need not join them; given as
    `buffers.Pieces`, a piece whose CRC it knows is not read for the CRC.
    `numbered=False` leaves `seq` out of the header (and out of `fields`):
    `number_header` adds it later at a fixed width, so a producer knows a
    frame's size before it numbers it. `packed=True` sends every array in
    one frame, `[header, arrays]`, widest items first (docs/protocol.md §2):
    one copy of the arrays, and one frame for each side to handle instead of
    one per array. A `PackedBody` its holder has written goes as that frame.
    """
    spec = _spec(schema, mtype)
    fields = fields or {}
    arrays = arrays or {}
    if checked:
        _check_fields(spec, fields if numbered else {**fields, "seq": 0},
                      frozenset(arrays.arrays if isinstance(arrays, PackedBody) else arrays))
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": mtype, **fields}
    if isinstance(arrays, PackedBody):
        return _packed_message(header, arrays.entries, arrays.body, crc, arrays.crcs)
    if not arrays:
        return [_PACKERS.pack(header)]
    if packed:
        return _packed_frames(header, arrays, crc)
    entries, buffers, value = [], [], 0
    for name, arr in arrays.items():
        contract = ARRAYS[name]
        parts = arr if isinstance(arr, list) else None  # one array in several frames (`split_arrays`)
        known = getattr(parts, "crcs", None) if crc and _crc32_combine is not None else None
        for i, part in enumerate(parts or (arr,)):
            view = _bytes_view(_check_part(name, contract, part))
            buffers.append(view)
            if known is not None and known[i] is not None and _crc32_combine is not None:
                value = _crc32_combine(value, known[i], len(view))
            elif crc:
                value = _crc32_update(view, value)
        entry = _array_entry(name, contract, arr, parts)
        entries.append(entry if parts is None else [*entry, len(parts)])
    header["arrays"] = entries
    if crc:
        header["crc32"] = value
    return [_PACKERS.pack(header), *buffers]


def _array_entry(name: str, contract, arr, parts: list | None) -> list:
    """The header's `[name, dtype, shape]` of an array, or of one given in
    `parts` (1-D only: their lengths end to end)."""
    if parts is None:
        return [name, contract.wire_name, list(arr.shape)]
    if contract.ndim != 1:
        raise LocalProtocolError("shape", f"array {name!r} is {contract.rank_rule()}: only a 1-D array travels in parts")
    return [name, contract.wire_name, [sum(map(len, parts))]]


def _check_part(name: str, contract, part) -> np.ndarray:
    """`part`, once it is an array (or a piece of one) of the contract's dtype and rank."""
    if not isinstance(part, np.ndarray) or (part.dtype is not contract.dtype and part.dtype != contract.dtype):
        got = part.dtype if isinstance(part, np.ndarray) else type(part).__name__
        raise LocalProtocolError("dtype", f"array {name!r} must be {contract.wire_name}, got {got}")
    if part.ndim != contract.ndim and not contract.rank_ok(part.ndim):
        raise LocalProtocolError("shape", f"array {name!r} must be {contract.rank_rule()}, got shape {list(part.shape)}")
    return part


_WIDEST_FIRST = {name: -spec.dtype.itemsize for name, spec in ARRAYS.items()}
# By the names packed, in the order given: (name, contract) in their order in the body. Callers give a few orders.
_PACKING_ORDERS: dict[tuple, list] = {}
_PACKING_ORDERS_KEPT = 64


def _packing_order(names: tuple) -> list:
    """`(name, contract)` of each of `names` in the order a packed body holds
    them: widest items first, so that each array starts aligned."""
    order = _PACKING_ORDERS.get(names)
    if order is None:
        if len(_PACKING_ORDERS) >= _PACKING_ORDERS_KEPT:
            _PACKING_ORDERS.clear()
        order = _PACKING_ORDERS[names] = [(name, ARRAYS[name]) for name in sorted(names, key=_WIDEST_FIRST.__getitem__)]
    return order


def _packed_frames(header: dict, arrays: Mapping[str, Any], crc: bool) -> list:
    """`[header, body]`: every array (the pieces of one given as a list, in
    order) end to end in one frame, widest items first so each starts
    aligned, joined in one pass, and the CRC read over the joined bytes."""
    order = _packing_order(tuple(arrays))
    entries, pieces = [], []
    for name, contract in order:
        arr = arrays[name]
        if type(arr) is np.ndarray and arr.dtype is contract.dtype and arr.ndim == contract.ndim:  # the common case
            pieces.append(arr)
            entries.append([name, contract.wire_name, list(arr.shape)])
            continue
        parts = arr if isinstance(arr, list) else None
        for part in (arr,) if parts is None else parts:
            if type(part) is not np.ndarray or part.dtype is not contract.dtype or part.ndim != contract.ndim:
                _check_part(name, contract, part)
            pieces.append(part)
        entries.append(_array_entry(name, contract, arr, parts))
    try:
        body = b"".join(pieces)  # type: ignore[arg-type]  # arrays are buffers: numpy types __buffer__ only from Python 3.12
    except (BufferError, TypeError):  # a piece not contiguous is not bytes-like
        body = b"".join(np.ascontiguousarray(piece) for piece in pieces)  # type: ignore[misc]
    return _packed_message(header, entries, body, crc)


class PackedBody(NamedTuple):
    """A packed frame's body laid out before its arrays are written
    (`packed_body`): whoever holds them in pieces writes each straight into
    its place, one copy, then `encode` sends it."""

    body: np.ndarray  # bytes, not zeroed: every one of them is an array's, to be written
    arrays: dict[str, np.ndarray]  # by name, a writable view of its place in `body`
    entries: list  # the header's `[name, dtype, shape]` of each, in the body's order
    crcs: dict[str, int]  # by name, the CRC-32 its writer knows of an array's bytes (verified on arrival): not read


def packed_body(shapes: Mapping[str, tuple]) -> PackedBody:
    """A body for arrays of these shapes, laid out as `encode` packs them
    (the same order of names gives the same bytes). Not zeroed: its holder
    writes every array."""
    order = _packing_order(tuple(shapes))
    offsets: list[tuple[int, int]] = []
    size = 0
    for name, contract in order:
        shape = shapes[name]
        try:
            (count,) = shape  # the common case, 1-D
        except ValueError:
            if not contract.rank_ok(len(shape)):
                raise LocalProtocolError("shape", f"array {name!r} must be {contract.rank_rule()}, got shape "
                                                  f"{list(shape)}") from None
            count = math.prod(shape)
        offsets += ((size, count),)
        size += count * contract.dtype.itemsize
    body = np.empty(size, np.uint8)
    arrays = {name: np.frombuffer(body, contract.dtype, count, offset).reshape(shapes[name])
              for (name, contract), (offset, count) in zip(order, offsets)}
    return PackedBody(body, arrays, [[name, contract.wire_name, list(shapes[name])] for name, contract in order], {})


def _packed_message(header: dict, entries: list, body, crc: bool, known: Mapping[str, int] | None = None) -> list:
    """`[header, body]` of a packed message whose arrays, listed in
    `entries`, lie in `body`, the CRC read over its bytes but those of the
    arrays whose CRC `known` gives, which it combines instead."""
    header["arrays"] = entries
    if crc:
        header["crc32"] = (_crc32_update(body) if not known or _crc32_combine is None else
                           _packed_crc(entries, body, known, _crc32_combine))
    header["packed"] = True
    return [_PACKERS.pack(header), body]


def _packed_crc(entries: list, body, known: Mapping[str, int], combine: Callable[[int, int, int], int]) -> int:
    """The CRC-32 of a packed `body`: each run of arrays not in `known` read
    in one call, each array in it combined from its known CRC. Combined,
    the CRC still tells a consumer whether the bytes it got are those
    verified on arrival, copies on the way included."""
    value = start = read_from = 0
    for name, _, shape in entries:
        size = _DECODING[name][2] * math.prod(shape)
        own = known.get(name)
        if own is not None:
            if start > read_from:
                value = _crc32_update(body[read_from:start], value)
            value = combine(value, own, size)
            read_from = start + size
        start += size
    return _crc32_update(body[read_from:start], value) if start > read_from else value


def encode_arrived(schema: Schema, mtype: str, fields: Mapping[str, Any], arrived: Message) -> list | None:
    """Frames of a message carrying the arrays `arrived` (a decoded message)
    came with, as the frames they came in: sent by reference, neither copied
    nor read again, under the CRC decoding verified. None when they cannot
    go so: no verified CRC (a record read back), or an array that came in
    parts, joined on arrival."""
    arrays, frames = arrived.arrays, arrived.frames
    if arrived.crc32 is None or not arrays or (len(frames) != 1 + len(arrays) and len(frames) != 2):
        return None
    _check_fields(_spec(schema, mtype), fields, frozenset(arrays))
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": mtype, **fields,
                              "arrays": [[name, _DECODING[name][0], list(arr.shape)] for name, arr in arrays.items()],
                              "crc32": arrived.crc32}
    if len(frames) != 1 + len(arrays):  # all of them in one frame, in the listed order
        header["packed"] = True
    return [_PACKERS.pack(header), *frames[1:]]


# -- batches (docs/protocol.md §3, batched frames) ---------------------------------
BATCH_ALIGN = 8  # every frame of a batched message starts at a multiple of this in the body
_PADDING = bytes(BATCH_ALIGN)


def encode_batch(messages: Sequence[list], body: Callable[[int], memoryview] | None = None) -> list:
    """`[header, body]` of one `batch` carrying `messages` (each an encoded
    message's frames, numbered) in order: their headers in the batch's
    header, every later frame end to end in the body, each padded to start
    at a multiple of `BATCH_ALIGN` so the arrays in it stay aligned. One
    copy of those frames; one message for both ZeroMQ ends to handle. With
    `body`, the body is written into the writable buffer `body(size)` gives
    (one used again, say), not a new one."""
    entries, pieces, offset = [], [], 0
    for frames in messages:
        lengths = []
        for frame in frames[1:]:
            pad = -offset % BATCH_ALIGN
            if pad:
                pieces.append(_PADDING[:pad])
            size = memoryview(frame).nbytes
            pieces.append(frame)
            lengths.append(size)
            offset += pad + size
        entries.append([frames[0], lengths])
    header = {"v": PROTOCOL_VERSION, "type": "batch", "messages": entries}
    if body is None:
        return [_PACKERS.pack(header), b"".join(pieces)]
    out, start = body(offset), 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        out[start:start + view.nbytes] = view
        start += view.nbytes
    return [_PACKERS.pack(header), out]


# A carried frame adds at most this to a batch besides its bytes: its
# padding (up to 7) and its part of the message's entry (a length, up to 9;
# a header's bin and list markers, up to 9).
BATCH_BYTES_PER_FRAME = 16
# What a batch adds for its own keys, beyond `batched_size` of each message
# it carries: about 25 bytes, which the 7 bytes every carried header leaves
# unused of its allowance cover once a batch carries two messages (a batch
# of one is never sent: that message goes as itself).
BATCH_ENVELOPE_BYTES = 16


def batched_size(frames: list) -> int:
    """At most how many bytes a message adds to a batch: its frames, the
    padding before each and the entry listing them."""
    return sum(map(len, frames)) + BATCH_BYTES_PER_FRAME * len(frames)


def split_batch(batch: Message) -> list[list]:
    """The messages a decoded `batch` carries, each as its frames (header
    first), in order. Each frame is copied into its own buffer, so keeping
    one message keeps none of the rest. Raises `RemoteProtocolError("shape")`
    when the body is not exactly the frames listed."""
    body = memoryview(batch.frames[1])
    messages: list[list] = []
    offset = 0
    for header, lengths in batch["messages"]:
        frames = [header]
        for size in lengths:
            offset += -offset % BATCH_ALIGN
            end = offset + size
            if end > len(body):
                raise RemoteProtocolError("shape", f"batch message {len(messages)} needs bytes up to {end}, "
                                             f"the body has {len(body)}")
            frames.append(body[offset:end].tobytes())
            offset = end
        messages.append(frames)
    if offset != len(body):
        raise RemoteProtocolError("shape", f"the batched messages take {offset} bytes, the body has {len(body)}")
    return messages


# Packing copies the arrays into one frame. Up to this many bytes the copy
# costs less than the per-frame work it saves at both ends; larger arrays
# are cheaper to send one frame each (the producer hands those to ZeroMQ
# without copying them).
PACK_UP_TO_BYTES = 65536
# The same for a broker's delivery: it copies frames up to half a MiB into
# ZeroMQ anyway, and a delivery in one frame instead of six or seven saves
# the consumer more than packing costs the broker (docs/performance.md).
PACK_DELIVERY_UP_TO_BYTES = 512 << 10


def worth_packing(arrays: Mapping[str, np.ndarray | list[np.ndarray]], up_to: int = PACK_UP_TO_BYTES) -> bool:
    """Whether `arrays` are small enough to send packed: `up_to` bytes in all."""
    total = 0
    for arr in arrays.values():
        total += arr.nbytes if type(arr) is np.ndarray else sum(part.nbytes for part in arr)
    return total <= up_to


# An array held in pieces this large on average (a trajectory's turns of
# large supports) is sent a frame per piece rather than joined first: the
# join copies every byte, a frame costs each end a microsecond or two.
SPLIT_FROM_BYTES = 256 << 10


_SEQ_ENTRY = msgpack.packb("seq") + b"\xcf"  # the key, then a uint64 marker: 8 big-endian bytes follow


def number_header(header: bytes, seq: int) -> bytes:
    """A header packed with `numbered=False`, with `seq` added as its last
    entry. The value always takes 9 bytes (msgpack's uint64 form, which
    every msgpack reader accepts for any integer), so the result's length
    does not depend on `seq`."""
    first = header[0]
    if 0x80 <= first < 0x8F:  # a fixmap with room for one more entry
        head, body = bytes((first + 1,)), header[1:]
    elif first == 0x8F:  # 15 entries: the 16th needs a map16
        head, body = b"\xde\x00\x10", header[1:]
    elif first == 0xDE:
        head, body = b"\xde" + (int.from_bytes(header[1:3], "big") + 1).to_bytes(2, "big"), header[3:]
    else:
        raise InvalidInput(f"a header must be a packed msgpack map of at most 65,534 entries, starts with {first:#04x}")
    return b"".join((head, body, _SEQ_ENTRY, seq.to_bytes(8, "big")))


def encode_error(schema: Schema, error: ProtocolError, **extra) -> list:
    """The `nack` answering a refused message."""
    fields = {"code": error.code, "message": error.message, **extra}
    if error.seq is not None:
        fields["seq"] = error.seq
    if error.expected is not None:
        fields["expected"] = error.expected
    return encode(schema, "nack", fields)


# -- decoding -----------------------------------------------------------------
def decode_header(frame) -> dict:
    """The header map of a received message, or `RemoteProtocolError("malformed")`."""
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise RemoteProtocolError("malformed", f"header is not a msgpack map: {type(exc).__name__}: {exc}") from None
    if type(header) is not dict:
        raise RemoteProtocolError("malformed", f"header must be a msgpack map, got {type(header).__name__}")
    if bytes in map(type, header):  # strict_map_key admits str and bytes keys only
        raise RemoteProtocolError("malformed", "header map keys must all be strings")
    depth = _nesting(header)
    if depth > MAX_HEADER_DEPTH:
        raise RemoteProtocolError("malformed", f"header maps and lists may nest at most {MAX_HEADER_DEPTH} levels deep, "
                                         f"this one nests {depth}")
    return header


# Levels of maps and lists a header may nest (the header map itself is the
# first). Deeper values (msgpack reads about 1,000 levels) would overflow
# the recursion of whatever later digests, compares or stores them: the
# broker crashed on 600 levels of `metadata`.
MAX_HEADER_DEPTH = 32


def _nesting(header: dict | list) -> int:
    """Levels of maps and lists in `header`, level by level (no recursion:
    the point is to refuse what recursion cannot handle)."""
    depth = 0
    level: list[dict | list] = [header]
    while level:
        depth += 1
        level = [child for item in level for child in (item.values() if type(item) is dict else item)
                 if type(child) is dict or type(child) is list]
    return depth


def _is_extents(shape: list) -> bool:
    """Every entry a non-negative int (the 1-D case without a generator)."""
    if len(shape) == 1:
        extent = shape[0]
        return type(extent) is int and extent >= 0
    return all(type(extent) is int and extent >= 0 for extent in shape)


def _array_entries(header: Mapping[str, Any], frame_count: int, packed: bool) -> tuple[list, frozenset, list | None]:
    """The header's array entries `(name, dtype, shape)`, checked, the set
    of their names, and how many frames each spans (None: one each)."""
    entries = header.get("arrays", ())
    if type(entries) is not list and entries != ():
        raise _remote_schema_error(f"arrays must be a list of [name, dtype, shape], got {type(entries).__name__}")
    parsed, seen, spans = [], set[str](), []
    for entry in entries:
        if not (type(entry) is list and len(entry) in (3, 4) and type(entry[0]) is str):
            raise _remote_schema_error(f"arrays entries must be [name, dtype, shape] or [name, dtype, shape, frames], "
                                f"got {entry!r:.80}")
        name, dtype, shape = entry[:3]
        _check_array_name(name, seen)
        if type(shape) is not list or not _is_extents(shape):
            raise _remote_schema_error(f"array {name!r} shape must be a list of non-negative integers, got {shape!r:.80}")
        span = 1
        if len(entry) == 4:
            span = entry[3]
            if packed:
                raise _remote_schema_error(f"array {name!r} lists its frames in a packed message, which has one frame in all")
            if type(span) is not int or span < 1:
                raise _remote_schema_error(f"array {name!r} frames must be an integer >= 1, got {span!r:.40}")
            if len(shape) != 1:
                raise _remote_schema_error(f"array {name!r} in {span} frames must be 1-D, got shape {shape}")
        parsed.append((name, dtype, shape))
        spans.append(span)
    spanned = sum(spans) != len(spans)
    return parsed, _frame_count_checked(seen, frame_count, packed, sum(spans)), spans if spanned else None


def _check_array_name(name: str, seen: set) -> None:
    if name not in ARRAYS:
        raise _remote_schema_error(f"unknown array {name!r}; expected one of {sorted(ARRAYS)}")
    if name in seen:
        raise _remote_schema_error(f"array {name!r} is listed twice")
    seen.add(name)


def _array_frame_count(spec: MessageSpec, frame_count: int, entries) -> int:
    """How many of a message's frames the array rules count: all of them,
    but for a type with a body frame, which must have exactly that one
    and list no arrays."""
    if not spec.body:
        return frame_count
    if entries:
        raise _remote_schema_error(f"a {spec.type} lists no arrays: what it carries is in its body frame")
    if frame_count != 2:
        raise _remote_schema_error(f"a {spec.type} is a header and one body frame, this one has {frame_count - 1} frame(s) "
                            "after its header")
    return 1


def _frame_count_checked(names: set, frame_count: int, packed: bool, listed_frames: int | None = None) -> frozenset:
    if packed:
        if frame_count != 1 + min(1, len(names)):
            raise _remote_schema_error(f"a packed message has its {len(names)} array(s) in {min(1, len(names))} frame(s), "
                                f"this one has {frame_count - 1}")
    elif frame_count != 1 + (listed := len(names) if listed_frames is None else listed_frames):
        raise _remote_schema_error(f"header lists {len(names)} array(s) in {listed} frame(s), message has "
                            f"{frame_count - 1} array frame(s)")
    return frozenset(names)


def _plain_header(schema: Schema, frame) -> tuple[MessageSpec, dict, list, int | None, bool] | None:
    """The header decoded and its fields checked by the schema's msgspec
    decoder (the fields it keeps raw read and checked here): its spec,
    fields, array entries, CRC and layout. None when the schema has no such
    decoder or it refuses the header (any rule broken, or a key it does not
    know): then the checked way decodes it, and names the rule if there is
    one."""
    if schema.fast is None:
        return None
    try:
        header = schema.fast.decode(frame)
    except (msgspec.MsgspecError, RecursionError):  # msgspec gives up on a raw value nested past its stack
        return None
    unset = msgspec.UNSET
    spec, names, raw = schema.fast_specs[type(header)]
    fields = {}
    for name in names:
        value = getattr(header, name)
        if value is not unset:
            fields[name] = value
    if not _raw_fields_read(fields, raw):
        return None
    crc = header.crc32
    return spec, fields, header.arrays, None if crc is unset else crc, header.packed


def _raw_fields_read(fields: dict, raw: Mapping[str, Any]) -> bool:
    """Each field of `fields` msgspec kept raw (`raw`: their kinds) read in
    place as the checked way reads it; False when one is unreadable or not
    of its kind (the checked way then refuses it, naming the rule)."""
    for name, kind in raw.items():
        if name in fields:
            value = _raw_value(fields[name])
            if value is _UNREADABLE or not kind.accepts(value):
                return False
            fields[name] = value
    return True


_UNREADABLE = object()


def _raw_value(raw: msgspec.Raw) -> Any:
    """A field msgspec kept raw, read as `decode_header` reads a whole
    header (msgpack's strict map keys, at most `MAX_HEADER_DEPTH` levels
    with the header's own); `_UNREADABLE` where that would refuse it."""
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several unrelated types on garbage
        return _UNREADABLE
    if (type(value) is dict or type(value) is list) and 1 + _nesting(value) > MAX_HEADER_DEPTH:
        return _UNREADABLE
    return value


def decode(
    frames: Sequence,
    schema: Schema,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    vocab_size: int | None = None,
    check_content: bool = True,
) -> Message:
    """Parse and check one message in protocol order:
    malformed → version → schema → too_large → crc_mismatch → dtype → shape →
    content (misaligned, mask_invalid, out_of_vocab, invalid_value).

    A header of known keys is decoded and checked by msgspec, in C, but for
    the fields it keeps raw (maps), which are read as the checked way reads
    them; any other goes the checked Python way. Both accept and refuse the
    same headers (a property test holds them to it).
    What breaks a rule is a `RemoteProtocolError`: it came from a peer (or
    from the store)."""
    if not frames:
        raise RemoteProtocolError("malformed", "empty message: expected a header frame")
    if len(frames) >= 2 and schema.fast is not None:
        decoded = _decoded_fast(frames, schema, max_message_bytes)
        if decoded is not None:
            spec, message = decoded
            if spec.content and check_content:
                try:
                    _check_content(message.arrays, message.fields, vocab_size)
                except ProtocolError as error:
                    raise error.as_remote().with_seq(message.fields.get("seq")) from None
            return message
    buffers = [_buffer(frame) for frame in frames]
    plain = _plain_header(schema, buffers[0])
    if plain is None:
        header = decode_header(buffers[0])
        seq = header.get("seq") if type(header.get("seq")) is int else None
    else:
        spec, fields, entries, crc, packed = plain
        seq = fields.get("seq")
    spans = None  # a plain header's arrays are one frame each
    try:  # the rule checks encoding shares raise LocalProtocolError: here what arrived broke them
        if plain is None:
            spec, fields, entries, crc, packed, spans = _checked_header(header, len(buffers), schema)
        else:
            seen: set = set()
            for name, _, _ in entries:
                _check_array_name(name, seen)
            _check_arrays_and_rules(spec, fields,
                                    _frame_count_checked(seen, _array_frame_count(spec, len(buffers), entries), packed))
        return _decode_body(spec, fields, entries, crc, packed, buffers, max_message_bytes, vocab_size, check_content,
                            spans)
    except ProtocolError as error:
        raise error.as_remote().with_seq(seq) from None


def decode_trusted(frames: Sequence, schema: Schema) -> Message:
    """A message that passed `decode` when it arrived and was kept since
    under its own checksum (the broker's stored records): only parsed, its
    rules, CRC and content not checked again. Anything this parse does not
    expect (a header its fast decoder refuses, a frame of the wrong size)
    goes through `decode`, which names what is wrong."""
    buffers = [_buffer(frame) for frame in frames]
    plain = _plain_header(schema, buffers[0]) if schema.fast is not None and buffers else None
    if plain is None:
        return decode(frames, schema, check_content=False)
    spec, fields, entries, _, packed = plain
    if len(buffers) != (1 + min(1, len(entries)) if packed else 1 + len(entries)):
        return decode(frames, schema, check_content=False)
    names = frozenset(entry[0] for entry in entries)
    try:  # what later code looks arrays up by: their names, the ones a type must carry, its cross-field rules
        if len(names) != len(entries):
            raise _schema_error("an array is listed twice")
        _check_arrays_and_rules(spec, fields, names)
    except LocalProtocolError:
        return decode(frames, schema, check_content=False)
    arrays = {}
    frombuffer = np.frombuffer
    for (name, _, shape), buf in zip(entries, _packed_parts(entries, buffers[1]) if packed and entries else buffers[1:]):
        decoding = _DECODING.get(name)
        if decoding is None or len(buf) != decoding[2] * (shape[0] if len(shape) == 1 else math.prod(shape)):
            return decode(frames, schema, check_content=False)
        arr = frombuffer(buf, dtype=decoding[1])
        arrays[name] = arr if len(shape) == 1 else arr.reshape(shape)
    return Message(spec.type, fields, arrays, tuple(buffers))


def _checked_header(header: dict, frame_count: int, schema: Schema) -> tuple[MessageSpec, dict, list, int | None, bool,
                                                                            list | None]:
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise RemoteProtocolError("version", f"protocol version must be {PROTOCOL_VERSION}, got {version!r}")
    spec = _spec(schema, header.get("type"))
    packed = header.get("packed", False)
    if type(packed) is not bool:
        raise _remote_schema_error(f"packed must be a boolean, got {type(packed).__name__} {packed!r:.40}")
    entries, array_names, spans = _array_entries(header, _array_frame_count(spec, frame_count, header.get("arrays")), packed)
    fields = _check_fields(spec, header, array_names)
    crc = header.get("crc32")
    if crc is not None and not CRC32.accepts(crc):
        raise _remote_schema_error(f"crc32 must be {CRC32.describe}, got {crc!r:.40}")
    return spec, fields, entries, crc, packed, spans


def _joined_spans(frames: list, spans: list[int]) -> list:
    """One buffer per listed array: an array sent in several frames is
    joined here, at the receiver, into one read-only buffer."""
    out, start = [], 0
    for span in spans:
        out.append(frames[start] if span == 1 else b"".join(frames[start:start + span]))
        start += span
    return out


def _packed_parts(entries: list, frame) -> list:
    """A packed frame cut into one view per listed array, by the sizes their
    contract dtypes and shapes give. A wrong dtype is `RemoteProtocolError("dtype")`
    (it outranks any shape error), then a frame whose length is not the sum
    is `RemoteProtocolError("shape")`."""
    for name, dtype, _ in entries:
        wire = _DECODING[name][0]
        if dtype != wire:
            raise RemoteProtocolError("dtype", f"array {name!r} must be {wire}, got {dtype!r:.40}")
    view = frame if type(frame) is memoryview else memoryview(frame)
    parts, start = [], 0
    for name, _, shape in entries:
        end = start + _DECODING[name][2] * (shape[0] if len(shape) == 1 else math.prod(shape))
        parts.append(view[start:end])
        start = end
    if start != len(view):
        raise RemoteProtocolError("shape", f"the arrays listed need {start} bytes, the packed frame has {len(view)}")
    return parts


def _decode_body(spec, fields, entries, crc, packed, buffers, max_message_bytes, vocab_size, check_content,
                 spans=None) -> Message:
    size = sum(map(len, buffers))
    if size > max_message_bytes:
        raise RemoteProtocolError("too_large", f"message is {size} bytes, limit is max_message_bytes={max_message_bytes}")
    kept = None
    if crc is not None:
        actual, kept = _crc32_keeping_large(buffers[1:])
        if actual != crc:
            raise RemoteProtocolError("crc_mismatch", f"crc32 of array frames is {actual}, header says {crc}")

    # One pass: every dtype error outranks any shape error, so a shape error
    # is only raised once all dtypes have been seen to be right.
    arrays = {}
    shape_error = None
    frombuffer = np.frombuffer
    if packed and entries:
        array_buffers = _packed_parts(entries, buffers[1])
    else:
        array_buffers = buffers[1:] if spans is None else _joined_spans(buffers[1:], spans)
    for (name, dtype, shape), buf in zip(entries, array_buffers):
        wire, array_dtype, itemsize, contract = _DECODING[name]
        if dtype != wire:
            raise RemoteProtocolError("dtype", f"array {name!r} must be {wire}, got {dtype!r:.40}")
        if shape_error is not None:
            continue
        one_d = len(shape) == 1
        if not (one_d and contract.ndim == 1) and not contract.rank_ok(len(shape)):
            shape_error = f"array {name!r} must be {contract.rank_rule()}, got shape {shape}"
            continue
        expected_bytes = itemsize * (shape[0] if one_d else math.prod(shape))
        if len(buf) != expected_bytes:
            shape_error = f"array {name!r} of shape {shape} needs {expected_bytes} bytes, its frame has {len(buf)}"
            continue
        arr = frombuffer(buf, dtype=array_dtype)  # read-only: so is every buffer
        arrays[name] = arr if one_d else arr.reshape(shape)
    if shape_error is not None:
        raise RemoteProtocolError("shape", shape_error)

    if spec.content and check_content:
        _check_content(arrays, fields, vocab_size)
    array_crcs = None
    if kept is not None and not packed and spans is None:  # frame i + 1 is entry i's array, whole
        array_crcs = {entries[i][0]: own for i, own in kept.items()}
    return Message(spec.type, fields, arrays, tuple(buffers), crc, array_crcs)


def _check_content(arrays: Mapping[str, np.ndarray], fields: Mapping[str, Any], vocab_size: int | None) -> None:
    """The content rules of a message's arrays and its response length."""
    check_message_arrays(arrays, vocab_size=vocab_size)
    length = fields.get("response_length")
    if length is not None and length != len(arrays["tokens"]):
        raise RemoteProtocolError(
            "misaligned", f"rule '{RULE_ALIGNED}' violated: response_length is {length}, tokens has {len(arrays['tokens'])}"
        )


# An array layout `_decoded_fast` has seen, by header struct and (name, dtype) pairs: each array's numpy dtype
# and item size, with the set of names; None for a layout it leaves to the checked way (it breaks a rule there).
_ARRAY_LAYOUTS: dict[tuple, tuple[tuple, frozenset] | None] = {}
_NAME_AND_DTYPE = operator.itemgetter(0, 1)


def _array_layout(spec: MessageSpec, key: tuple) -> tuple[tuple, frozenset] | None:
    """What decoding an array layout needs, once each rule `decode` checks of
    the layout alone holds: known names listed once, the type's allowed and
    required arrays, wire dtypes, and 1-D arrays (any other rank, and any
    rule broken, is left to the checked way)."""
    names = frozenset(name for name, _ in key)
    if spec.body or len(names) != len(key) or not names <= spec.array_names or not spec.required_arrays <= names:
        return None
    decoding = []
    for name, dtype in key:
        wire, array_dtype, itemsize, contract = _DECODING[name]
        if dtype != wire or contract.ndim != 1:
            return None
        decoding.append((array_dtype, itemsize))
    return tuple(decoding), names


def _decoded_fast(frames: Sequence, schema: Schema, max_message_bytes: int) -> tuple[MessageSpec, Message] | None:
    """The common message and its spec, decoded with the fewest steps: a
    header msgspec checks (the fields it keeps raw, a delivery's metadata
    say, read as the checked way reads them), its arrays in a layout seen
    before (`_array_layout`), packed in one frame or a frame each, its
    size and CRC right. None for anything else, which `decode` then decodes
    the checked way, refusing it naming the rule: both accept the same
    messages."""
    head = frames[0]
    try:
        header = schema.fast.decode(head)  # type: ignore[union-attr]  # the caller checked it is there
    except (msgspec.MsgspecError, RecursionError):
        return None
    entries = header.arrays
    packed = header.packed
    if not entries or len(frames) != (2 if packed else 1 + len(entries)):
        return None
    header_type = type(header)
    spec, names, raw = schema.fast_specs[header_type]
    unset = msgspec.UNSET
    key = (header_type, tuple(map(_NAME_AND_DTYPE, entries)))
    try:
        layout = _ARRAY_LAYOUTS[key]
    except KeyError:
        layout = _ARRAY_LAYOUTS[key] = _array_layout(spec, key[1])
    if layout is None:
        return None
    decoding, array_names = layout
    values = msgspec.structs.astuple(header)  # v first, then the fields in `names`' order, then the arrays' envelope
    fields = {name: value for name, value in zip(names, values[1:]) if value is not unset}
    if raw and not _raw_fields_read(fields, raw):
        return None
    for rule in spec.rules:
        if rule(fields, array_names):
            return None
    if type(head) is not bytes:  # a batched message's frames are (`split_batch`)
        head = _buffer(head)
    crc, frombuffer = header.crc32, np.frombuffer
    arrays: dict[str, np.ndarray] = {}
    if packed:
        body = frames[1]
        if type(body) is not bytes:
            body = _buffer(body)
        if len(head) + len(body) > max_message_bytes or (crc is not unset and _crc32_update(body) != crc):
            return None
        start = 0
        try:
            for (name, _, (length,)), (dtype, itemsize) in zip(entries, decoding):
                arrays[name] = frombuffer(body, dtype, length, start)  # a view at `start`: no slice of the body made
                start += itemsize * length
        except (ValueError, OverflowError):  # a shape of another rank, or a frame too short for the layout
            return None
        if start != len(body):
            return None
        return spec, Message(spec.type, fields, arrays, (head, body), None if crc is unset else crc)
    buffers = [frame if type(frame) is bytes else _buffer(frame) for frame in frames[1:]]
    if len(head) + sum(map(len, buffers)) > max_message_bytes:
        return None
    kept = None
    if crc is not unset:
        actual, kept = _crc32_keeping_large(buffers)
        if actual != crc:
            return None
    try:
        for (name, _, (length,)), (dtype, itemsize), buf in zip(entries, decoding, buffers):
            if len(buf) != itemsize * length:
                return None
            arrays[name] = frombuffer(buf, dtype, length)
    except (ValueError, OverflowError):  # a shape of another rank, or an entry that lists its frames
        return None
    array_crcs = None if kept is None else {entries[i][0]: own for i, own in kept.items()}
    return spec, Message(spec.type, fields, arrays, (head, *buffers), None if crc is unset else crc, array_crcs)


def _canonical(value):
    """Maps rebuilt with sorted keys (msgpack keeps insertion order), so
    equal maps digest equally whatever their order, and stay maps."""
    if isinstance(value, dict):
        return {key: _canonical(value[key]) for key in sorted(value, key=repr)}
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    return value


def content_digest(message: Message, *, ignore: tuple[str, ...] = ("seq",)) -> bytes:
    """A digest of what a message says: known header fields except `ignore`,
    and arrays by name, dtype, shape and bytes. Equal digests mean identical
    content in the protocol's sense (resends compare equal).

    XXH3-128 over a canonical encoding of the header and then the array
    bytes: a non-cryptographic hash (nothing adversarial is at stake, a
    resend is compared with its own producer's earlier frame), fast enough
    to be negligible beside the rest of a turn's handling
    (docs/performance.md)."""
    fields = sorted(item for item in message.fields.items() if item[0] not in ignore)  # names are unique
    for _, value in fields:
        if isinstance(value, (dict, list)):
            fields = [(name, _canonical(value)) for name, value in fields]
            break
    arrays = message.arrays
    if len(message.frames) == len(arrays) + 1:  # received one frame per array, in the arrays' order: no numpy calls
        named = sorted(zip(arrays, message.frames[1:]))
    else:
        named = sorted((name, _bytes_view(arr)) for name, arr in arrays.items())
    # A decoded array has its contract dtype, so its name gives the dtype's string.
    layout = [(name, _DTYPE_STRINGS[name], arrays[name].shape) for name, _ in named]
    digest = xxhash.xxh3_128(_PACKERS.pack((message.type, fields, layout)))
    for _, data in named:
        digest.update(data)
    return digest.digest()


_DTYPE_STRINGS = {name: spec.dtype.str for name, spec in ARRAYS.items()}
# Per array name, what decoding compares and builds with (looked up once per array).
_DECODING = {name: (spec.wire_name, spec.dtype, spec.dtype.itemsize, spec) for name, spec in ARRAYS.items()}

