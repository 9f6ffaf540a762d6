"""The message catalogue of protocol version 1 (docs/protocol.md §3-§5): for
every message type on every endpoint and direction, its header fields with
their kinds, the arrays it may carry, and its cross-field rules.

The codec reads these tables to encode and to decode strictly; nothing else
declares a message's shape. From the same tables each schema also gets a
msgspec decoder for the plain case (`Schema.fast`): headers whose every key
is a field msgspec checks whole, decoded and checked in C. Anything else
goes the checked Python way, which names the rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal, Mapping, Union

import msgspec

from .contract import (
    ARRAYS,
    CONTEXT_REPLAY_ARRAYS,
    MASK_ARRAYS,
    PROTOCOL_VERSION,
    REPLAY_FIELDS,
    STATUSES,
    SUPPORT_LOG_PROB_ARRAYS,
    TOKEN_LOG_PROB_ARRAYS,
    CreditUnit,
)
from .jobs import JOB_PATTERN, SEPARATOR, is_job


@dataclass(frozen=True)
class Kind:
    """A header value's kind: a predicate plus the words for an error, and
    the same kind as a msgspec type where msgspec checks all of it (None
    where it cannot: maps, whose keys and nesting msgpack's strict decoder
    polices, and checks across a value's parts)."""

    describe: str
    accepts: Callable[[Any], bool]
    annotation: Any = None


def _is_int(value) -> bool:
    return type(value) is int


def _is_number(value) -> bool:
    return (type(value) is int) or (type(value) is float and math.isfinite(value))


def _is_str_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


TEXT = Kind("a non-empty string", lambda v: isinstance(v, str) and v != "", Annotated[str, msgspec.Meta(min_length=1)])
ANY_TEXT = Kind("a string", lambda v: isinstance(v, str), str)
INT = Kind("an integer", _is_int, int)
COUNT = Kind("a non-negative integer", lambda v: _is_int(v) and v >= 0, Annotated[int, msgspec.Meta(ge=0)])
POSITIVE = Kind("a positive integer", lambda v: _is_int(v) and v > 0, Annotated[int, msgspec.Meta(gt=0)])
BOOL = Kind("a boolean", lambda v: type(v) is bool, bool)
NUMBER = Kind("a finite number", _is_number)
SECONDS = Kind("a positive number of seconds", lambda v: _is_number(v) and v > 0)
SHARE = Kind("a number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1)
MAP = Kind("a map", lambda v: isinstance(v, dict))
LIST = Kind("a list", lambda v: isinstance(v, list))
TEXT_LIST = Kind("a list of strings", _is_str_list, list[str])


def _is_id(value) -> bool:
    return isinstance(value, str) and value != "" and SEPARATOR not in value


# A trajectory or group id: a broker keys other jobs' ids with U+001F (`rollstream.common.jobs`), so no id holds it.
_ID_TYPE = Annotated[str, msgspec.Meta(min_length=1, pattern="^[^\x1f]+$")]
ID = Kind("a non-empty string without U+001F", _is_id, _ID_TYPE)
ID_LIST = Kind("a list of non-empty strings without U+001F", lambda v: isinstance(v, list) and all(map(_is_id, v)),
               list[_ID_TYPE])
JOB = Kind(f"a job name matching {JOB_PATTERN}", is_job,
           Annotated[str, msgspec.Meta(pattern=f"^{JOB_PATTERN}$")])
REWARD = Kind("a number or a map", lambda v: _is_number(v) or isinstance(v, dict))
STATUS = Kind(f"one of {list(STATUSES)}", lambda v: v in STATUSES, Literal[STATUSES])
_UNITS = tuple(str(unit) for unit in CreditUnit)  # plain strings, as msgspec's Literal wants them
UNIT = Kind(" or ".join(map(repr, _UNITS)), lambda v: v in _UNITS, Literal[_UNITS])
# Values the broker keeps in SQLite, whose integers are signed 64-bit: a
# larger one (msgpack carries up to 2**64 - 1) is refused `schema` instead
# of failing the commit (the broker died on a turn 0 with sample_index 2**64 - 1).
INT64_MAX = 2**63 - 1
STORED_COUNT = Kind("a non-negative integer below 2**63", lambda v: _is_int(v) and 0 <= v <= INT64_MAX,
                    Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)])
