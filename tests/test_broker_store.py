"""The durable store and recovery, without sockets: what was committed comes
back exactly; torn tails are cut; corruption is reported, never half-loaded;
a failed write persists nothing."""
import os
import sqlite3
import struct

import msgpack
import numpy as np
import pytest
from broker_helpers import abort_msg, end_msg, handle_with_store, turn_msg

from rollstream.broker.engine import DeliveryUnit, EngineSettings, MergeEngine
from rollstream.broker.recovery import load_trajectory, rebuild
from rollstream.broker.staleness import Policy
from rollstream.broker.store import Store, StoreCorrupted, StoreError
from rollstream.common.trajectory import Gap


def drive(engine, store, messages, wall=1.0):
    for message in messages:
        reply = engine.handle(message, wall)
        assert reply.error is None, reply.error
        store.commit(list(reply.effects))


def reopen(path, **kw):
    store = Store(path, **kw)
    engine = MergeEngine(EngineSettings())
    units = engine.restore(*rebuild(store.open(), store).engine_state())
    return store, engine, units


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "data")
    s.open()
    yield s
    s.close()


def scenario():
    """Open, ended, gapped, aborted and grouped trajectories."""
    return [
        turn_msg("open", 0, [10, 11], [[10, 1], [11]], forced=[20]),
        turn_msg("open", 1, [12], [[12, 3]]),
        turn_msg("done", 0, [5], [[5]], forced=[6]),
        end_msg("done", reward={"acc": 1.0}, metadata={"k": "v"}),
        turn_msg("gap", 0, [7], [[7, 8]], forced=[9]),
        turn_msg("gap", 1, [1], None),
        end_msg("gap", reward=0.0, seq=101),
        turn_msg("gone", 0),
        abort_msg("gone"),
        turn_msg("g0", 0, group=("G", 2)),
        turn_msg("g1", 0, group=("G", 2)),
        end_msg("g0", seq=102),
        abort_msg("g1", seq=202),
    ]


def test_everything_comes_back_exactly(tmp_path, store):
    engine = MergeEngine(EngineSettings())
    drive(engine, store, scenario())
    store.close()
    store2, engine2, units = reopen(tmp_path / "data")
    assert set(engine2.entries) == {"open", "done", "gap", "g0", "g1"}
    original = engine.entries["open"].trajectory
    restored = engine2.entries["open"].trajectory
    assert restored.mask == original.mask and restored.tokens.tolist() == original.tokens.tolist()
    assert engine2.entries["open"].outcomes == engine.entries["open"].outcomes
    assert units == [DeliveryUnit(("done",)), DeliveryUnit(("gap",)), DeliveryUnit(("g0",), "G", 2, 1)]
    done = load_trajectory(store2, store2.load_one("done"))
    assert done.reward == {"acc": 1.0} and done.metadata == {"k": "v"} and done.tokens.tolist() == [5, 6]
    gap = load_trajectory(store2, store2.load_one("gap"))
    assert gap.tokens.tolist() == [7] and (gap.gap.turn, gap.gap.field) == (1, "mask")
    # duplicates are still recognised after the restart
    reply = handle_with_store(engine2, store2, turn_msg("open", 1, [12], [[12, 3]], seq=50), wall=2)
    assert reply.fields["duplicate"] is True
    # compared with the stored record: an applied turn's row keeps no digest of its own
    assert store2.db.execute("SELECT digest FROM turns WHERE trajectory_id='open' AND turn=1").fetchone()[0] == b""
    assert handle_with_store(engine2, store2, turn_msg("open", 1, [12], [[12, 4]], seq=51), wall=2).error.code == "conflict"
    # and the open trajectory continues where it was
    reply = engine2.handle(turn_msg("open", 2, [13], [[13]]), wall=2)
    assert reply.fields["applied"] and engine2.entries["open"].trajectory.response_length == 5
    store2.close()


