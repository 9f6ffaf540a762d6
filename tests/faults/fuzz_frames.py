"""Malformed frames for the broker's three sockets, each with the reply the
protocol says it must get, interleaved with valid traffic, and a raw
consumer (`Taker`) that checks each delivery against the arrays recorded
here when they were sent.

Written from docs/protocol.md with msgpack and numpy only, so what a frame
must be answered never comes from the code under test. Seeded, so a failing
frame can be produced again. Shared by tests/faults/test_fuzz.py and
bench/soak.py.
"""
from __future__ import annotations

import time
import zlib
from collections import ChainMap, Counter
from dataclasses import dataclass, field

import msgpack
import numpy as np
import zmq

# Reply codes (protocol.md §2-§4), by the stage that refuses.
DECODE_CODES = frozenset({"malformed", "version", "schema", "too_large", "crc_mismatch", "dtype", "shape"})
CONTENT_CODES = frozenset({"misaligned", "mask_invalid", "out_of_vocab", "invalid_value"})
STATE_CODES = frozenset({"out_of_order", "conflict", "mask_presence", "unknown_trajectory", "unknown_consumer",
                         "stale_lease"})
ALL_CODES = DECODE_CODES | CONTENT_CODES | STATE_CODES
MAX_HEADER_DEPTH = 32  # protocol.md §2: a header nested deeper is malformed

# protocol.md §2's array table: wire dtype of each name.
CONTRACT = {"prompt_tokens": "int32", "tokens": "int32", "forced_tokens": "int32", "log_probs": "float32",
            "loss_mask": "uint8", "mask_ids": "int32", "mask_offsets": "int64", "routed_experts": "int32",
            "indexer_topk": "int32", "full_log_probs": "float32", "mask_log_probs": "float32"}
NUMPY = {"int32": "<i4", "int64": "<i8", "float32": "<f4", "uint8": "u1"}
OTHER_DTYPES = ("int64", "int32", "float32", "float64", "uint8", "int16", "bool", "<i4", "i4", "int32 ")
UNCHECKED = "unchecked"  # a reply whose seq cannot be known (random bytes, flipped headers)


@dataclass
class Expect:
    """One reply a message must get: its type (a `nack` with one of
    `codes`), and the `seq` it carries (None: none; UNCHECKED: either)."""

    type: str
    seq: object = None
    codes: frozenset = frozenset()

    def problem(self, reply: dict) -> str | None:
        if not isinstance(reply, dict) or reply.get("type") != self.type:
            return f"expected a {self.type}, got {reply!r:.300}"
        if self.type == "nack" and reply.get("code") not in self.codes:
            return f"expected a nack coded {sorted(self.codes)}, got {reply!r:.300}"
        if self.type == "nack" and not reply.get("message"):
            return f"a nack must say why: {reply!r:.300}"
        if self.type == "ack" and reply.get("applied") is not True:
            return f"expected an applied ack, got {reply!r:.300}"
        if self.seq != UNCHECKED and reply.get("seq") != self.seq:
            return f"expected seq {self.seq}, got {reply!r:.300}"
        return None


@dataclass
class Sent:
    """A message to send, what kind of frame it is, and its replies in order."""

    kind: str
    frames: list
    expects: list

    @property
    def bad(self) -> bool:
        return any(e.type == "nack" for e in self.expects)


def nack(codes, seq=None) -> Expect:
    return Expect("nack", seq, frozenset([codes]) if isinstance(codes, str) else frozenset(codes))


@dataclass
class Trajectory:
    """A valid trajectory as sent, and the arrays its delivery must hold
    (protocol.md §6: sampled tokens, then forced ones with a singleton
    support, loss 0 and log-prob 0.0)."""

    tid: str
    reward: float
    turns: int = 0
    arrays: dict = field(default_factory=dict)


class Message:
    """A header map and its array frames, before they are packed: what the
    mutations below change."""

    def __init__(self, mtype: str, fields: dict, arrays: dict | None = None, *, crc: bool = True, packed: bool = False):
        self.header = {"v": 1, "type": mtype, **fields}
        self.arrays = dict(arrays or {})
        self.crc, self.packed = crc, packed

    def frames(self) -> list:
        header = dict(self.header)
        names = list(self.arrays)
        if self.packed:  # widest items first, so each array starts aligned (protocol.md §2)
            names.sort(key=lambda name: -np.dtype(NUMPY[CONTRACT[name]]).itemsize)
        bufs = [np.ascontiguousarray(self.arrays[name], NUMPY[CONTRACT[name]]).tobytes() for name in names]
        if names:
            header["arrays"] = [[name, CONTRACT[name], list(np.shape(self.arrays[name]))] for name in names]
        if self.packed:
            header["packed"] = True
            bufs = [b"".join(bufs)] if bufs else []
        if self.crc and bufs:
            header["crc32"] = crc_of(bufs)
        return [msgpack.packb(header)] + bufs


def crc_of(bufs) -> int:
    value = 0
    for buf in bufs:
        value = zlib.crc32(buf, value)
    return value


def with_header(frames: list, **changes) -> list:
    header = msgpack.unpackb(frames[0])
    header.update(changes)
    return [msgpack.packb(header)] + list(frames[1:])