STORED_POSITIVE = Kind("a positive integer below 2**63", lambda v: _is_int(v) and 0 < v <= INT64_MAX,
                       Annotated[int, msgspec.Meta(gt=0, le=INT64_MAX)])
CRC32 = Kind("an unsigned 32-bit integer", lambda v: _is_int(v) and 0 <= v < 2**32,
             Annotated[int, msgspec.Meta(ge=0, lt=2**32)])


def _is_seq_ranges(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) and r[0] <= r[1] for r in value
    )


def _is_outcome(value) -> bool:
    return (isinstance(value, dict) and _is_int(value.get("seq")) and type(value.get("applied")) is bool
            and type(value.get("duplicate", False)) is bool
            and (value.get("reason") is None or (isinstance(value["reason"], str) and value["reason"] != "")))


def _is_batched_messages(value) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(
        isinstance(m, list) and len(m) == 2 and isinstance(m[0], bytes)
        and isinstance(m[1], list) and all(_is_int(n) and n >= 0 for n in m[1]) for m in value
    )


BATCHED_MESSAGES = Kind(
    "a non-empty list of [header: bytes, frame lengths: list of non-negative integers]",
    _is_batched_messages,
    Annotated[list[tuple[bytes, list[Annotated[int, msgspec.Meta(ge=0)]]]], msgspec.Meta(min_length=1)],
)
SEQ_RANGES = Kind("a list of [first, last] integer pairs with first <= last", _is_seq_ranges)


def _is_step_pair(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(_is_int(n) and 0 <= n <= INT64_MAX for n in value)


# A trainer's ancestry: a branch, [epoch, step the epoch resumed from], per resume (`rollstream.common.versions.Ancestry`).
BRANCHES = Kind("a list of [epoch, step] pairs of non-negative integers",
                lambda v: isinstance(v, list) and all(map(_is_step_pair, v)))
BRANCH = Kind("an [epoch, step] pair of non-negative integers", _is_step_pair)


def _is_spans(value, versions_named: bool = True) -> bool:
    return isinstance(value, list) and all(
        isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and (s[0] != "" or not versions_named)
        and _is_int(s[1]) and _is_int(s[2]) and 0 <= s[1] < s[2] for s in value
    )


SPANS = Kind("a list of [version: non-empty string, start, end] with 0 <= start < end", _is_spans)
# A delivered turn's spans: its own, or its one `weight_version` (any string, as `turn` allows) over its tokens.
TURN_SPANS = Kind("a list, per versioned turn, of [version: string, start, end] with 0 <= start < end",
                  lambda v: isinstance(v, list) and all(_is_spans(spans, versions_named=False) for spans in v))
OUTCOMES = Kind(
    "a list of maps {seq: integer, applied: boolean, duplicate?: boolean, reason?: non-empty string}",
    lambda v: isinstance(v, list) and all(map(_is_outcome, v)),
)
def _is_manifest(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(e, list) and len(e) == 3 and _is_int(e[0]) and 0 <= e[0] <= INT64_MAX and _is_int(e[1])
        and e[1] >= 0 and _is_id(e[2]) for e in value
    )


MANIFEST = Kind("a list of [step: integer below 2**63, position: non-negative integer, trajectory id without U+001F] "
                "entries",
                _is_manifest)
COUNT_LIST = Kind("a list of non-negative integers", lambda v: isinstance(v, list) and all(_is_int(n) and n >= 0 for n in v),
                  list[Annotated[int, msgspec.Meta(ge=0)]])
GAP = Kind(
    f"a map {{turn: non-negative integer, field: one of {list(REPLAY_FIELDS)}}}",
    lambda v: isinstance(v, dict) and _is_int(v.get("turn")) and v["turn"] >= 0 and v.get("field") in REPLAY_FIELDS,
)

# Header keys every message may carry, handled by the codec itself.
ENVELOPE_KEYS = frozenset({"v", "type", "arrays", "crc32", "packed"})

Rule = Callable[[Mapping[str, Any], frozenset], "str | None"]


@dataclass(frozen=True)
class MessageSpec:
    type: str
    required: Mapping[str, Kind] = field(default_factory=dict)
    optional: Mapping[str, Kind] = field(default_factory=dict)
    arrays: tuple[str, ...] = ()  # required arrays
    optional_arrays: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()  # cross-field schema rules: return a problem or None
    content: bool = False  # token arrays get the content checks (docs/protocol.md §2)
    body: bool = False  # one opaque frame follows the header instead of array frames (a `batch`)
    # Derived once: the codec consults these on every message.
    kinds: Mapping[str, Kind] = field(init=False)
    array_names: frozenset = field(init=False)
    required_names: frozenset = field(init=False)
    required_arrays: frozenset = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "kinds", {**self.optional, **self.required})
        object.__setattr__(self, "array_names", frozenset(self.arrays) | frozenset(self.optional_arrays))
        object.__setattr__(self, "required_names", frozenset(self.required))
        object.__setattr__(self, "required_arrays", frozenset(self.arrays))