def test_dedup_and_dead_letters_survive(tmp_path, store):
    engine = MergeEngine(EngineSettings(trajectory_ttl=10, dedup_window=100))
    drive(engine, store, [turn_msg("a", 0), end_msg("a"), turn_msg("b", 0)])
    store.commit(engine.delivered("a", wall=5))
    store.commit(engine.expire(wall=50))
    store.close()
    store2, engine2, units = reopen(tmp_path / "data")
    assert units == [] and engine2.dedup == {"a": 105.0, "b": 150.0}
    assert engine2.dead_letters(10) == [{"trajectory_id": "b", "reason": "expired", "at": 50.0}]
    store2.close()


def test_a_revived_member_of_a_closed_group_is_ready_after_a_restart(tmp_path, store):
    engine = MergeEngine(EngineSettings())
    drive(engine, store, [turn_msg("a", 0, group=("G", 2)), turn_msg("b", 0, group=("G", 2)),
                          end_msg("a"), end_msg("b", seq=101)])
    store.commit(engine.delivered("a", wall=2))
    store.commit(engine.dead_letter("b", "refused", wall=2))  # the group closes
    store.commit(engine.revive("b", wall=3))
    store.close()
    store2, engine2, units = reopen(tmp_path / "data")
    assert units == [DeliveryUnit(("b",), "G", 2, 1)] and engine2.awaiting_group() == 0
    store2.close()


def test_torn_tail_is_cut(tmp_path, store):
    engine = MergeEngine(EngineSettings())
    drive(engine, store, [turn_msg("a", 0, [1, 2], [[1], [2]])])
    segment = store.segments.path(store.segments.current)
    committed = segment.stat().st_size
    store.close()
    with open(segment, "ab") as f:
        f.write(b"half a record that never committed")
    store2, engine2, _ = reopen(tmp_path / "data")
    assert segment.stat().st_size == committed
    assert engine2.entries["a"].trajectory.tokens.tolist() == [1, 2]
    store2.close()


def test_corrupted_record_is_detected(tmp_path, store):
    engine = MergeEngine(EngineSettings())
    drive(engine, store, [turn_msg("a", 0, [1, 2], [[1], [2]])])
    segment = store.segments.path(store.segments.current)
    store.close()
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(StoreCorrupted, match="CRC mismatch"):
        Store(tmp_path / "data").open()


def test_missing_segment_is_detected(tmp_path, store):
    drive(MergeEngine(EngineSettings()), store, [turn_msg("a", 0)])
    store.close()
    for path in (tmp_path / "data" / "segments").glob("*.log"):
        path.unlink()
    with pytest.raises(StoreCorrupted, match="missing"):
        Store(tmp_path / "data").open()


def test_corrupted_database_is_detected(tmp_path, store):
    drive(MergeEngine(EngineSettings()), store, [turn_msg("a", 0)])
    store.close()
    db = tmp_path / "data" / "state.sqlite"
    for suffix in ("-wal", "-shm"):
        (tmp_path / "data" / f"state.sqlite{suffix}").unlink(missing_ok=True)
    db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreCorrupted):
        Store(tmp_path / "data").open()