def with_deep_metadata(frames: list, depth: int) -> list:
    """The header with a `metadata` map nested `depth` levels deep added,
    packed by hand: msgpack's packer stops at 512 levels, its reader at
    about 1,000."""
    first = frames[0][0]
    assert 0x80 <= first < 0x8F, "a fixmap header with room for one more key"
    deep = b"\x81\xa1k" * (depth - 1) + msgpack.packb({"leaf": 1})
    return [bytes([first + 1]) + frames[0][1:] + msgpack.packb("metadata") + deep, *frames[1:]]


def depth_of(value) -> int:
    """Levels of maps and lists in `value` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def header_verdict(raw: bytes) -> Expect:
    """What protocol.md §2 says a header of arbitrary bytes is answered, as
    far as the bytes alone decide: `malformed` when they are not one msgpack
    map with string keys nested at most `MAX_HEADER_DEPTH`, then `version`;
    a map that gets further is refused by some later rule."""
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        return nack("malformed")
    if type(header) is not dict or any(type(key) is not str for key in header) or depth_of(header) > MAX_HEADER_DEPTH:
        return nack("malformed")
    seq = header.get("seq") if type(header.get("seq")) is int else None
    version = header.get("v")
    if type(version) is not int or version != 1:
        return nack("version", seq)
    return nack(ALL_CODES - {"malformed", "version"}, seq)


def batch_frames(messages: list[list]) -> list:
    """One `batch` (protocol.md §3) carrying `messages`: their headers with
    the lengths of their frames, the frames end to end in the body, each at
    a multiple of 8."""
    entries, body = [], b""
    for message in messages:
        lengths = []
        for frame in message[1:]:
            body += bytes(-len(body) % 8) + frame
            lengths.append(len(frame))
        entries.append([message[0], lengths])
    return [msgpack.packb({"v": 1, "type": "batch", "messages": entries}), body]


class Fuzz:
    """The frames of one socket's fuzz: `next()` gives one `Sent` at a time."""

    def __init__(self, seed: int, vocab_size: int, max_message_bytes: int, prefix: str = "f"):
        self.rng = np.random.default_rng(seed)
        self.vocab_size, self.max_message_bytes, self.prefix = vocab_size, max_message_bytes, prefix
        self.seq = 0
        self.serial = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def name(self, what: str) -> str:
        self.serial += 1
        return f"{self.prefix}-{what}-{self.serial:06d}"

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def random_bytes(self, low: int, high: int) -> bytes:
        return self.rng.bytes(int(self.rng.integers(low, high)))

    def random_message(self) -> Sent:
        frames = [self.random_bytes(1, 48)] + [self.random_bytes(0, 200) for _ in range(int(self.rng.integers(0, 4)))]
        if self.rng.random() < 0.3:  # a map-like start gets further into the parser
            frames[0] = bytes([0x80 + int(self.rng.integers(1, 16))]) + frames[0]
        return Sent("random_bytes", frames, [header_verdict(frames[0])])

    def flipped(self, kind: str, frames: list) -> Sent:
        """One byte of the header changed (callers pick headers that no single
        change can make acceptable): any refusal, any seq."""
        raw = bytearray(frames[0])
        at = int(self.rng.integers(len(raw)))
        raw[at] = (raw[at] + int(self.rng.integers(1, 256))) % 256
        return Sent(kind, [bytes(raw), *frames[1:]], [nack(ALL_CODES, UNCHECKED)])

    def header_damage(self, frames: list) -> tuple[str, list, Expect]:
        """Damage every header reader sees the same way: cut short, bytes
        after the map, too deep, or a version that is not the integer 1."""
        choice = int(self.rng.integers(4))
        if choice == 0:
            return "truncated_header", [frames[0][:int(self.rng.integers(len(frames[0])))], *frames[1:]], nack("malformed")
        if choice == 1:
            return "trailing_bytes", [frames[0] + self.random_bytes(1, 9), *frames[1:]], nack("malformed")
        if choice == 2:
            depth = int(self.rng.integers(MAX_HEADER_DEPTH + 1, 1000))
            return "deep_header", with_deep_metadata(frames, depth), nack("malformed")
        header = msgpack.unpackb(frames[0])
        version = self.pick([2, 0, -1, True, 1.0, "1", None, [1]])
        if version is None:
            del header["v"]
        else:
            header["v"] = version
        seq = header.get("seq") if type(header.get("seq")) is int else None
        return "bad_version", [msgpack.packb(header), *frames[1:]], nack("version", seq)