@dataclass(frozen=True)
class Schema:
    """The messages one side of one endpoint may receive, and the msgspec
    decoder of their headers (`header_struct`; None when no type has one)."""

    name: str
    specs: Mapping[str, MessageSpec]
    fast: msgspec.msgpack.Decoder | None = None
    # Per header struct: its spec, its fields in the struct's order (`msgspec.structs.astuple`'s, the envelope left
    # out), and the kinds of those it reads raw (`header_struct`).
    fast_specs: Mapping[type, tuple[MessageSpec, tuple[str, ...], Mapping[str, Kind]]] = field(default_factory=dict)


# The envelope as msgspec types: the version, and the arrays' [name, dtype, shape] entries.
_VERSION: object = Literal[PROTOCOL_VERSION]  # a msgspec type built at run time, not an annotation
_ENTRIES = list[tuple[str, str, list[Annotated[int, msgspec.Meta(ge=0)]]]]


def header_struct(spec: MessageSpec) -> tuple[type[msgspec.Struct], dict[str, Kind]]:
    """`spec` as a msgspec Struct tagged by `type`: the envelope and every
    field, and the fields read as `msgspec.Raw` by their kind. A kind with
    an annotation is checked whole by msgspec; one without (maps, whose keys
    and nesting msgpack's strict decoder polices, and values checked across
    their parts) is kept as its raw bytes, which the decoder reads as the
    checked way does and gives to the kind's predicate. Unknown keys are
    refused, so a header with a key from a newer peer is left to the
    checked way."""
    raw: dict[str, Kind] = {}

    def typed(name: str, kind: Kind) -> Any:
        if kind.annotation is None:
            raw[name] = kind
            return msgspec.Raw
        return kind.annotation

    fields: list[tuple] = [("v", _VERSION)]
    fields += [(name, typed(name, kind)) for name, kind in spec.required.items()]
    fields += [(name, Union[typed(name, kind), msgspec.UnsetType], msgspec.UNSET) for name, kind in spec.optional.items()]
    fields += [("arrays", _ENTRIES, []), ("crc32", Union[CRC32.annotation, msgspec.UnsetType], msgspec.UNSET),
               ("packed", bool, False)]
    struct = msgspec.defstruct(f"{spec.type.capitalize()}Header", fields, tag_field="type", tag=spec.type,
                               forbid_unknown_fields=True)
    return struct, raw


def _schema(name: str, *specs: MessageSpec) -> Schema:
    structs = {}
    for spec in specs:
        unknown = spec.array_names - set(ARRAYS)
        assert not unknown, f"{spec.type}: arrays {unknown} are not in the contract table"
        assert not set(spec.kinds) & ENVELOPE_KEYS, f"{spec.type}: a field is named like an envelope key"
        struct, raw = header_struct(spec)
        structs[struct] = (spec, tuple(name for name in struct.__struct_fields__ if name in spec.kinds), raw)
    fast = msgspec.msgpack.Decoder(Union[tuple(structs)]) if structs else None
    return Schema(name, {spec.type: spec for spec in specs}, fast, structs)