def test_failed_segment_write_persists_nothing(tmp_path, store, monkeypatch):
    engine = MergeEngine(EngineSettings())
    drive(engine, store, [turn_msg("a", 0)])
    size = store.segments.size

    def disk_full(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", disk_full)
    reply = engine.handle(turn_msg("b", 0), wall=2)
    with pytest.raises(StoreError, match="No space left"):
        store.commit(list(reply.effects))
    monkeypatch.undo()
    assert store.segments.size == size
    store.close()
    store2, engine2, _ = reopen(tmp_path / "data")
    assert set(engine2.entries) == {"a"}
    store2.close()


def test_failed_database_commit_persists_nothing(tmp_path, store, monkeypatch):
    engine = MergeEngine(EngineSettings())
    drive(engine, store, [turn_msg("a", 0)])
    segment = store.segments.path(store.segments.current)
    size = segment.stat().st_size
    class FailingOnTurns:
        """The connection, failing the turn rows: after the new trajectory's row went in."""

        def __init__(self, db):
            self.db = db

        def __getattr__(self, name):
            return getattr(self.db, name)

        def executemany(self, statement, rows):
            if statement.startswith("INSERT INTO turns"):
                raise sqlite3.OperationalError("database or disk is full")
            return self.db.executemany(statement, rows)

    monkeypatch.setattr(store, "db", FailingOnTurns(store.db))
    with pytest.raises(StoreError, match="disk is full"):
        store.commit(list(engine.handle(turn_msg("b", 0), wall=2).effects))
    monkeypatch.undo()
    assert segment.stat().st_size == size
    store.close()
    store2, engine2, _ = reopen(tmp_path / "data")
    assert set(engine2.entries) == {"a"}
    store2.close()


def test_segments_rotate_and_finished_ones_are_deleted(tmp_path):
    store = Store(tmp_path / "data", segment_bytes=4096)
    store.open()
    engine = MergeEngine(EngineSettings())
    big = list(range(1, 600))
    for i in range(4):
        drive(engine, store, [turn_msg(f"t{i}", 0, big, [[t] for t in big]), end_msg(f"t{i}", seq=100 + i)])
    assert len(list((tmp_path / "data" / "segments").glob("*.log"))) >= 3
    first = store.segments.path(1)
    assert first.exists()
    store.commit(engine.delivered("t0", wall=5))
    store.wait_writes()  # segment files are unlinked on the writer thread
    assert not first.exists()
    on_disk = sum(p.stat().st_size for p in (tmp_path / "data" / "segments").glob("*.log"))
    assert store.segments.bytes_on_disk() == on_disk  # kept up to date without listing the directory
    store.close()
    store2, engine2, units = reopen(tmp_path / "data", segment_bytes=4096)
    assert store2.segments.bytes_on_disk() == on_disk
    assert [u.trajectory_ids for u in units] == [("t1",), ("t2",), ("t3",)]
    assert load_trajectory(store2, store2.load_one("t3")).tokens.tolist() == big
    store2.close()


def test_trajectories_delivered_together_are_forgotten_in_one_commit(tmp_path, monkeypatch):
    monkeypatch.setattr("rollstream.broker.store._IN_CHUNK", 2)  # several `IN` queries
    store = Store(tmp_path / "data", segment_bytes=4096)
    store.open()
    engine = MergeEngine(EngineSettings(dedup_window=100))
    big = list(range(1, 600))  # a segment per trajectory or so
    for i in range(5):
        drive(engine, store, [turn_msg(f"t{i}", 0, big, [[t] for t in big]), turn_msg(f"t{i}", 1, [7], [[7]]),
                              end_msg(f"t{i}", seq=100 + i)])
    segments = tmp_path / "data" / "segments"
    before = sorted(p.name for p in segments.glob("*.log"))
    store.commit([e for i in range(4) for e in engine.delivered(f"t{i}", wall=5)])
    store.wait_writes()
    after = sorted(p.name for p in segments.glob("*.log"))
    kept = {n for (n,) in store.db.execute("SELECT segment FROM turns")} | {store.segments.current}
    assert after == sorted(store.segments.path(n).name for n in kept) and len(after) < len(before)
    assert store.db.execute("SELECT COUNT(*) FROM turns").fetchone()[0] == 2  # t4's two turns
    store.close()
    store2, engine2, units = reopen(tmp_path / "data", segment_bytes=4096)
    assert set(engine2.entries) == {"t4"} and [u.trajectory_ids for u in units] == [("t4",)]
    assert engine2.dedup == {f"t{i}": 105.0 for i in range(4)}
    assert load_trajectory(store2, store2.load_one("t4")).tokens.tolist() == [*big, 7]
    store2.close()


def test_full_sync_mode_commits(tmp_path):
    store = Store(tmp_path / "data", sync="full")
    store.open()
    drive(MergeEngine(EngineSettings()), store, [turn_msg("a", 0, [3], [[3]])])
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    store.close()
    with pytest.raises(ValueError, match="sync"):
        Store(tmp_path / "x", sync="sometimes")


def test_probe_reports_while_writes_fail(tmp_path, store, monkeypatch):
    store.probe()

    def broken(fd, buffers):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "writev", broken)
    with pytest.raises(StoreError, match="Input/output"):
        store.probe()