class ProducerFuzz(Fuzz):
    """Turn, end and batch frames for the producer socket: the fuzz's own
    trajectories (ids `<prefix>-fz-...`) are never applied, valid ones
    (`<prefix>-ok-...`) always are and are recorded in `expected`."""

    def __init__(self, seed: int, vocab_size: int, max_message_bytes: int, prefix: str = "p", valid_share: float = 0.1):
        super().__init__(seed, vocab_size, max_message_bytes, prefix)
        self.valid_share = valid_share
        self.expected: dict[str, Trajectory] = {}
        self._valid: list[tuple[str, Message]] = []  # the next valid messages, in the order they must go
        self._oversize: Message | None = None

    # -- valid traffic ----------------------------------------------------------
    def turn_arrays(self, n: int, forced: int, full_log_probs: bool, mask_log_probs: bool = False) -> dict:
        vocab = self.vocab_size
        tokens = self.rng.integers(0, vocab, n).astype(np.int32)
        supports = []
        for token in tokens:
            others = self.rng.integers(0, vocab, int(self.rng.integers(0, 5)))
            support = np.unique(np.append(others[others != token], token)).astype(np.int32)
            supports.append(self.rng.permutation(support))
        arrays = {"tokens": tokens,
                  "log_probs": -self.rng.random(n, dtype=np.float32) * 5,
                  "mask_ids": np.concatenate(supports).astype(np.int32),
                  "mask_offsets": np.concatenate([[0], np.cumsum([len(s) for s in supports])]).astype(np.int64)}
        if forced:
            arrays["forced_tokens"] = self.rng.integers(0, vocab, forced).astype(np.int32)
        if full_log_probs:  # below the truncated distribution's: the whole vocabulary shares the mass
            arrays["full_log_probs"] = arrays["log_probs"] - self.rng.random(n, dtype=np.float32)
        if mask_log_probs:  # one per support id, beside the ids
            arrays["mask_log_probs"] = -self.rng.random(len(arrays["mask_ids"]), dtype=np.float32) * 5
        return arrays

    def renormalised(self, turn: Message) -> None:
        """Its supports' log-probs made each support's distribution (protocol.md
        §2: probabilities that sum to 1), said so in the header."""
        a = turn.arrays
        offsets = a["mask_offsets"]
        values = np.exp(a["mask_log_probs"].astype(np.float64))
        sums = np.repeat(np.add.reduceat(values, offsets[:-1]), np.diff(offsets))
        a["mask_log_probs"] = np.minimum(np.log(values / sums), 0.0).astype(np.float32)
        turn.header["mask_log_probs_normalized"] = True

    def valid_trajectory(self) -> list[tuple[str, Message]]:
        """A new valid trajectory's messages (turns, then its end), recorded
        with the arrays its delivery must carry."""
        tid = self.name("ok")
        traj = self.expected[tid] = Trajectory(tid, float(np.float32(self.rng.standard_normal())))
        turns = int(self.rng.integers(1, 4))
        prompt = self.rng.integers(0, self.vocab_size, int(self.rng.integers(1, 6))).astype(np.int32)
        tokens, loss, log_probs, ids, lengths, full, support = [], [], [], [], [], [], []
        messages = []
        carries_full = bool(self.rng.random() < 0.5)  # every turn of the trajectory, or none (a replay field)
        carries_support = bool(self.rng.random() < 0.5)  # the supports' log-probs: a replay field too
        for index in range(turns):
            n = int(self.rng.integers(1, 9))
            arrays = self.turn_arrays(n, int(self.rng.integers(0, 3)), carries_full, carries_support)
            forced = arrays.get("forced_tokens", np.zeros(0, np.int32))
            if index == 0:
                arrays["prompt_tokens"] = prompt
            fields = {"seq": 0, "trajectory_id": tid, "turn": index, "status": "completed"}
            turn = Message("turn", fields, arrays, crc=self.rng.random() < 0.7, packed=self.rng.random() < 0.4)
            if carries_support and self.rng.random() < 0.5:
                self.renormalised(turn)
            messages.append((tid, turn))
            tokens += [arrays["tokens"], forced]
            loss += [np.ones(n, np.uint8), np.zeros(len(forced), np.uint8)]
            log_probs += [arrays["log_probs"], np.zeros(len(forced), np.float32)]
            full += [arrays.get("full_log_probs", np.zeros(0, np.float32)), np.zeros(len(forced), np.float32)]
            # A forced token's singleton support is certain: log-prob 0.0.
            support += [turn.arrays.get("mask_log_probs", np.zeros(0, np.float32)), np.zeros(len(forced), np.float32)]
            ids += [arrays["mask_ids"], forced]
            lengths += [np.diff(arrays["mask_offsets"]), np.ones(len(forced), np.int64)]
        traj.turns = turns
        traj.arrays = {"prompt_tokens": prompt, "tokens": np.concatenate(tokens), "loss_mask": np.concatenate(loss),
                       "log_probs": np.concatenate(log_probs), "mask_ids": np.concatenate(ids),
                       "mask_offsets": np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)}
        if carries_full:
            traj.arrays["full_log_probs"] = np.concatenate(full)
        if carries_support:
            traj.arrays["mask_log_probs"] = np.concatenate(support)
        messages.append((tid, Message("end", {"seq": 0, "trajectory_id": tid, "reward": traj.reward, "turns": turns})))
        return messages

    def valid_message(self) -> Sent:
        if not self._valid:
            self._valid = self.valid_trajectory()
        tid, message = self._valid.pop(0)
        seq = message.header["seq"] = self.next_seq()
        return Sent("valid", message.frames(), [Expect("ack", seq)])

    def finish(self) -> list[Sent]:
        """The rest of the valid trajectory under way, so every recorded one ends."""
        out = []
        while self._valid:
            out.append(self.valid_message())
        return out

    # -- the fuzz's own frames ----------------------------------------------------
    def fz_turn(self, index: int | None = None) -> Message:
        """A well-formed turn of a trajectory nobody started: a turn > 0 is
        refused `out_of_order` once every other rule passes."""
        n = int(self.rng.integers(1, 9))
        arrays = self.turn_arrays(n, int(self.rng.integers(0, 3)), bool(self.rng.random() < 0.5),
                                  bool(self.rng.random() < 0.5))
        index = int(self.rng.integers(1, 6)) if index is None else index
        fields = {"seq": self.next_seq(), "trajectory_id": self.name("fz"), "turn": index, "status": "completed"}
        turn = Message("turn", fields, arrays, crc=self.rng.random() < 0.6, packed=self.rng.random() < 0.3)
        if "mask_log_probs" in arrays and self.rng.random() < 0.5:
            self.renormalised(turn)
        return turn

    def fz_end(self) -> Message:
        return Message("end", {"seq": self.next_seq(), "trajectory_id": self.name("fz"), "reward": 1.0})

    def content_damage(self, turn: Message) -> tuple[str, str]:
        """Arrays that break one content rule, decodable otherwise (a crc
        over them is recomputed): the rule's kind and code."""
        a = turn.arrays
        n = len(a["tokens"])
        offsets, ids = a["mask_offsets"].copy(), a["mask_ids"].copy()
        choice = int(self.rng.integers(15))
        if choice >= 12:  # the supports' log-probs (one per support id), when the turn carries them
            if "mask_log_probs" not in a:
                return self.content_damage(turn)
            support = a["mask_log_probs"].copy()
            if choice == 12:
                a["mask_log_probs"] = support[:-1] if self.rng.random() < 0.5 else np.append(support, np.float32(-1.0))
                return "misaligned_mask_log_probs", "misaligned"
            if choice == 13:
                support[int(self.rng.integers(len(support)))] = self.pick([np.nan, np.inf, -np.inf, 0.5])
                a["mask_log_probs"] = support
                return "mask_log_prob_value", "invalid_value"
            i = int(self.rng.integers(n))  # said renormalised, token i's support sums to less than 1
            if not turn.header.get("mask_log_probs_normalized"):
                self.renormalised(turn)
            support = a["mask_log_probs"].copy()
            support[offsets[i]:offsets[i + 1]] -= np.float32(0.5)
            a["mask_log_probs"] = support
            return "mask_log_probs_not_normalized", "invalid_value"
        if choice >= 10:  # the optional per-token log-probs, when the turn carries them
            if "full_log_probs" not in a:
                return self.content_damage(turn)
            if choice == 10:
                a["full_log_probs"] = a["full_log_probs"][:-1]
                return "misaligned_full_log_probs", "misaligned"
            full = a["full_log_probs"].copy()
            full[int(self.rng.integers(n))] = self.pick([np.nan, np.inf, -np.inf, 0.5])
            a["full_log_probs"] = full
            return "full_log_prob_value", "invalid_value"
        if choice == 0:
            offsets[0] = 1
            a["mask_offsets"] = offsets
            return "csr_offsets_start", "mask_invalid"
        if choice == 1:
            a["mask_ids"] = np.append(ids, np.int32(0))  # offsets[-1] != len(mask_ids)
            if "mask_log_probs" in a:  # still one per id: misaligned is checked first
                a["mask_log_probs"] = np.append(a["mask_log_probs"], np.float32(-1.0))
            return "csr_offsets_end", "mask_invalid"
        if choice == 2:
            if n < 2:
                return self.content_damage(turn)
            offsets[1] = offsets[0]  # token 0 has an empty support
            a["mask_offsets"] = offsets
            return "csr_empty_support", "mask_invalid"
        if choice == 3:
            i = int(self.rng.integers(n))
            ids[offsets[i]:offsets[i + 1]] = (a["tokens"][i] + 1) % self.vocab_size  # the token left its support
            a["mask_ids"] = ids
            return "csr_token_outside", "mask_invalid"
        if choice == 4:
            a["log_probs"] = a["log_probs"][:-1]
            return "misaligned_log_probs", "misaligned"
        if choice == 5:
            a["mask_offsets"] = np.append(offsets, offsets[-1])
            return "misaligned_offsets", "misaligned"
        if choice == 6:
            a["loss_mask"] = np.ones(n + 1, np.uint8)
            return "misaligned_loss_mask", "misaligned"
        if choice == 7:
            i = int(self.rng.integers(n))
            bad = self.pick([self.vocab_size, -1, 2**31 - 1])
            tokens = a["tokens"].copy()
            tokens[i] = bad
            ids[offsets[i]] = bad  # still inside its support
            a["tokens"], a["mask_ids"] = tokens, ids
            return "out_of_vocab", "out_of_vocab"
        if choice == 8:
            mask = np.ones(n, np.uint8)
            mask[int(self.rng.integers(n))] = int(self.rng.integers(2, 256))
            a["loss_mask"] = mask
            return "loss_mask_value", "invalid_value"
        log_probs = a["log_probs"].copy()
        log_probs[int(self.rng.integers(n))] = self.pick([np.nan, np.inf, -np.inf, 0.5])
        a["log_probs"] = log_probs
        return "log_prob_value", "invalid_value"

    def field_damage(self) -> Sent:
        """A known header field of the wrong kind (protocol.md §3): `schema`."""
        if self.rng.random() < 0.3:
            end = self.fz_end()
            key, value = self.pick([("reward", float("nan")), ("reward", "high"), ("reward", [1.0]),
                                    ("turns", -1), ("metadata", [1]), ("trajectory_id", "")])
            end.header[key] = value
            return Sent("field_kind", end.frames(), [nack("schema", end.header["seq"])])
        turn = self.fz_turn()
        if "mask_log_probs" in turn.arrays and self.rng.random() < 0.2:  # protocol.md §3: they travel with the mask
            del turn.arrays["mask_ids"], turn.arrays["mask_offsets"]
            return Sent("mask_log_probs_without_mask", turn.frames(), [nack("schema", turn.header["seq"])])
        key, value = self.pick([("seq", "7"), ("trajectory_id", ""), ("trajectory_id", 7), ("turn", -1),
                                ("turn", "1"), ("status", "done"), ("weight_version", 5), ("metadata", "x"),
                                ("mask_log_probs_normalized", 1), ("mask_log_probs_normalized", "yes"),
                                ("group_size", 0), ("group_size", 2**63), ("sample_index", 2**64 - 1)])
        if key in ("group_size", "sample_index"):  # turn 0 may carry them: the value itself is wrong
            turn.header["turn"] = 0
            turn.arrays["prompt_tokens"] = np.array([1], np.int32)
            if key == "group_size":
                turn.header["group_id"] = "g"
        turn.header[key] = value
        seq = turn.header["seq"] if type(turn.header["seq"]) is int else None
        return Sent("field_kind", turn.frames(), [nack("schema", seq)])

    def oversize(self) -> Sent:
        """A well-formed turn of more bytes than `max_message_bytes` (and less
        than the socket's limit of twice that): `too_large`."""
        if self._oversize is None:
            n = self.max_message_bytes // 16  # 20 bytes a token (4 each of token, log-prob, support; 8 of offset)
            tokens = self.rng.integers(0, self.vocab_size, n).astype(np.int32)
            arrays = {"tokens": tokens, "log_probs": np.zeros(n, np.float32), "mask_ids": tokens,
                      "mask_offsets": np.arange(n + 1, dtype=np.int64)}
            self._oversize = Message("turn", {"seq": 0, "trajectory_id": self.name("fz"), "turn": 1,
                                              "status": "completed"}, arrays, crc=False)
        seq = self._oversize.header["seq"] = self.next_seq()
        return Sent("oversize", self._oversize.frames(), [nack("too_large", seq)])

    def layout_damage(self) -> Sent:
        """Frame counts, dtypes and shapes that disagree with the header."""
        turn = self.fz_turn()
        frames, seq = turn.frames(), turn.header["seq"]
        header = msgpack.unpackb(frames[0])
        entries = header.get("arrays", [])
        choice = int(self.rng.integers(8))
        if choice == 0:
            return Sent("frame_missing", frames[:-1], [nack("schema", seq)])
        if choice == 1:
            return Sent("frame_extra", frames + [self.random_bytes(0, 16)], [nack("schema", seq)])
        if choice == 2:
            at = int(self.rng.integers(len(entries)))
            entries[at][1] = self.pick([d for d in OTHER_DTYPES if d != entries[at][1]])
            return Sent("wrong_dtype", [msgpack.packb(header), *frames[1:]], [nack("dtype", seq)])
        if choice == 3:
            at = int(self.rng.integers(len(entries)))
            entries[at][2] = [entries[at][2][0] + int(self.rng.integers(1, 4))]
            return Sent("wrong_shape", [msgpack.packb(header), *frames[1:]], [nack("shape", seq)])
        if choice == 4:
            at = int(self.rng.integers(len(entries)))
            entries[at][2] = [entries[at][2][0], 1]  # a 1-D array listed as 2-D
            return Sent("wrong_rank", [msgpack.packb(header), *frames[1:]], [nack("shape", seq)])
        if choice == 5:  # an array frame cut short (the crc follows it, when there is one)
            body = list(frames[1:])
            at = int(self.rng.integers(len(body)))
            body[at] = body[at][:-1] if body[at] else b"x"
            if "crc32" in header:
                header["crc32"] = crc_of(body)
            return Sent("short_frame", [msgpack.packb(header), *body], [nack("shape", seq)])
        if choice == 6:  # a byte of the arrays changed under the crc
            turn.crc = True
            frames = turn.frames()
            body = [bytearray(frame) for frame in frames[1:]]
            at = int(self.rng.integers(len(body)))
            i = int(self.rng.integers(len(body[at])))
            body[at][i] ^= int(self.rng.integers(1, 256))
            return Sent("crc_flip", [frames[0], *map(bytes, body)], [nack("crc_mismatch", seq)])
        crc = self.pick([-1, 2**32, "0"])
        return Sent("crc_kind", with_header(frames, crc32=crc), [nack("schema", seq)])

    def batch_damage(self) -> Sent:
        """A batch that cannot be read (refused whole, no seq), or one that
        carries valid messages among bad ones, each answered by its own seq."""
        if self.rng.random() < 0.4:
            inner = [self.fz_turn().frames() for _ in range(int(self.rng.integers(1, 4)))]
            whole = batch_frames(inner)
            choice = int(self.rng.integers(3))
            if choice == 0:
                return Sent("batch_short_body", [whole[0], whole[1][:-1]], [nack("shape")])
            if choice == 1:
                return Sent("batch_long_body", [whole[0], whole[1] + bytes(9)], [nack("shape")])
            return Sent("batch_two_bodies", whole + [b""], [nack("schema")])
        parts, expects = [], []
        for _ in range(int(self.rng.integers(2, 6))):
            if self.rng.random() < 0.4:
                sent = self.valid_message()
            else:
                sent = self.pick([self.state_refusal, self.content_refusal, self.inner_ping])()
            parts.append(sent.frames)
            expects += sent.expects
        return Sent("batch_mixed", batch_frames(parts), expects)

    def inner_ping(self) -> Sent:
        seq = self.next_seq()
        return Sent("inner_ping", [msgpack.packb({"v": 1, "type": "ping", "seq": seq})], [nack("schema", seq)])

    def state_refusal(self) -> Sent:
        """Well-formed frames the broker's state refuses."""
        if self.rng.random() < 0.5:
            end = self.fz_end()
            return Sent("end_unknown", end.frames(), [nack("unknown_trajectory", end.header["seq"])])
        turn = self.fz_turn()
        return Sent("turn_out_of_order", turn.frames(), [nack("out_of_order", turn.header["seq"])])

    def content_refusal(self) -> Sent:
        turn = self.fz_turn()
        kind, code = self.content_damage(turn)
        return Sent(kind, turn.frames(), [nack(code, turn.header["seq"])])

    def bad_message(self) -> Sent:
        roll = self.rng.random()
        if roll < 0.1:
            return self.random_message()
        if roll < 0.2:
            kind, frames, expect = self.header_damage(self.pick([self.fz_turn, self.fz_end])().frames())
            return Sent(kind, frames, [expect])
        if roll < 0.3:
            return self.flipped("flipped_header", self.pick([self.fz_turn, self.fz_end])().frames())
        if roll < 0.4:
            return self.field_damage()
        if roll < 0.42:
            return self.oversize()
        if roll < 0.6:
            return self.layout_damage()
        if roll < 0.8:
            return self.content_refusal()
        if roll < 0.9:
            return self.state_refusal()
        unknown = {"v": 1, "type": self.pick(["explode", "", "Turn", "hello2"]), "seq": self.next_seq()}
        if roll < 0.93:
            return Sent("unknown_type", [msgpack.packb(unknown)], [nack("schema", unknown["seq"])])
        return self.batch_damage()

    def next(self) -> Sent:
        return self.valid_message() if self.rng.random() < self.valid_share else self.bad_message()