# Where an open trajectory stands, as the broker hands it back to its producer (docs/protocol.md §3): turns may
# follow (`open`), none may but the end may (`terminal`: a truncated or aborted turn, or a replay gap, cut it), or it
# ended and waits for its reward (`scoring`).
OPEN_STATES = ("open", "terminal", "scoring")
OPEN_STATE = Kind(f"one of {list(OPEN_STATES)}", lambda v: v in OPEN_STATES, Literal[OPEN_STATES])


def _is_open_entry(value) -> bool:
    return (isinstance(value, dict) and {"trajectory_id", "next_turn", "state"} <= set(value)
            <= {"trajectory_id", "next_turn", "state", "group_id", "group_size", "sample_index"}
            and _is_id(value["trajectory_id"]) and _is_int(value["next_turn"]) and value["next_turn"] >= 0
            and value["state"] in OPEN_STATES and _is_id(value.get("group_id", "g"))
            and _is_int(value.get("group_size", 1)) and value.get("group_size", 1) > 0
            and _is_int(value.get("sample_index", 0)) and value.get("sample_index", 0) >= 0)


OPEN_ENTRIES = Kind("a list of maps {trajectory_id, next_turn: non-negative integer, state: one of "
                    f"{list(OPEN_STATES)}, group_id?, group_size?: positive integer, sample_index?: non-negative integer}}",
                    lambda v: isinstance(v, list) and all(map(_is_open_entry, v)))
TOKEN_RANGES = Kind("a list of [start, end] pairs with 0 <= start <= end",
                    lambda v: isinstance(v, list) and all(isinstance(r, list) and len(r) == 2 and _is_int(r[0])
                                                          and _is_int(r[1]) and 0 <= r[0] <= r[1] for r in v))


# -- cross-field rules --------------------------------------------------------
def mask_pair(header, arrays) -> str | None:
    ids, offsets = MASK_ARRAYS
    if (ids in arrays) != (offsets in arrays):
        return f"mask_ids and mask_offsets travel together; only {ids if ids in arrays else offsets} is present"
    if ids not in arrays:
        beside = [name for name in SUPPORT_LOG_PROB_ARRAYS if name in arrays]
        if beside:
            return f"{beside[0]} travels with mask_ids and mask_offsets, which are absent"
    return None


_TURN0_ONLY = ("group_id", "group_size", "sample_index")


def group_pair(header, arrays) -> str | None:
    if ("group_id" in header) != ("group_size" in header):
        return "group_id and group_size travel together"
    return None


def turn_zero_fields(header, arrays) -> str | None:
    if header["turn"] == 0:
        return None if "prompt_tokens" in arrays else "turn 0 must carry prompt_tokens"
    if "prompt_tokens" not in arrays and header.keys().isdisjoint(_TURN0_ONLY):
        return None
    late = [name for name in _TURN0_ONLY if name in header] + (["prompt_tokens"] if "prompt_tokens" in arrays else [])
    return f"{', '.join(late)} may travel on turn 0 only, got turn {header['turn']}"


def one_id_per_lease(header, arrays) -> str | None:
    for name in ("trajectory_ids", "positions"):
        values = header.get(name)
        if values is not None and len(values) != len(header["leases"]):
            return f"{name} has one entry per lease: expected {len(header['leases'])}, got {len(values)}"
    return None


def trained_at_step(header, arrays) -> str | None:
    named = [name for name in ("step", "positions") if name in header]
    if named and (len(named) < 2 or "trajectory_ids" not in header):
        return f"step, positions and trajectory_ids travel together; got only {', '.join(named)}"
    return None


def spans_within_turn(header, arrays) -> str | None:
    spans = header.get("weight_version_spans")
    if spans is None:
        return None
    if not spans:
        return "weight_version_spans, when sent, holds at least one span"
    if header.get("weight_version") != spans[0][0]:
        return (f"a turn's weight_version is its first span's: expected {spans[0][0]!r}, "
                f"got {header.get('weight_version')!r}")
    if any(a[2] > b[1] for a, b in zip(spans, spans[1:])):
        return f"weight_version_spans are in token order and do not overlap, got {spans}"
    return None  # (that they lie within the sampled tokens, `Trajectory.append_turn` checks)