def test_replay_arrays_survive(tmp_path, store):
    engine = MergeEngine(EngineSettings())
    experts = np.arange(24, dtype=np.int32).reshape(4, 3, 2)
    drive(engine, store, [turn_msg("a", 0, [1], routed_experts=experts), end_msg("a")])
    store.close()
    store2, engine2, _ = reopen(tmp_path / "data")
    traj = load_trajectory(store2, store2.load_one("a"))
    assert np.array_equal(traj.routed_experts, experts)
    store2.close()


def test_full_log_probs_and_a_gap_at_them_survive_a_restart(tmp_path, store):
    """Read back from the turn records (as an evicted or restarted
    trajectory is): every value byte for byte, 0.0 at the forced token, and
    a turn without them cut as a replay gap naming them."""
    engine = MergeEngine(EngineSettings())
    full = np.array([-0.25, -1.5], np.float32)
    drive(engine, store, [turn_msg("a", 0, [1, 2], forced=[3], full_log_probs=full),
                          turn_msg("a", 1, [4], full_log_probs=[-0.125]), end_msg("a"),
                          turn_msg("b", 0, [1], forced=[7], full_log_probs=[-0.5]), turn_msg("b", 1, [2]),
                          end_msg("b", seq=101)])
    store.close()
    store2, _, _ = reopen(tmp_path / "data")
    a = load_trajectory(store2, store2.load_one("a"))
    assert a.full_log_probs.tobytes() == np.array([-0.25, -1.5, 0.0, -0.125], np.float32).tobytes()
    b = load_trajectory(store2, store2.load_one("b"))
    assert b.gap == Gap(1, "full_log_probs") and b.tokens.tolist() == [1] and b.full_log_probs.tolist() == [-0.5]
    store2.close()


def test_mask_log_probs_and_a_gap_at_them_survive_a_restart(tmp_path, store):
    """Read back from the turn records: every support id's log-prob byte for
    byte beside its id, 0.0 at a forced token's singleton, a turn that said
    them renormalised read back as any other, and a turn without them cut
    as a replay gap naming them."""
    engine = MergeEngine(EngineSettings())
    half = float(np.log(np.float32(0.5)))
    drive(engine, store, [turn_msg("a", 0, [1, 2], [[1, 5], [2]], forced=[3], mask_log_probs=[-0.25, -1.5, -0.0625]),
                          turn_msg("a", 1, [4], [[4, 6]], mask_log_probs=[half, half], mask_log_probs_normalized=True),
                          end_msg("a"),
                          turn_msg("b", 0, [1], [[1, 9]], forced=[7], mask_log_probs=[-0.5, -1.0]),
                          turn_msg("b", 1, [2], [[2]]), end_msg("b", seq=101)])
    store.close()
    store2, _, _ = reopen(tmp_path / "data")
    a = load_trajectory(store2, store2.load_one("a"))
    assert a.mask.ids.tolist() == [1, 5, 2, 3, 4, 6]
    assert a.mask_log_probs.tobytes() == np.array([-0.25, -1.5, -0.0625, 0.0, half, half], np.float32).tobytes()
    b = load_trajectory(store2, store2.load_one("b"))
    assert b.gap == Gap(1, "mask_log_probs") and b.tokens.tolist() == [1]
    assert b.mask.ids.tolist() == [1, 9] and b.mask_log_probs.tolist() == [-0.5, -1.0]
    store2.close()


def test_a_version_12_store_is_upgraded_and_its_trajectories_go_on_beside_ones_with_mask_log_probs(tmp_path, store):
    """A store a version 12 broker wrote (no record of it can hold
    `mask_log_probs`) opens as version 13 with its trajectories whole: one
    open there goes on without them, and one started after the upgrade
    carries them across the next restart."""
    engine = MergeEngine(EngineSettings())
    drive(engine, store, [turn_msg("old", 0, [1], [[1, 5]], forced=[3], full_log_probs=[-0.5])])
    store.db.execute("UPDATE meta SET value=12 WHERE key='schema_version'")
    store.close()
    store2, engine2, _ = reopen(tmp_path / "data")
    assert store2.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == 13
    drive(engine2, store2, [turn_msg("old", 1, [2], [[2]], full_log_probs=[-0.25]), end_msg("old"),
                            turn_msg("new", 0, [4], [[4, 8]], mask_log_probs=[-0.125, -2.25]), end_msg("new", seq=101)])
    store2.close()
    store3, _, _ = reopen(tmp_path / "data")
    old = load_trajectory(store3, store3.load_one("old"))
    assert old.gap is None and old.tokens.tolist() == [1, 3, 2] and old.mask_log_probs is None
    assert old.full_log_probs.tolist() == [-0.5, 0.0, -0.25] and not old.carries("mask_log_probs")
    new = load_trajectory(store3, store3.load_one("new"))
    assert new.mask_log_probs.tolist() == [-0.125, -2.25] and new.carries("mask_log_probs")
    store3.close()