class ConsumerFuzz(Fuzz):
    """Consumer-socket frames. `stranger()` is for a connection that never
    says hello (every frame refused, well-formed ones `unknown_consumer`);
    `known()` only breaks rules that leave a live consumer as it was."""

    def wellformed(self) -> list:
        choice = int(self.rng.integers(4))
        seq = self.next_seq()
        if choice == 0:
            return [msgpack.packb({"v": 1, "type": "credit", "n": int(self.rng.integers(0, 5)),
                                   "unit": self.pick(["trajectory", "group"]), "seq": seq})]
        if choice == 1:
            return [msgpack.packb({"v": 1, "type": "ack", "leases": [self.name("lease")], "seq": seq})]
        if choice == 2:
            return [msgpack.packb({"v": 1, "type": "nack", "leases": [self.name("lease")], "reason": "fuzz",
                                   "requeue": bool(self.rng.random() < 0.5), "seq": seq})]
        return [msgpack.packb({"v": 1, "type": "heartbeat", "seq": seq})]

    def rule_broken(self) -> Sent:
        """A header that breaks a rule of protocol.md §2 or §4 whoever sends it."""
        seq = self.next_seq()
        choice = int(self.rng.integers(6))
        if choice == 0:
            header = self.pick([{"type": "credit", "n": -1, "unit": "trajectory"},
                                {"type": "credit", "n": 1, "unit": "bytes"},
                                {"type": "ack", "leases": "lease"}, {"type": "ack", "leases": [1]},
                                {"type": "nack", "leases": [], "reason": "x", "requeue": "yes"},
                                {"type": "hello", "consumer_id": ""}, {"type": "hello"},
                                {"type": "heartbeat", "seq": "one"}, {"type": "shutdown"}])
            header = {"v": 1, "seq": seq, **header}
            return Sent("field_kind", [msgpack.packb(header)],
                        [nack("schema", header["seq"] if type(header["seq"]) is int else None)])
        if choice == 1:
            frames = [msgpack.packb({"v": 1, "type": "heartbeat", "seq": seq}), self.random_bytes(0, 8)]
            return Sent("frame_extra", frames, [nack("schema", seq)])
        if choice == 2:  # arrays on a message that carries none, in any dtype
            header = {"v": 1, "type": "credit", "n": 1, "unit": "trajectory", "seq": seq,
                      "arrays": [["tokens", self.pick(OTHER_DTYPES), [1]]]}
            return Sent("arrays_listed", [msgpack.packb(header), bytes(4)], [nack("schema", seq)])
        if choice == 3:  # a well-formed heartbeat padded past max_message_bytes with a key nobody knows
            header = {"v": 1, "type": "heartbeat", "seq": seq, "padding": bytes(self.max_message_bytes)}
            return Sent("oversize", [msgpack.packb(header)], [nack("too_large", seq)])
        if choice == 4:
            kind, frames, expect = self.header_damage(self.wellformed())
            return Sent(kind, frames, [expect])
        return self.flipped("flipped_header", [msgpack.packb({"v": 1, "type": "heartbeat"})])

    def stranger(self) -> Sent:
        roll = self.rng.random()
        if roll < 0.15:
            return self.random_message()
        if roll < 0.3:
            return Sent("never_said_hello", (frames := self.wellformed()),
                        [nack("unknown_consumer", msgpack.unpackb(frames[0])["seq"])])
        if roll < 0.4:
            return self.flipped("flipped_header", self.wellformed())  # never a hello, so never welcome
        return self.rule_broken()

    def known(self) -> Sent:
        if self.rng.random() < 0.1:
            seq = self.next_seq()
            lease = self.name("lease")
            return Sent("stale_lease", [msgpack.packb({"v": 1, "type": "ack", "leases": [lease], "seq": seq})],
                        [nack("stale_lease", seq)])
        return self.rule_broken()