def spans_per_version(header, arrays) -> str | None:
    spans = header.get("weight_version_spans")
    if spans is not None and len(spans) != len(header["weight_versions"]):
        return (f"weight_version_spans has one entry per weight version: expected {len(header['weight_versions'])}, "
                f"got {len(spans)}")
    return None


def run_pair(header, arrays) -> str | None:
    if ("run" in header) != ("lineage" in header):
        return "run and lineage travel together"
    return None


def one_question(header, arrays) -> str | None:
    asked = [name for name in ("step", "trajectory_id") if name in header]
    if len(asked) != 1:
        return f"a history request asks one question: expected exactly one of step and trajectory_id, got {asked or 'neither'}"
    if "run" in header and "step" not in header:
        return "run names the run that trained a step: expected it with step, got it with trajectory_id"
    return None


def _is_maps(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) and all(isinstance(k, str) for k in item) for item in value)


def _is_step_range(value) -> bool:
    return _is_step_pair(value) and value[0] <= value[1]


# -- the catalogue ------------------------------------------------------------
_SEQ = {"seq": INT}
_TURN_ARRAYS = ("prompt_tokens", "loss_mask", *MASK_ARRAYS, "forced_tokens", *CONTEXT_REPLAY_ARRAYS,
                *TOKEN_LOG_PROB_ARRAYS, *SUPPORT_LOG_PROB_ARRAYS)
_DELIVER_ARRAYS = (*MASK_ARRAYS, *CONTEXT_REPLAY_ARRAYS, *TOKEN_LOG_PROB_ARRAYS, *SUPPORT_LOG_PROB_ARRAYS)
_NACK = MessageSpec("nack", {"code": TEXT, "message": ANY_TEXT}, {"seq": INT, "expected": COUNT, "leases": TEXT_LIST})

PRODUCER_TO_BROKER = _schema(
    "producer->broker",
    MessageSpec("hello", {"producer_id": TEXT},
                {"seq": INT, "batch_acks": BOOL, "batch_frames": BOOL, "job": JOB, "reads_branch": BOOL,
                 "lists_open": BOOL}),
    MessageSpec(
        "turn",
        {"seq": INT, "trajectory_id": ID, "turn": COUNT, "status": STATUS},
        {
            "group_id": ID,
            "group_size": STORED_POSITIVE,
            "sample_index": STORED_COUNT,
            "weight_version": ANY_TEXT,
            "weight_version_spans": SPANS,
            "mask_log_probs_normalized": BOOL,
            "metadata": MAP,
            "job": JOB,
        },
        arrays=("tokens", "log_probs"),
        optional_arrays=_TURN_ARRAYS,
        rules=(mask_pair, turn_zero_fields, group_pair, spans_within_turn),
        content=True,
    ),
    MessageSpec("end", {"seq": INT, "trajectory_id": ID}, {"reward": REWARD, "metadata": MAP, "turns": COUNT, "job": JOB}),
    MessageSpec("reward", {"seq": INT, "trajectory_id": ID, "reward": REWARD}, {"job": JOB}),
    MessageSpec("abort", {"seq": INT, "trajectory_id": ID, "reason": ANY_TEXT}, {"job": JOB, "again": BOOL}),
    MessageSpec("ping", {"seq": INT}),
    MessageSpec("batch", {"messages": BATCHED_MESSAGES}, body=True),
    MessageSpec("list_open", {"seq": INT}),
    MessageSpec("read_open", {"seq": INT, "trajectory_id": ID}),
)
# What a `batch` may carry: the frames a producer keeps until settled.
BATCHABLE_TYPES = ("turn", "end", "abort", "reward")