@pytest.mark.parametrize("version", [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
def test_an_older_store_opens_and_becomes_the_current_version_with_its_ends_checked(tmp_path, version):
    store = Store(tmp_path / "data")
    store.open()
    drive(MergeEngine(), store, [turn_msg("t", 0, weight_version="step-3"), end_msg("t", reward=0.25, metadata={"k": 1})])
    if version < 11:
        store.db.execute("ALTER TABLE trajectories DROP COLUMN producer_key")  # as versions 2-10 stored it
    if version < 10:
        store.db.execute("DROP TABLE archive_segments")  # as versions 2-9 stored it
    if version < 9:
        store.db.execute("DROP INDEX trajectories_archiving")  # as versions 2-8 stored it
        for column in ("producer", "first_delivered_at", "deliveries", "committed_at", "archive_file", "trained_epoch"):
            store.db.execute(f"ALTER TABLE trajectories DROP COLUMN {column}")
    if version < 8:
        for column in ("dead_reason", "dead_at"):  # as versions 2-7 stored it
            store.db.execute(f"ALTER TABLE dedup DROP COLUMN {column}")
    store.db.execute("INSERT INTO dedup (id, until) VALUES ('gone', 5000.0)")
    if version < 7:
        store.db.execute("ALTER TABLE trajectories DROP COLUMN sampled")  # as versions 2-6 stored it
        store.db.execute("DROP TABLE policies")
    if version == 6:  # its policies had no lineage
        store.db.execute("CREATE TABLE policies (job TEXT PRIMARY KEY, version INTEGER NOT NULL, max_staleness INTEGER, "
                         "per_step INTEGER, share REAL) WITHOUT ROWID")
        store.db.execute("INSERT INTO policies VALUES ('default', 4, 1, 8, 1.0)")
    elif version < 6:
        store.db.execute("ALTER TABLE trajectories DROP COLUMN version")  # as versions 2-5 stored it
    if version < 5:
        for column in ("trained_run", "trained_lineage", "trained_step", "trained_position"):  # as versions 2-4 stored it
            store.db.execute(f"ALTER TABLE trajectories DROP COLUMN {column}")
        store.db.execute("DROP TABLE runs")
    if version < 4:
        store.db.execute("ALTER TABLE trajectories DROP COLUMN end_crc")  # as versions 2 and 3 stored it
    store.db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (version,))
    store.close()
    store = Store(tmp_path / "data")
    recovered = store.open()
    (ended,) = recovered.trajectories
    assert (ended.reward, ended.metadata, ended.trained, ended.sampled) == (0.25, {"k": 1}, None,
                                                                             ((0, 3),) if version >= 7 else ())
    assert ended.version == (3 if version >= 6 else None)
    assert recovered.policies == ({"default": Policy(4, 1, 8, 1.0)} if version == 6 else {})
    assert recovered.dedup == {"gone": 5000.0} and recovered.pruned == {}
    assert (ended.producer, ended.first_delivered_at, ended.deliveries, ended.archive_file) == (None, None, 0, None)
    assert store.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == 13
    assert ended.producer_key is None
    assert store.db.execute("SELECT COUNT(*) FROM archive_segments").fetchone()[0] == 0, "the table is made"
    store.db.execute("UPDATE trajectories SET reward=? WHERE id='t'", (msgpack.packb(0.75),))
    store.db.execute("UPDATE meta SET value=1 WHERE key='schema_version'")
    store.close()
    with pytest.raises(StoreCorrupted, match="schema version 1, this broker reads 2 or 3 or 4 .* or 10 or 11 or 12 or 13$"):
        Store(tmp_path / "data").open()
    store = Store(tmp_path / "data")
    store.db.execute("UPDATE meta SET value=6 WHERE key='schema_version'")
    with pytest.raises(StoreCorrupted, match="trajectories row 't': CRC mismatch over its end"):
        store.open()


def test_an_ended_trajectory_keeps_its_oldest_turns_version_across_a_restart(tmp_path, store):
    engine = MergeEngine(EngineSettings())
    drive(engine, store, [turn_msg("a", 0, [1], weight_version="step-7"), turn_msg("a", 1, [2], weight_version="5"),
                          end_msg("a", turns=2), turn_msg("b", 0, [1], weight_version="opaque"), end_msg("b")])
    assert (engine.entries["a"].version, engine.entries["b"].version) == (5, None)
    store.close()
    _, engine2, _ = reopen(tmp_path / "data")
    assert (engine2.entries["a"].version, engine2.entries["b"].version) == (5, None)


def test_a_received_crc_makes_the_record_crc_without_a_second_pass(tmp_path, store, monkeypatch):
    """A turn that arrived with a verified `crc32`: its record's CRC is
    derived from it (the array frames are not read again), and equals
    zlib's CRC of the record as written."""
    import zlib

    from rollstream.common.codec import decode
    from rollstream.common.messages import PRODUCER_TO_BROKER
    from rollstream.common.trajectory import Turn
    from rollstream.common.wire import encode_turn

    turn = Turn.build(list(range(1, 300)), [-0.5] * 299, supports=[[t, t + 1] for t in range(1, 300)])
    message = decode(encode_turn("a", 0, turn, seq=0, prompt_tokens=np.array([1, 2], np.int32), crc=True),
                     PRODUCER_TO_BROKER)
    assert message.crc32 == zlib.crc32(b"".join(bytes(memoryview(f)) for f in message.frames[1:]))
    read = []
    monkeypatch.setattr("rollstream.common.codec._crc32_update", lambda buf, crc=0: read.append(len(buf)) or zlib.crc32(buf, crc))
    engine = MergeEngine(EngineSettings())
    drive(engine, store, [message])
    assert max(read) < 1000  # only the frame table and header were read for the CRC, not the 4.8 KB of arrays
    monkeypatch.undo()
    seg, off, length = store.db.execute("SELECT segment, offset, length FROM turns").fetchone()
    data = store.segments.path(seg).read_bytes()
    magic, stored_length, crc = struct.unpack_from("<III", data, off - 12)
    assert stored_length == length and crc == zlib.crc32(data[off:off + length])
    store.close()
    store2, engine2, _ = reopen(tmp_path / "data")  # verifies every record's CRC
    assert engine2.entries["a"].trajectory.tokens.tolist() == list(range(1, 300))
    store2.close()


def test_a_turn_that_arrived_with_a_split_array_is_stored_and_read_back_whole(tmp_path, store):
    from rollstream.common.codec import decode, encode
    from rollstream.common.messages import PRODUCER_TO_BROKER

    ids = [np.array([10, 4], np.int32), np.array([11, 12, 3], np.int32)]  # two frames for one array
    frames = encode(PRODUCER_TO_BROKER, "turn", {"seq": 0, "trajectory_id": "a", "turn": 0, "status": "completed"},
                    {"prompt_tokens": np.array([1], np.int32), "tokens": np.array([10, 11, 12], np.int32),
                     "log_probs": np.full(3, -0.5, np.float32), "mask_ids": ids,
                     "mask_offsets": np.array([0, 2, 3, 5], np.int64)}, crc=True)
    drive(MergeEngine(EngineSettings()), store, [decode(frames, PRODUCER_TO_BROKER)])
    store.close()
    store2, engine2, _ = reopen(tmp_path / "data")  # replays the stored frames as they arrived
    arrays = engine2.entries["a"].trajectory.arrays()
    assert arrays["mask_ids"].tolist() == [10, 4, 11, 12, 3] and arrays["tokens"].tolist() == [10, 11, 12]
    store2.close()


def test_stored_content_is_not_checked_again_on_recovery(tmp_path, store):
    """A turn an older broker took under a looser log-prob rule (+0.5) comes
    back as stored: recovery replays what was committed, and the consumer's
    batch validation is what refuses it (docs/semantics.md)."""
    from rollstream.common.codec import decode, encode
    from rollstream.common.messages import PRODUCER_TO_BROKER

    frames = encode(PRODUCER_TO_BROKER, "turn", {"seq": 0, "trajectory_id": "a", "turn": 0, "status": "completed"},
                    {"prompt_tokens": np.array([1], np.int32), "tokens": np.array([10, 11], np.int32),
                     "log_probs": np.array([-0.5, 0.5], np.float32)})
    drive(MergeEngine(EngineSettings()), store, [decode(frames, PRODUCER_TO_BROKER, check_content=False)])
    store.close()
    store2, engine2, _ = reopen(tmp_path / "data")
    assert engine2.entries["a"].trajectory.log_probs.tolist() == [-0.5, 0.5]
    store2.close()


# -- writes ahead ---------------------------------------------------------------
def _record_bytes(message) -> int:
    """A turn's record as written: the 12-byte record header, the frame
    table (count, then one length per frame) and the frames."""
    return 12 + 2 + 4 * len(message.frames) + sum(map(len, message.frames))


def test_turns_written_ahead_are_put_once_and_a_refused_one_stays_unreferenced(tmp_path):
    store = Store(tmp_path / "data", write_ahead_from=1)  # every turn goes to the writer
    store.open()
    engine = MergeEngine(EngineSettings())
    refused, kept = turn_msg("refused", 0, [7, 8]), turn_msg("kept", 0, [5, 6, 9], [[5], [6, 1], [9]])
    start = store.segments.size
    store.write_ahead(refused)
    store.write_ahead(kept)
    assert store.writing_ahead
    store.commit(list(engine.handle(kept, wall=1).effects))  # the refused turn is never handled
    assert not store.writing_ahead
    assert store.segments.size == start + _record_bytes(refused) + _record_bytes(kept)  # each written once
    assert store.db.execute("SELECT trajectory_id FROM turns").fetchall() == [("kept",)]
    store.close()
    store2, engine2, _ = reopen(tmp_path / "data")  # verifies the record the row points at
    assert set(engine2.entries) == {"kept"}
    assert engine2.entries["kept"].trajectory.tokens.tolist() == [5, 6, 9]
    store2.close()


def test_a_write_ahead_runs_on_the_writer_thread_and_the_commit_waits_for_it(tmp_path, monkeypatch):
    import threading

    from rollstream.broker.store import Segments

    store = Store(tmp_path / "data", write_ahead_from=1)
    store.open()
    entered, release, threads = threading.Event(), threading.Event(), []
    real_append = Segments.append

    def held_append(self, records):
        threads.append(threading.current_thread())
        entered.set()
        assert release.wait(10)
        return real_append(self, records)

    monkeypatch.setattr(Segments, "append", held_append)
    message = turn_msg("a", 0, [5, 6])
    store.write_ahead(message)  # returns while the write is still held
    assert entered.wait(10) and threads[0] is not threading.current_thread()
    effects = list(MergeEngine(EngineSettings()).handle(message, wall=1).effects)
    committing = threading.Thread(target=store.commit, args=(effects,))
    committing.start()
    committing.join(0.3)
    assert committing.is_alive()  # waiting for the write: no row may refer to an unwritten record
    release.set()
    committing.join(10)
    assert store.db.execute("SELECT count(*) FROM turns").fetchone() == (1,)
    assert len(threads) == 1  # the commit did not write the turn a second time
    store.close()


def test_small_turns_are_written_inline_by_their_commit(tmp_path, monkeypatch):
    import threading

    from rollstream.broker.store import Segments

    store = Store(tmp_path / "data")  # the default threshold: far above a small turn
    store.open()
    threads = []
    real_append = Segments.append
    monkeypatch.setattr(Segments, "append", lambda self, records: threads.append(threading.current_thread())
                        or real_append(self, records))
    engine = MergeEngine(EngineSettings())
    messages = [turn_msg("a", 0, [5]), turn_msg("b", 0, [6])]
    for message in messages:
        store.write_ahead(message)
    store.commit([e for m in messages for e in engine.handle(m, wall=1).effects])
    assert threads == [threading.current_thread()]  # one append, by the commit itself
    assert store.db.execute("SELECT count(*) FROM turns").fetchone() == (2,)
    store.close()


def test_a_failed_write_ahead_fails_the_commit_and_persists_nothing(tmp_path, monkeypatch):
    store = Store(tmp_path / "data", write_ahead_from=1)
    store.open()
    engine = MergeEngine(EngineSettings())
    drive(engine, store, [turn_msg("a", 0)])
    size = store.segments.size
    calls = []

    def disk_full_on_second(fd, buffers):  # the first write ahead lands, the second fails
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_writev(fd, buffers)

    real_writev = os.writev
    monkeypatch.setattr(os, "writev", disk_full_on_second)
    messages = [turn_msg("b", 0, [5]), turn_msg("c", 0, [6])]
    for message in messages:
        store.write_ahead(message)
    with pytest.raises(StoreError, match="No space left"):
        store.commit([e for m in messages for e in engine.handle(m, wall=2).effects])
    monkeypatch.undo()
    assert store.segments.size == size  # the write that landed was cut too
    assert not store.writing_ahead
    store.close()
    store2, engine2, _ = reopen(tmp_path / "data")
    assert set(engine2.entries) == {"a"}
    store2.close()


def test_a_segment_of_refused_turns_only_is_deleted_once_finished(tmp_path):
    store = Store(tmp_path / "data", segment_bytes=2048, write_ahead_from=1)
    store.open()
    engine = MergeEngine(EngineSettings())
    big = list(range(1, 200))
    for i in range(3):  # each record is over 2 KB: one segment per write ahead
        store.write_ahead(turn_msg(f"refused{i}", 0, big))
    store.commit([])  # nothing of the batch was accepted
    drive(engine, store, [turn_msg("kept", 0, big)])
    store.wait_writes()  # segment files are unlinked on the writer thread
    segments = sorted(p.name for p in (tmp_path / "data" / "segments").glob("*.log"))
    assert segments == [store.segments.path(store.segments.current).name]  # the three refused ones are gone
    store.close()
    store2, engine2, _ = reopen(tmp_path / "data", segment_bytes=2048)
    assert set(engine2.entries) == {"kept"}
    store2.close()


def test_a_row_with_a_state_no_trajectory_can_have_is_reported(tmp_path, store):
    engine = MergeEngine(EngineSettings())
    drive(engine, store, scenario())
    store.close()
    with sqlite3.connect(tmp_path / "data" / "state.sqlite") as db:
        db.execute("UPDATE trajectories SET state='finished' WHERE id='done'")
    with pytest.raises(StoreCorrupted, match=r"row 'done': state must be one of "
                                             r"\['archiving', 'dead', 'ended', 'left', 'open', 'scoring', 'trained'\], "
                                             r"got 'finished'"):
        reopen(tmp_path / "data")


def test_the_growth_the_store_leaves_unseen_is_the_next_reservation_and_the_wals_room(tmp_path, store):
    """What the free space told to the disk admission leaves out
    (`StoreIO.measure_disk`): the blocks the next segment reservation takes
    ahead of its records, and what the WAL may still grow by before SQLite
    checkpoints it, which shrinks as it grows and comes back once it is
    truncated."""
    wal = store.db_path.with_name(store.db_path.name + "-wal")
    full = 32 + 1000 * (24 + 4096)  # SQLite's defaults: a checkpoint at 1000 frames of 4 KiB pages

    def room() -> int:
        return store.unseen_growth() - store.segments.reserve_step

    store.checkpoint()
    assert wal.stat().st_size == 0 and room() == full
    drive(MergeEngine(EngineSettings()), store, [turn_msg("t", 0), end_msg("t")])
    assert 0 < wal.stat().st_size < full and room() == full - wal.stat().st_size