class AdminFuzz(Fuzz):
    """Admin-socket frames: every request gets exactly one reply, in order."""

    def unflippable(self) -> list:
        """A request no change of one byte makes acceptable: a `status` or a
        `requeue` without its ids (no other type has their lengths)."""
        return [msgpack.packb({"v": 1, "type": self.pick(["status", "requeue"])})]

    def valid(self) -> Sent:
        seq = self.next_seq()
        mtype, fields, reply = self.pick([("status", {}, "status"), ("dead_letters", {"limit": 5}, "dead_letters"),
                                          ("requeue", {"trajectory_ids": ["nobody"]}, "requeued")])
        return Sent("valid", [msgpack.packb({"v": 1, "type": mtype, "seq": seq, **fields})], [Expect(reply, seq)])

    def next(self) -> Sent:
        roll = self.rng.random()
        if roll < 0.1:
            return self.valid()
        if roll < 0.25:
            return self.random_message()
        if roll < 0.35:
            return self.flipped("flipped_header", self.unflippable())
        if roll < 0.5:
            kind, frames, expect = self.header_damage(self.valid().frames)
            return Sent(kind, frames, [expect])
        seq = self.next_seq()
        choice = int(self.rng.integers(5))
        if choice == 0:
            header = self.pick([{"type": "dead_letters", "limit": 0}, {"type": "dead_letters", "limit": "all"},
                                {"type": "requeue", "trajectory_ids": "t"}, {"type": "requeue", "trajectory_ids": [1]},
                                {"type": "requeue"}, {"type": "shutdown"}, {"type": 5}])
            return Sent("field_kind", [msgpack.packb({"v": 1, "seq": seq, **header})], [nack("schema", seq)])
        if choice == 1:
            frames = [msgpack.packb({"v": 1, "type": "status", "seq": seq}), self.random_bytes(0, 8)]
            return Sent("frame_extra", frames, [nack("schema", seq)])
        if choice == 2:
            header = {"v": 1, "type": "status", "seq": seq, "arrays": [["tokens", self.pick(OTHER_DTYPES), [1]]]}
            return Sent("arrays_listed", [msgpack.packb(header), bytes(4)], [nack("schema", seq)])
        if choice == 3:
            header = {"v": 1, "type": "status", "seq": seq, "padding": bytes(self.max_message_bytes)}
            return Sent("oversize", [msgpack.packb(header)], [nack("too_large", seq)])
        # A REQ peer's empty delimiter in front of a bad request: stripped, and put back on the reply.
        sent = self.pick([self.random_message, lambda: self.flipped("flipped_header", self.unflippable())])()
        return Sent("req_envelope_" + sent.kind, [b"", *sent.frames], sent.expects)


