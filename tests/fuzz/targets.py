"""Fuzz targets: every decoder of input rollstream does not control, each
held to its contract. Any input either decodes or raises only the error
family its decoder documents (`Target.allowed`); anything else escaping a
target is a finding, and so is a broken property a target asserts (an
`AssertionError`, naming it).

A target takes the fuzzer's bytes. The codec targets read them as ZeroMQ
frames (`split_frames`). The file targets read a first byte of options
(`FileInput`) and write the rest as a segment file, as it is (`raw`) or as
records whose headers and CRCs are right (`framed`: each frame a record's
payload), so the fuzzer reaches the payload parsers behind the CRC. The
miles target reads the bytes as one session payload, the settings target as
one TOML file, the engine-reply target a first byte picking the decoder
and the reply's JSON (`engine_replies`).

Each target runs here without atheris too: tests/fuzz/test_fuzz_targets.py
replays the corpus and the regression inputs through `run_target`, and
tests/fuzz/run.py hands the same functions to libFuzzer.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from rollstream.broker import core as broker_core
from rollstream.broker.cli import broker as broker_command
from rollstream.broker.core import (
    BrokerCore,
    Checkpoint,
    Commit,
    MeasureDisk,
    Probe,
    PruneDedup,
    ReadHistory,
    Send,
    Sent,
)
from rollstream.broker.engine import OPEN, EngineSettings, MergeEngine, State
from rollstream.broker.facts import history_row
from rollstream.broker.metrics import BrokerMetrics
from rollstream.broker.recovery import Rebuilt, load_trajectory, rebuild
from rollstream.broker.settings import BrokerSettings
from rollstream.broker.store import Store, StoredTrajectory, StoreError
from rollstream.common.admin import AdminError, read_endpoints_file
from rollstream.common.clock import Clock
from rollstream.common.codec import crc32_of, decode, decode_header, encode, encode_batch, split_batch
from rollstream.common.config import ConfigError, load_toml
from rollstream.common.errors import InvalidInput, ProtocolError, RemoteProtocolError, SupportOverflow
from rollstream.common.ingest import (
    engine_spans,
    overflow_from_error,
    sampled_ids,
    turn_from_sglang,
    turn_from_sglang_chat,
    turn_from_vllm,
)
from rollstream.common.mask import SamplingMask
from rollstream.common.messages import (
    ADMIN_REPLIES,
    ADMIN_REQUESTS,
    BATCHABLE_TYPES,
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    CONSUMER_TO_BROKER,
    PRODUCER_TO_BROKER,
)
from rollstream.common.miles import decode_session_samples
from rollstream.common.segments import HEADER, MAGIC, SegmentDamaged, SegmentLog
from rollstream.common.trajectory import Turn
from rollstream.common.validation import check_message_arrays, messages_content_valid
from rollstream.common.wire import encode_turn, trajectory_from_deliver, turn_from_message
from rollstream.consumer.assembly import Delivery
from rollstream.consumer.batch import Batch
from rollstream.consumer.validate import batch_violations, sample_violations
from rollstream.producer.cli import producer as producer_command
from rollstream.producer.cursor import FILE as CURSOR_FILE
from rollstream.producer.cursor import CursorError, PromptCursor
from rollstream.producer.miles_samples import turns_from_miles_samples
from rollstream.producer.settings import ProducerSettings
from rollstream.producer.spool import Spool, SpoolError

# The vocabulary the codec targets decode with, beside none (a broker started with --vocab-size 1000).
VOCAB = 1000

# -- inputs as frames -----------------------------------------------------------------
MAX_FRAMES = 16
_LENGTH = struct.Struct("<I")


def split_frames(data: bytes) -> list[bytes]:
    """The frames an input stands for: its first byte b gives their count,
    n = b % 16 + 1; then come n - 1 little-endian u32 lengths (bytes past
    the input's end read as zeros), each taken modulo what is left of the
    body plus one; the rest of the body is the last frame. Every input is
    some frames, and `join_frames` writes any frames as an input."""
    if not data:
        return [b""]
    n = data[0] % MAX_FRAMES + 1
    head = data[1 : 1 + _LENGTH.size * (n - 1)].ljust(_LENGTH.size * (n - 1), b"\0")
    body = data[1 + _LENGTH.size * (n - 1) :]
    frames, start = [], 0
    for (length,) in _LENGTH.iter_unpack(head):
        length %= len(body) - start + 1
        frames.append(body[start : start + length])
        start += length
    frames.append(body[start:])
    return frames


def join_frames(frames: list) -> bytes:
    """The input `split_frames` reads as `frames` (1 to `MAX_FRAMES` of them)."""
    if not 1 <= len(frames) <= MAX_FRAMES:
        raise ValueError(f"an input holds 1 to {MAX_FRAMES} frames, got {len(frames)}")
    parts = [bytes(memoryview(frame).cast("B")) for frame in frames]
    return bytes([len(parts) - 1]) + b"".join(_LENGTH.pack(len(p)) for p in parts[:-1]) + b"".join(parts)


# -- inputs as segment files -------------------------------------------------------------
@dataclass(frozen=True)
class FileInput:
    """A file target's input: a first byte of options, then the content.
    Bit 0: framed (the content's frames are record payloads, written with
    right headers) or raw (the content is the file). Bit 1: the file's last
    record is cut short by `1 + (options >> 4)` bytes (a torn write; framed
    only); for the store, salvage first. Bit 2: the records go into two
    segment files, half and half (framed only)."""

    options: int
    content: bytes

    @classmethod
    def read(cls, data: bytes) -> "FileInput":
        return cls(data[0] if data else 0, data[1:])

    @property
    def framed(self) -> bool:
        return bool(self.options & 1)

    @property
    def torn(self) -> bool:
        return bool(self.options & 2)

    @property
    def two_segments(self) -> bool:
        return bool(self.options & 4)

    def segment_files(self) -> list[bytes]:
        """The segment files this input stands for, first one first."""
        if not self.framed:
            return [self.content]
        records = [record(payload) for payload in split_frames(self.content)]
        files = [records[: len(records) // 2], records[len(records) // 2 :]] if self.two_segments else [records]
        contents = [b"".join(part) for part in files]
        if self.torn:
            contents[-1] = contents[-1][: max(0, len(contents[-1]) - 1 - (self.options >> 4))]
        return contents


def record(payload: bytes) -> bytes:
    """One segment record (common/segments.py): magic, length, CRC-32, payload."""
    return HEADER.pack(MAGIC, len(payload), crc32_of([payload])) + payload


def raw_input(content: bytes) -> bytes:
    """A file target's input holding one segment file as it is."""
    return bytes([0]) + content


def framed_input(payloads: list[bytes], options: int = 1) -> bytes:
    """A file target's input whose records carry `payloads` (`options`: `FileInput`'s bits, bit 0 set)."""
    return bytes([options | 1]) + join_frames(payloads)


_SCRATCH: list[Path] = []


def memory_directory() -> str | None:
    """Where scratch files cost no disk I/O: /dev/shm where there is one
    (the file targets write and delete a directory per input)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def scratch(name: str) -> Path:
    """An empty directory `name` for one run of a target: under
    $ROLLSTREAM_FUZZ_SCRATCH (which tests/fuzz/run.py makes and removes),
    else under a temporary directory made once per process (removed at its exit)."""
    if not _SCRATCH:
        root = os.environ.get("ROLLSTREAM_FUZZ_SCRATCH")
        if root is None:
            root = tempfile.mkdtemp(prefix="rollstream-fuzz-", dir=memory_directory())
            atexit.register(shutil.rmtree, root, True)
        _SCRATCH.append(Path(root))
    path = _SCRATCH[0] / name
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _open_fds(unless: Callable[[str], bool] | None = None) -> int | None:
    """The process's open descriptors, but those whose target `unless` names."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: not counted
        return None
    if unless is None:
        return len(names)
    count = 0
    for name in names:
        with contextlib.suppress(OSError):  # closed meanwhile
            count += not unless(os.readlink(f"/proc/self/fd/{name}"))
    return count


@contextlib.contextmanager
def leaves_nothing_open(what: str, unless: Callable[[str], bool] | None = None) -> Iterator[None]:
    """Asserts that the block, however it ends, closes every file it opened
    (a refused file or record must not leak its descriptor: an owner retries),
    but those whose path `unless` names."""
    before = _open_fds(unless)
    try:
        yield
    finally:
        after = _open_fds(unless)
        if before is not None and after is not None and after > before:
            raise AssertionError(f"{what} left {after - before} file descriptor(s) open")


# -- the wire ------------------------------------------------------------------------
def _content_refusal(arrays, vocab_size: int | None) -> ProtocolError | None:
    try:
        check_message_arrays(arrays, vocab_size=vocab_size)
    except ProtocolError as error:
        return error
    return None


def _broker_checks_content(turns: list) -> None:
    """The broker's content check of a batch of turns (broker/service.py):
    one packed pass over all, which must refuse exactly when some turn
    alone breaks a rule."""
    for vocab in (None, VOCAB):
        packed = messages_content_valid([message.arrays for message in turns], vocab)
        refused = [error for message in turns if (error := _content_refusal(message.arrays, vocab)) is not None]
        if packed != (not refused):
            raise AssertionError(f"the packed content check says {'valid' if packed else 'invalid'} with "
                                 f"vocab_size={vocab}, the per-turn check refuses {len(refused)} of {len(turns)} turn(s): "
                                 f"{[str(error) for error in refused]}")


def _broker_reads(frames: list) -> None:
    """What the broker's producer socket does with frames: decode without
    the content rules, split a `batch` and decode its messages one by one
    (only batchable types count), then check the turns' content as a batch."""
    with contextlib.suppress(ProtocolError):
        message = decode(frames, PRODUCER_TO_BROKER, check_content=False)
        elements = [message]
        if message.type == "batch":
            elements = []
            for element in split_batch(message):
                with contextlib.suppress(ProtocolError):
                    decoded = decode(element, PRODUCER_TO_BROKER, check_content=False)
                    if decoded.type in BATCHABLE_TYPES:
                        elements.append(decoded)
        turns = [element for element in elements if element.type == "turn"]
        if turns:
            _broker_checks_content(turns)


def producer_to_broker(data: bytes) -> None:
    """A producer's message at the broker: decoded with the content rules
    (without and with a vocabulary), its turn read as the merge reads it,
    and the broker's own way (`_broker_reads`)."""
    frames = split_frames(data)
    for vocab in (None, VOCAB):
        with contextlib.suppress(ProtocolError):
            message = decode(frames, PRODUCER_TO_BROKER, vocab_size=vocab)
            if message.type == "turn":
                turn_from_message(message)
    _broker_reads(frames)


def split_batch_target(data: bytes) -> None:
    """A `batch` at the broker: split and each message decoded
    (`_broker_reads`); and splitting what `encode_batch` makes of a split
    gives the same messages back."""
    frames = split_frames(data)
    _broker_reads(frames)
    with contextlib.suppress(ProtocolError):
        message = decode(frames, PRODUCER_TO_BROKER, check_content=False)
        if message.type != "batch":
            return
        messages = split_batch(message)
        again = split_batch(decode(encode_batch(messages), PRODUCER_TO_BROKER, check_content=False))
        if [list(map(bytes, m)) for m in again] != [list(map(bytes, m)) for m in messages]:
            raise AssertionError("encode_batch then split_batch does not give back the messages split_batch gave")


def _decoded(schema, data: bytes) -> None:
    """A message of `schema` decoded without and with a vocabulary."""
    frames = split_frames(data)
    for vocab in (None, VOCAB):
        with contextlib.suppress(ProtocolError):
            decode(frames, schema, vocab_size=vocab)


def consumer_to_broker(data: bytes) -> None:
    """A consumer's message at the broker."""
    _decoded(CONSUMER_TO_BROKER, data)


def broker_to_producer(data: bytes) -> None:
    """A broker's reply at the producer."""
    _decoded(BROKER_TO_PRODUCER, data)


def broker_to_consumer(data: bytes) -> None:
    """A broker's message at the consumer: decoded with the content rules
    (a delivery rebuilt into its trajectory), and the consumer's own way
    (consumer/client.py): without them, or the header of what did not decode."""
    frames = split_frames(data)
    for vocab in (None, VOCAB):
        with contextlib.suppress(ProtocolError):
            message = decode(frames, BROKER_TO_CONSUMER, vocab_size=vocab)
            if message.type == "deliver":
                trajectory_from_deliver(message)
    try:
        message = decode(frames, BROKER_TO_CONSUMER, check_content=False)
    except RemoteProtocolError:
        with contextlib.suppress(RemoteProtocolError):
            decode_header(frames[0])
    else:
        if message.type == "deliver":
            _consumer_checks(message)


def _consumer_checks(message) -> None:
    """A delivery through the consumer's batch checks (consumer/validate.py):
    the per-sample structure, then packing, which checks each sample as it
    copies it where it can; what it saw valid the packed batch's check must
    find valid too. (Its reward is set to a number: a map would need the
    trainer's `reward_key`, which is not what is checked here.)"""
    delivery = Delivery(message["trajectory_id"], {**message.fields, "reward": 0.0}, message.arrays, 0)
    if sample_violations([delivery]):
        return
    batch, seen_valid = Batch.checked_from_deliveries([delivery], vocab_size=VOCAB)
    found = batch_violations(batch, vocab_size=VOCAB)
    assert not (seen_valid and found), f"packing saw a delivery keep every rule the packed check finds broken: {found}"


# -- admin ---------------------------------------------------------------------------
def at(t: float) -> Clock:
    return Clock(t, 1000.0 + t)


# What a healthy store answers the core's requests; it never reads (no performer).
def _read_history(request: ReadHistory) -> list[dict]:
    """A row per trajectory asked for, as a store's would read (an ended one with a reward, no records)."""
    return [history_row(StoredTrajectory(tid, State.ENDED, None, None, None, 0.0, b"", {"acc": 1.0}, None, 0, None,
                                         None, None, producer="p"), None) for tid in request.trajectory_ids]


_HEALTHY_STORE: dict[type, Callable] = {Commit: lambda request: None, Probe: lambda request: True,
                                        PruneDedup: lambda request: None, Checkpoint: lambda request: None,
                                        MeasureDisk: lambda request: (0, 1 << 40), ReadHistory: _read_history}


def drive(steps) -> list[Send]:
    """Run one input of the broker's core to its end (`broker_core.drive`),
    answering its requests as a healthy store and sockets would; what it
    sent, in order."""
    sent: list[Send] = []

    def send(request: Send) -> Sent:
        sent.append(request)
        return Sent.TAKEN

    broker_core.drive(steps, {**_HEALTHY_STORE, Send: send})
    return sent


def turn_frames(tid: str, index: int, seq: int, *, tokens=(10, 11), supports=((10, 3), (11,)), forced=None,
                 prompt=(1, 2, 3), **fields) -> list:
    turn = Turn.build(list(tokens), [-0.5] * len(tokens), supports=[list(s) for s in supports] if supports else None,
                      forced_tokens=forced)
    extra = {"prompt_tokens": np.array(prompt, np.int32)} if index == 0 else {}
    return encode_turn(tid, index, turn, seq=seq, **extra, **fields)


def admin_core() -> BrokerCore:
    """A broker core holding one queued trajectory and one dead letter
    (delivered, then refused by its consumer without requeue)."""
    core = BrokerCore(BrokerSettings(), "fuzz", BrokerMetrics(), disk_reserve=0)
    core.restore(Rebuilt([], (), {}, {}, {}), 0, 1 << 40)
    produced = [turn_frames("dead", 0, 1), encode(PRODUCER_TO_BROKER, "end", {"seq": 2, "trajectory_id": "dead", "reward": 0.5}),
                turn_frames("ready", 0, 3), encode(PRODUCER_TO_BROKER, "end", {"seq": 4, "trajectory_id": "ready", "reward": 1})]
    messages = [BrokerCore.keyed(decode(frames, PRODUCER_TO_BROKER)) for frames in produced]
    for _ in messages:
        core.frame_arrived(b"producer", 100, 0.0)
    drive(core.producer_read([(b"producer", message, None) for message in messages], at(0.0)))

    def consume(mtype: str, fields: dict, t: float) -> list:
        received = [(b"consumer", decode(encode(CONSUMER_TO_BROKER, mtype, fields), CONSUMER_TO_BROKER), None)]
        sent = drive(core.consumer_read(received, at(t))) + drive(core.deliver(at(t)))
        return [decode(r.frames, BROKER_TO_CONSUMER) for r in sent]

    consume("hello", {"consumer_id": "c"}, 1.0)
    deliveries = consume("credit", {"n": 1, "unit": "trajectory"}, 1.0)
    lease = next(m["lease"] for m in deliveries if m.type == "deliver")
    consume("nack", {"leases": [lease], "reason": "unusable", "requeue": False}, 1.5)
    return core


_ADMIN_CORE: list[BrokerCore] = []


def admin(data: bytes) -> None:
    """An admin request at the broker: decoded, answered by the broker's
    core, and the answer decoded as the admin client decodes it (which must
    succeed); the same frames as a reply at the admin client; the same bytes
    as an endpoints file (common/admin.py)."""
    frames = split_frames(data)
    try:
        message, error = decode(frames, ADMIN_REQUESTS), None
    except ProtocolError as refusal:
        message, error = None, refusal.as_remote()
    if not _ADMIN_CORE or (message is not None and message.type in ("requeue", "end_run")):  # they change the core
        _ADMIN_CORE[:] = [admin_core()]
    for reply in drive(_ADMIN_CORE[0].admin_request(b"admin", [], message, error, at(2.0))):
        try:
            decode(reply.frames, ADMIN_REPLIES)
        except ProtocolError as refusal:
            raise AssertionError(f"the broker's answer to an admin request does not decode as an admin reply: {refusal}")
    with contextlib.suppress(ProtocolError):
        decode(frames, ADMIN_REPLIES)
    path = scratch("admin") / "endpoints.json"
    path.write_bytes(data)
    with contextlib.suppress(AdminError):
        read_endpoints_file(str(path))


# -- miles ---------------------------------------------------------------------------
def miles_session(data: bytes) -> None:
    """A miles session payload, as the producer's replay source reads one
    (producer/replay.py): decoded, then its samples made turns."""
    session = decode_session_samples(data)
    if session.samples:
        for vocab in (None, VOCAB):
            with contextlib.suppress(InvalidInput, ProtocolError):
                turns_from_miles_samples(session.samples, vocab_size=vocab)


# -- engine replies ------------------------------------------------------------------
def _aligned(turn: Turn) -> None:
    """What every turn an engine's reply decodes to must hold: one log-prob
    (and support, and full log-prob, where it has them) per sampled token."""
    n = len(turn.tokens)
    lengths = {"log_probs": len(turn.log_probs), "mask": None if turn.mask is None else len(turn.mask),
               "full_log_probs": None if turn.full_log_probs is None else len(turn.full_log_probs)}
    wrong = {name: length for name, length in lengths.items() if length is not None and length != n}
    assert not wrong, f"a decoded turn of {n} tokens has {wrong}"


def _sglang_generate(reply) -> None:
    """A `/generate` reply, read as the sglang source reads it: its ids, then its meta_info."""
    if isinstance(reply, dict) and isinstance(reply.get("meta_info"), dict):  # what the decoders' Mapping types ask
        for vocab in (None, VOCAB):
            _aligned(turn_from_sglang(sampled_ids(reply), reply["meta_info"], vocab_size=vocab))


def _sglang_chat(reply) -> None:
    """A `/v1/chat/completions` reply asked with `return_meta_info`."""
    if isinstance(reply, dict):
        for vocab in (None, VOCAB):
            _aligned(turn_from_sglang_chat(reply, vocab_size=vocab))


def _vllm_choice(choice) -> None:
    """One choice of vLLM's `/inference/v1/generate` (any value: the decoder reads a non-mapping's attributes)."""
    for vocab in (None, VOCAB):
        _aligned(turn_from_vllm(choice, vocab_size=vocab))


def _engine_error(body) -> None:
    """An HTTP 400's body (or an abort's finish_reason): an overflow, with the numbers the message gave, or another refusal."""
    overflow = overflow_from_error(body)
    assert overflow is None or (isinstance(overflow, SupportOverflow) and all(
        value is None or type(value) is int for value in (overflow.support, overflow.cap))), \
        f"overflow_from_error gave {overflow!r} (support and cap are ints or None)"


def _weight_versions(value) -> None:
    """A reply's `weight_versions`: spans of a string version and int bounds, empty ones left out."""
    spans = engine_spans(value, "weight_versions")
    assert (spans is None) == (value is None), f"engine_spans gave {spans!r} for {value!r:.80}"
    assert all(type(v) is str and type(s) is int and type(e) is int and e > s for v, s, e in spans or ()), \
        f"engine_spans gave {spans!r:.200}"


# How the engine_replies target reads the bytes after its first: a JSON reply, passed to one decoder.
ENGINE_REPLIES: dict[str, Callable[[object], None]] = {
    "sglang_generate": _sglang_generate, "sglang_chat": _sglang_chat, "vllm_choice": _vllm_choice,
    "engine_error": _engine_error, "weight_versions": _weight_versions}
# The kind of input whose bytes are bitset rows, not JSON: one byte of row width minus one, then the rows.
BITSET = "bitset"
ENGINE_INPUTS = (*ENGINE_REPLIES, BITSET)


def engine_reply(kind: str, content) -> bytes:
    """An engine_replies input: `kind` (of `ENGINE_INPUTS`) and its JSON
    value, or for `BITSET` a uint8 array of rows."""
    if kind == BITSET:
        rows = np.asarray(content, np.uint8)
        return bytes([ENGINE_INPUTS.index(kind), rows.shape[1] - 1]) + rows.tobytes()
    return bytes([ENGINE_INPUTS.index(kind)]) + json.dumps(content).encode()


def _bitset(data: bytes) -> None:
    """Packed support rows as vLLM hands them on the GPU: each row's
    set bits, least significant first, are its support."""
    width = data[0] + 1 if data else 1
    body = data[1:]
    rows = np.frombuffer(body[: len(body) // width * width], np.uint8).reshape(-1, width)
    mask = SamplingMask.from_bitset(rows)
    bits = np.unpackbits(rows, axis=1, bitorder="little")
    sizes, counts = mask.support_sizes, bits.sum(axis=1)
    assert np.array_equal(sizes, counts), f"supports of {sizes.tolist()} ids from rows of {counts.tolist()} bits"
    assert bits[np.repeat(np.arange(len(mask)), sizes), mask.ids].all(), "a support holds an id whose bit is not set"


def engine_replies(data: bytes) -> None:
    """An inference engine's HTTP reply, as a producer's engine sources
    decode it: the first byte picks the decoder (`ENGINE_INPUTS`, modulo
    their count), the rest is its JSON (a turn decoded without and with a
    vocabulary, and aligned; bytes that are not JSON never reach a decoder:
    `post_json` refuses them), or `BITSET` rows."""
    if not data:
        return
    kind = ENGINE_INPUTS[data[0] % len(ENGINE_INPUTS)]
    if kind == BITSET:
        _bitset(data[1:])
        return
    try:
        reply = json.loads(data[1:])
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return
    ENGINE_REPLIES[kind](reply)


# -- files ---------------------------------------------------------------------------
def _write_segments(directory: Path, files: list[bytes]) -> None:
    log = SegmentLog(directory, 1 << 20)
    for number, content in enumerate(files, 1):
        log.path(number).write_bytes(content)


SPOOL_OWNER = "fuzz-producer"
CURSOR_PROMPTS = "fuzz prompts"  # what the target's cursor is kept for


def spool(data: bytes) -> None:
    """A producer's spool directory holding the input's segment files,
    opened (a torn last record cut, a damaged one refused) and its backlog
    read back frame by frame."""
    directory = scratch("spool")
    (directory / "PRODUCER").write_text(SPOOL_OWNER, encoding="utf-8")
    _write_segments(directory, FileInput.read(data).segment_files())
    with leaves_nothing_open("opening and reading a spool"):
        opened = Spool(directory, SPOOL_OWNER, max_bytes=1 << 24)
        try:
            while opened.next_backlog() is not None:
                pass
        finally:
            opened.close()


def cursor(data: bytes) -> None:
    """A producer's prompt cursor file (the spool directory's `CURSOR`) as a
    restarted daemon reads it: restored or refused, and written anew."""
    directory = scratch("cursor")
    (directory / CURSOR_FILE).write_bytes(data)
    with leaves_nothing_open("restoring a prompt cursor"):
        kept = PromptCursor(directory, SPOOL_OWNER, prompts=CURSOR_PROMPTS, group_size=2)
        kept.close()
        again = PromptCursor(directory, SPOOL_OWNER, prompts=CURSOR_PROMPTS, group_size=2)
        again.close()
    assert (again.stem, again.next, again.outstanding) == (kept.stem, kept.next, kept.outstanding), \
        "a cursor written anew restores as it was"


def segments(data: bytes) -> None:
    """A segment file scanned from its start; every record the scan found
    reads back and verifies at its location, one length off is damage; a
    torn tail, cut at the scan's end, takes the next append after the
    records before it; the content read as one record at a location."""
    directory = scratch("segments")
    given = FileInput.read(data)
    files = given.segment_files()
    _write_segments(directory, files[:1])
    with leaves_nothing_open("scanning and reading a segment file"):
        # Room for one more record, so the append below goes after what the scan found (and reserves little ahead).
        log = SegmentLog(directory, len(files[0]) + (1 << 12))
        scan = log.scan(1)
        located = [location for location, _ in scan.records]
        if [bytes(p) for p in log.read_many(located)] != [bytes(p) for _, p in scan.records]:
            raise AssertionError("records read back at the locations scan gave differ from what scan read")
        log.verify(located)
        for number, offset, length in located[:4]:
            for wrong in (length - 1, length + 1):
                if wrong >= 0:
                    try:
                        log.read_many([(number, offset, wrong)])
                    except SegmentDamaged:
                        continue
                    raise AssertionError(f"a record of {length} bytes read as {wrong} bytes at offset {offset} passed")
        if scan.damage is None or scan.torn:
            log.open_current(scan.end)
            try:
                (added,) = log.append([([b"appended"], None)])
            finally:
                log.close()
            again = log.scan(1)
            found = [location for location, _ in again.records]
            if again.damage is not None or found != [*located, added]:
                raise AssertionError(f"after cutting at {scan.end} and appending, a scan finds {found} "
                                     f"(damage: {again.damage}), expected {[*located, added]}")
        log._checked(given.content, (1, HEADER.size, max(0, len(given.content) - HEADER.size)))


# The store the store target damages: turns of open, ended and grouped
# trajectories (an open one is replayed at start-up, an ended one when
# delivered), written once per process.
_STORE_TEMPLATE: list[tuple[Path, list[tuple[int, int]], list[bytes]]] = []


def store_template() -> tuple[Path, list[tuple[int, int]], list[bytes]]:
    """The template store's directory, its segment's records (payload
    offset and length, in file order) and their payloads."""
    if not _STORE_TEMPLATE:
        directory = scratch("store-template")
        made = Store(directory)
        made.open()
        engine = MergeEngine(EngineSettings())
        produced = [
            turn_frames("open", 0, 1, forced=(20,)), turn_frames("open", 1, 2, tokens=(12,), supports=((12, 5),)),
            turn_frames("done", 0, 3, tokens=(5,), supports=((5,),), forced=(6,), crc=True),
            encode(PRODUCER_TO_BROKER, "end", {"seq": 4, "trajectory_id": "done", "reward": {"acc": 1.0},
                                               "metadata": {"k": "v"}}),
            turn_frames("g0", 0, 5, supports=None, group_id="G", group_size=2),
            turn_frames("g1", 0, 6, supports=None, group_id="G", group_size=2, may_pack=True),
            encode(PRODUCER_TO_BROKER, "end", {"seq": 7, "trajectory_id": "g0", "reward": 0.0}),
        ]
        for frames in produced:
            reply = engine.handle(decode(frames, PRODUCER_TO_BROKER), 1.0)
            if reply.error is not None:
                raise AssertionError(f"the store template's messages must apply: {reply.error}")
            made.commit(list(reply.effects))
        made.close()
        (directory / "LOCK").unlink()
        log = SegmentLog(directory / "segments", 1 << 30)
        scan = log.scan(1)
        _STORE_TEMPLATE.append((directory, [(offset, length) for (_, offset, length), _ in scan.records],
                                [bytes(payload) for _, payload in scan.records]))
    return _STORE_TEMPLATE[0]


def store(data: bytes) -> None:
    """The broker's data directory with its segment file replaced: raw, the
    input as the file; framed, the input's frames as the template's
    records' payloads (each cut or padded to the record's length, so the
    rows still name it, its CRC right). Salvaged first (options bit 1),
    then opened, the open trajectories replayed and the ended ones read
    back as a delivery reads them."""
    template, located, payloads = store_template()
    directory = scratch("store")
    shutil.copytree(template, directory, dirs_exist_ok=True)
    given = FileInput.read(data)
    segment = directory / "segments" / "seg-00000001.log"
    if given.framed:
        given_payloads = split_frames(given.content)
        content = bytearray(segment.read_bytes())
        for i, (offset, length) in enumerate(located):
            payload = given_payloads[i][:length].ljust(length, b"\0") if i < len(given_payloads) else payloads[i]
            content[offset - HEADER.size : offset + length] = record(payload)
        segment.write_bytes(content)
    else:
        segment.write_bytes(given.content)
    with leaves_nothing_open("salvaging and opening a store"):
        if given.torn:
            salvaging = Store(directory)
            try:
                salvaging.salvage()
            finally:
                salvaging.close()
        opened = Store(directory)
        try:
            recovered = opened.open()
            rebuild(recovered, opened)
            for stored in recovered.trajectories:
                if stored.state != OPEN and any(turn.location for turn in stored.turns):
                    load_trajectory(opened, stored)
        finally:
            opened.close()


# The archive the archive target damages: the store template's ended trajectories, delivered and committed, so
# their rows and a copy of the segment holding their records went to the archive; written once per process.
_ARCHIVE_TEMPLATE: list[tuple[Path, str]] = []


def archive_template() -> tuple[Path, str]:
    """The template archive's directory and its segment file's path in it."""
    if not _ARCHIVE_TEMPLATE:
        from rollstream.broker.archive import Archiver, archive_stopped, segments_of
        from rollstream.broker.store import Archiving

        template, _, _ = store_template()
        data = scratch("archive-template-data")
        shutil.copytree(template, data, dirs_exist_ok=True)
        root = scratch("archive-template")
        made = Store(data, archive=Archiving())
        engine = MergeEngine(EngineSettings())
        engine.restore(*rebuild(made.open(), made).engine_state())
        for tid in ("done", "g0"):
            made.commit(engine.delivered(tid, 2.0))
        store_id = made.store_id
        archiver = Archiver(root, store_id)
        try:
            archive_stopped(made, archiver)
        finally:
            archiver.close()
            made.close()
        (segment,) = segments_of(root, store_id).glob("seg-*.log")
        _ARCHIVE_TEMPLATE.append((root, str(segment.relative_to(root))))
        _read_archive(root)  # pyarrow starts its thread pools (and their descriptors) once, here
    return _ARCHIVE_TEMPLATE[0]


def archive(data: bytes) -> None:
    """A broker's archive with its segment file replaced as the store
    target replaces the store's (raw, or framed: the input's frames as the
    template's records' payloads, their CRCs right), then exported to a
    dataset (every row's records read back and merged) and asked for a
    trajectory's story, as `rollstream history` asks."""
    template, segment_name = archive_template()
    _, located, payloads = store_template()
    root = scratch("archive")
    shutil.copytree(template, root, dirs_exist_ok=True)
    given = FileInput.read(data)
    segment = root / segment_name
    if given.framed:
        given_payloads = split_frames(given.content)
        content = bytearray(segment.read_bytes())
        for i, (offset, length) in enumerate(located):
            if offset + length <= len(content):
                payload = given_payloads[i][:length].ljust(length, b"\0") if i < len(given_payloads) else payloads[i]
                content[offset - HEADER.size : offset + length] = record(payload)
        segment.write_bytes(content)
    else:
        segment.write_bytes(given.content)
    # pyarrow's I/O threads close the Parquet files they read on their own schedule: only the rest is counted.
    with leaves_nothing_open("exporting an archive", unless=lambda path: path.endswith(".parquet")):
        _read_archive(root)


def _read_archive(root: Path) -> None:
    """What readers do with an archive: export it (every row's records read
    back and merged) and ask for a trajectory's story."""
    from rollstream.app.history import History
    from rollstream.broker.export import export_archive

    export_archive(root, scratch("archive-out") / "run.parquet")
    History(root).trajectory("done")


# -- settings ------------------------------------------------------------------------
_BROKER_KEYS = {f.name for f in fields(BrokerSettings)}
_PRODUCER_KEYS = {f.name for f in fields(ProducerSettings)}


def settings_toml(data: bytes) -> None:
    """A TOML settings file: its keys read for each daemon, then loaded as
    `rollstream broker --config FILE --check-config` and `rollstream
    producer ...` load it (every problem in one `ConfigError`)."""
    path = scratch("settings") / "config.toml"
    path.write_bytes(data)
    for section, keys in (("broker", _BROKER_KEYS), ("producer", _PRODUCER_KEYS)):
        with contextlib.suppress(ConfigError):
            load_toml(path, keys, section)
    for command in (broker_command, producer_command):
        with contextlib.suppress(ConfigError), contextlib.redirect_stdout(io.StringIO()):
            command.main(["--config", str(path), "--check-config"], prog_name=command.name, standalone_mode=False)


# -- the table -----------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """A fuzz target: its function and the errors it may raise (its
    decoders' documented family)."""

    name: str
    function: Callable[[bytes], None]
    allowed: tuple[type[BaseException], ...]


TARGETS: dict[str, Target] = {target.name: target for target in (
    Target("producer_to_broker", producer_to_broker, (ProtocolError,)),
    Target("split_batch", split_batch_target, (ProtocolError,)),
    Target("consumer_to_broker", consumer_to_broker, (ProtocolError,)),
    Target("broker_to_producer", broker_to_producer, (ProtocolError,)),
    Target("broker_to_consumer", broker_to_consumer, (ProtocolError,)),
    Target("admin", admin, (ProtocolError, AdminError)),
    # decode_session_samples: InvalidInput (MissingTensor is one); a mask it rebuilds refuses as SamplingMask does.
    Target("miles_session", miles_session, (InvalidInput, ProtocolError)),
    # The ingest decoders refuse a reply with LocalProtocolError (a rule broken), InvalidInput (an unknown
    # finish_reason) or SupportOverflow (the engine's own refusal of an outgrown support).
    Target("engine_replies", engine_replies, (ProtocolError, InvalidInput, SupportOverflow)),
    Target("spool", spool, (SpoolError,)),
    Target("cursor", cursor, (CursorError,)),
    Target("segments", segments, (SegmentDamaged,)),
    # StoreError: what the store's files hold is damaged (or unreadable); RemoteProtocolError: a record read back
    # that the merge refuses (broker/recovery.py, load_trajectory).
    Target("store", store, (StoreError, RemoteProtocolError)),
    # The same of an archive's segment read back; InvalidInput: a row the archive holds whose records it lacks
    # (cut off by the input) is skipped by an export, and asked for by history, said so.
    Target("archive", archive, (StoreError, RemoteProtocolError, InvalidInput)),
    Target("settings_toml", settings_toml, (ConfigError,)),
)}


@dataclass(frozen=True)
class NotFixedYet:
    """A past finding whose fix has not landed: its regression input
    replays as an expected failure, and a fuzzing run that stops at the same
    crash (`exception` raised in the function `where` names, as
    "path/to/file.py:function") reports it as known rather than new."""

    reason: str
    exception: str
    where: str


# By regression input (target/name). Once a fix lands, its input passes, the replay test says so, and the entry goes.
NOT_FIXED_YET: dict[str, NotFixedYet] = {}


def run_target(name: str, data: bytes) -> None:
    """One input through target `name`: its allowed errors are the
    decoders' answer to a bad input; anything else propagates (a finding)."""
    target = TARGETS[name]
    try:
        target.function(data)
    except target.allowed:
        pass