# A job's branch goes to a producer as `branch` when its hello said `reads_branch`, else under its older name `lineage`.
BROKER_TO_PRODUCER = _schema(
    "broker->producer",
    MessageSpec("welcome", {"broker_id": TEXT, "max_message_bytes": POSITIVE, "window": POSITIVE},
                {"seq": INT, "batch_acks": BOOL, "batch_frames": BOOL, "job": JOB, "admit": COUNT,
                 "reads_branch": BOOL, "branch": BRANCH, "lineage": BRANCH, "lists_open": BOOL}),
    MessageSpec(
        "ack",
        {"seq": INT, "trajectory_id": TEXT, "applied": BOOL},
        {"turn": COUNT, "duplicate": BOOL, "reason": TEXT},
    ),
    MessageSpec("acks", {"ranges": SEQ_RANGES},
                {"outcomes": OUTCOMES, "window": POSITIVE, "admit": COUNT, "branch": BRANCH, "lineage": BRANCH}),
    _NACK,
    MessageSpec("pong", {"seq": INT}, {"window": POSITIVE, "admit": COUNT, "branch": BRANCH, "lineage": BRANCH}),
    MessageSpec("open_list", {"seq": INT, "trajectories": OPEN_ENTRIES}),
    MessageSpec("open_trajectory", {"seq": INT, "trajectory_id": TEXT, "next_turn": COUNT, "state": OPEN_STATE},
                {"status": STATUS, "forced_spans": TOKEN_RANGES, "weight_version_spans": SPANS},
                arrays=("prompt_tokens", "tokens", "log_probs", "loss_mask"),
                optional_arrays=(*MASK_ARRAYS, *TOKEN_LOG_PROB_ARRAYS, *SUPPORT_LOG_PROB_ARRAYS), rules=(mask_pair,)),
)

CONSUMER_TO_BROKER = _schema(
    "consumer->broker",
    MessageSpec("hello", {"consumer_id": TEXT},
                {"seq": INT, "packed_arrays": BOOL, "split_arrays": BOOL, "queued_counts": BOOL, "run": TEXT,
                 "lineage": TEXT, "job": JOB},
                rules=(run_pair,)),
    MessageSpec("heartbeat", {}, _SEQ),
    MessageSpec("credit", {"n": COUNT, "unit": UNIT}, _SEQ),
    MessageSpec("revoke", {}, _SEQ),
    MessageSpec("ack", {"leases": TEXT_LIST},
                {**_SEQ, "trajectory_ids": ID_LIST, "step": STORED_COUNT, "positions": COUNT_LIST},
                rules=(one_id_per_lease, trained_at_step)),
    MessageSpec("nack", {"leases": TEXT_LIST, "reason": ANY_TEXT, "requeue": BOOL}, _SEQ),
    MessageSpec("seal", {"step": STORED_COUNT, "keep": POSITIVE}, _SEQ),
    MessageSpec("policy", {"version": STORED_COUNT},
                {"seq": INT, "max_staleness": STORED_COUNT, "per_step": STORED_POSITIVE, "share": SHARE,
                 "branches": BRANCHES}),
    MessageSpec("resume", {"step": STORED_COUNT, "keep": POSITIVE, "trained": MANIFEST}, _SEQ),
)

BROKER_TO_CONSUMER = _schema(
    "broker->consumer",
    MessageSpec("welcome", {"broker_id": TEXT, "lease_timeout": SECONDS, "heartbeat_interval": SECONDS},
                {"seq": INT, "packed_arrays": BOOL, "split_arrays": BOOL, "queued_counts": BOOL, "queued": COUNT,
                 "max_unsealed_bytes": POSITIVE, "job": JOB}),
    MessageSpec(
        "deliver",
        {
            "lease": TEXT,
            "trajectory_id": TEXT,
            "status": STATUS,
            "reward": REWARD,
            "response_length": COUNT,
            "weight_versions": TEXT_LIST,
            "metadata": MAP,
        },
        {
            "sample_index": COUNT,
            "group_id": TEXT,
            "group_size": POSITIVE,
            "group_left": COUNT,
            "gap": GAP,
            "turns": COUNT,
            "delivery_count": POSITIVE,
            "replay": BOOL,
            "weight_version_spans": TURN_SPANS,
            "queued": COUNT,
        },
        arrays=("prompt_tokens", "tokens", "loss_mask", "log_probs"),
        optional_arrays=_DELIVER_ARRAYS,
        rules=(mask_pair, spans_per_version),
        content=True,
    ),
    MessageSpec("acked", {"leases": TEXT_LIST}, _SEQ),
    MessageSpec("nacked", {"leases": TEXT_LIST}, _SEQ),
    MessageSpec("queued", {"n": COUNT}, _SEQ),
    MessageSpec("revoked", {"queued": COUNT}, _SEQ),
    MessageSpec("sealed", {"step": STORED_COUNT, "reclaimed": COUNT}, _SEQ),
    MessageSpec("resumed", {"step": STORED_COUNT, "replay": MANIFEST}, {**_SEQ, "epoch": COUNT}),
    MessageSpec("policy", {"version": STORED_COUNT},
                {"seq": INT, "max_staleness": STORED_COUNT, "held": COUNT, "waiting": COUNT}),
    _NACK,
)