# -- talking to the broker ------------------------------------------------------
def peer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def receive(sock: zmq.Socket, wait_ms: int) -> tuple[dict, list]:
    """The next reply's header and frames (a REQ envelope stripped);
    TimeoutError when nothing came within `wait_ms`."""
    if not sock.poll(wait_ms):
        raise TimeoutError(f"no reply within {wait_ms} ms")
    frames = sock.recv_multipart()
    if len(frames) > 1 and frames[0] == b"":
        frames = frames[1:]
    return msgpack.unpackb(frames[0]), frames[1:]


def exchange(sock: zmq.Socket, chunk: list[Sent], wait_ms: int, codes: Counter | None = None) -> list[str]:
    """Send a chunk, then read its replies: on one connection the broker
    answers in the order it read (a batch by its messages' order). The
    problems found; the nack codes are counted into `codes`."""
    for sent in chunk:
        sock.send_multipart(sent.frames)
    problems = []
    for sent in chunk:
        for expect in sent.expects:
            reply = receive(sock, wait_ms)[0]
            if codes is not None and reply.get("type") == "nack":
                codes[reply.get("code")] += 1
            problem = expect.problem(reply)
            if problem:
                problems.append(f"{sent.kind}: {problem}")
    return problems


def unpack(header: dict, bufs: list) -> dict:
    """The arrays of a delivery, one frame per array or packed (protocol.md §2)."""
    if header.get("packed"):
        whole, bufs, start = bufs[0], [], 0
        for _, dtype, shape in header["arrays"]:
            end = start + np.dtype(NUMPY[dtype]).itemsize * int(np.prod(shape))
            bufs.append(whole[start:end])
            start = end
    return {name: np.frombuffer(buf, NUMPY[dtype]) for (name, dtype, _), buf in zip(header["arrays"], bufs)}