ADMIN_REQUESTS = _schema(
    "admin request",
    MessageSpec("status", {}, _SEQ),
    MessageSpec("dead_letters", {}, {"seq": INT, "limit": POSITIVE, "pruned": BOOL}),
    MessageSpec("requeue", {"trajectory_ids": ID_LIST}, {**_SEQ, "job": JOB}),
    MessageSpec("end_run", {"run": TEXT}, {**_SEQ, "job": JOB}),
    MessageSpec("history", {}, {"seq": INT, "step": STORED_COUNT, "trajectory_id": ID, "job": JOB, "run": TEXT},
                rules=(one_question,)),
)
# A history reply's rows: maps with the archive's column names (docs/archive.md), times as Unix seconds.
ROWS = Kind("a list of maps with string keys", _is_maps)
STEP_RANGE = Kind("a [first, last] pair of steps with first <= last", _is_step_range)


def _is_reclaimed(value) -> bool:
    return _is_maps(value) and all(set(item) == {"job", "run", "through"} and isinstance(item["job"], str)
                                   and isinstance(item["run"], str) and _is_int(item["through"]) for item in value)


def _is_let_go(value) -> bool:
    return _is_maps(value) and all(
        {"job", "trajectory_id"} <= set(item) <= {"job", "trajectory_id", "reason", "at"}
        and isinstance(item["job"], str) and isinstance(item["trajectory_id"], str)
        and isinstance(item.get("reason", ""), str) and _is_number(item.get("at", 0)) for item in value)


RECLAIMED = Kind("a list of maps {job: string, run: string, through: integer}", _is_reclaimed)
LET_GO = Kind("a list of maps {job: string, trajectory_id: string, reason?: string, at?: number}", _is_let_go)

# The status reply's `ready` and `ready_by_job` are the older names of `queued` and `queued_by_job`, sent beside
# them for one version so that an older `rollstream status` or `top` still reads the reply.
ADMIN_REPLIES = _schema(
    "admin reply",
    MessageSpec(
        "status",
        {
            "open": COUNT,
            "ready": COUNT,
            "leased": COUNT,
            "dead": COUNT,
            "producers": COUNT,
            "consumers": COUNT,
            "bytes_in_memory": COUNT,
            "bytes_on_disk": COUNT,
            "counters": MAP,
        },
        {"seq": INT, "endpoints": MAP, "unsealed": COUNT, "unsealed_bytes": COUNT, "oldest_unsealed_step": COUNT,
         "policies": MAP, "starving": MAP, "scoring": COUNT, "awaiting_group": COUNT, "max_memory_bytes": COUNT,
         "max_disk_bytes": COUNT, "ack_seconds": MAP, "queued": COUNT, "queued_by_job": MAP, "ready_by_job": MAP,
         "archive": MAP, "resumed": MAP},
    ),
    MessageSpec("dead_letters", {"items": LIST}, _SEQ),
    MessageSpec("requeued", {"trajectory_ids": TEXT_LIST}, _SEQ),
    MessageSpec("run_ended", {"run": TEXT, "reclaimed": COUNT}, _SEQ),
    MessageSpec("history", {"rows": ROWS, "held": COUNT},
                {"seq": INT, "steps": STEP_RANGE, "reclaimed": RECLAIMED, "let_go": LET_GO}),
    _NACK,
)


def status_count(status: Mapping[str, Any], name: str) -> int:
    """`name`'s count in a status reply, read under its older name (`ready`
    for `queued`) from a broker that predates the new one, so that a newer
    `top` or checker does not read an older broker's queue as empty."""
    older = {"queued": "ready"}.get(name, name)
    return int(status.get(name, status.get(older, 0)))