class Taker:
    """A raw consumer: takes deliveries, checks each against the trajectory
    sent (any of the `expected` records, which may grow), acks it, and keeps
    the replies that are neither. A broker that restarted no longer knows
    it (`unknown_consumer`): it says hello and grants its credit again."""

    CREDIT = 10_000
    HEARTBEAT_EVERY = 0.5  # seconds

    def __init__(self, endpoint: str, name: str, *expected: dict, wait_ms: int = 20_000):
        self.name, self.expected, self.wait_ms = name, ChainMap(*expected), wait_ms
        self.sock = peer(endpoint)
        self.delivered: Counter = Counter()  # deliveries by trajectory id, redeliveries included
        self.confirmed: set = set()  # trajectory ids whose ack the broker confirmed (`acked`)
        self.duplicates: list = []  # delivered again after that confirmation
        self.leases: dict = {}  # lease -> trajectory id, until confirmed
        self.others: list = []
        self.failures: list = []
        self.hellos = 0
        self._heard = time.monotonic()
        self.hello()

    def hello(self) -> None:
        self.hellos += 1
        self.sock.send_multipart([msgpack.packb({"v": 1, "type": "hello", "consumer_id": self.name,
                                                 "packed_arrays": True})])
        self.sock.send_multipart([msgpack.packb({"v": 1, "type": "credit", "n": self.CREDIT, "unit": "trajectory"})])

    def drain(self, wait_ms: int = 0) -> None:
        if time.monotonic() - self._heard > self.HEARTBEAT_EVERY:
            self.sock.send_multipart([msgpack.packb({"v": 1, "type": "heartbeat"})])
            self._heard = time.monotonic()
        taken = 0
        while self.sock.poll(wait_ms):
            wait_ms = 0
            header, bufs = receive(self.sock, 0)
            kind = header.get("type")
            if kind == "deliver":
                self.check(header, bufs)
                self.sock.send_multipart([msgpack.packb({"v": 1, "type": "ack", "leases": [header["lease"]]})])
                taken += 1
            elif kind == "acked":
                self.confirmed.update(self.leases.pop(lease) for lease in header["leases"])
            elif kind == "nack" and header.get("code") == "unknown_consumer":
                self.hello()
            elif kind != "welcome":
                self.others.append(header)
        if taken:
            self.sock.send_multipart([msgpack.packb({"v": 1, "type": "credit", "n": taken, "unit": "trajectory"})])

    def check(self, header: dict, bufs: list) -> None:
        tid = header["trajectory_id"]
        if tid in self.confirmed:
            self.duplicates.append(tid)
        self.delivered[tid] += 1
        self.leases[header["lease"]] = tid
        traj = self.expected.get(tid)
        if traj is None:
            self.failures.append(f"delivered {tid!r}, which no valid traffic sent")
            return
        if header.get("crc32") != zlib.crc32(b"".join(bufs)):
            self.failures.append(f"{tid}: crc32 of the delivery does not match its frames")
        arrays = unpack(header, bufs)
        for name in traj.arrays.keys() | arrays.keys():
            want, got = traj.arrays.get(name), arrays.get(name)
            if want is None or got is None or got.tobytes() != np.asarray(want, NUMPY[CONTRACT[name]]).tobytes():
                self.failures.append(f"{tid}: {name} delivered {got!r:.200}, sent {want!r:.200}")
        fields = (header["reward"], header["turns"], header["status"], header["response_length"])
        if fields != (traj.reward, traj.turns, "completed", len(traj.arrays["tokens"])):
            self.failures.append(f"{tid}: delivered reward, turns, status, length {fields}")

    def wait_for(self, tids, quiet_ms: int | None = None) -> None:
        """Deliveries until every one of `tids` came and was confirmed, or
        the broker sent nothing for `quiet_ms`."""
        quiet_ms = self.wait_ms if quiet_ms is None else quiet_ms
        heard = time.monotonic()
        while not set(tids) <= self.confirmed:
            # Polled a heartbeat interval at a time, with `drain` sending the heartbeats: a broker restarted just
            # before knows nothing of this consumer until one reaches it (and answers `unknown_consumer`).
            if self.sock.poll(int(self.HEARTBEAT_EVERY * 1000)):
                heard = time.monotonic()
            elif time.monotonic() - heard >= quiet_ms / 1000:
                return
            self.drain()
