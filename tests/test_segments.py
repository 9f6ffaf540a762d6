"""The shared segment log (`rollstream.common.segments`): records round
trip, damage is refused naming file and offset, a torn tail is cut at the
end a scan finds, segments rotate; and the owners refuse old formats."""
import ctypes
import ctypes.util
import os
import struct
import zlib

import pytest

from rollstream.common import segments
from rollstream.common.segments import HEADER, MAGIC, RESERVE_AHEAD, WRITE_BEHIND, SegmentDamaged, SegmentLog


def opened(path, max_bytes=1 << 20, **options):
    log = SegmentLog(path, max_bytes, **options)
    log.open_current(0)
    return log


def test_records_round_trip_and_verify(tmp_path):
    log = opened(tmp_path)
    locations = log.append([([b"abc", b"de"], None), ([b"x" * 100], zlib.crc32(b"x" * 100)), ([], None)])
    assert locations == [(1, 12, 5), (1, 29, 100), (1, 141, 0)]
    assert [bytes(p) for p in log.read_many(locations[::-1])] == [b"", b"x" * 100, b"abcde"]
    log.verify(locations)
    data = log.path(1).read_bytes()
    assert struct.unpack_from("<III", data) == (MAGIC, 5, zlib.crc32(b"abcde"))
    assert log.bytes_on_disk() == len(data) == 3 * HEADER.size + 105
    log.close()


def test_a_flipped_byte_is_refused_naming_file_and_offset(tmp_path):
    log = opened(tmp_path)
    locations = log.append([([b"first"], None), ([b"second"], None)])
    log.close()
    path = log.path(1)
    data = bytearray(path.read_bytes())
    data[locations[1][1] + 2] ^= 0xFF
    path.write_bytes(bytes(data))
    message = r"segment file seg-00000001.log, record at offset 29: CRC mismatch: header says \d+, payload gives \d+"
    with pytest.raises(SegmentDamaged, match=message):
        log.read_many([locations[1]])
    with pytest.raises(SegmentDamaged, match=message):
        log.verify(locations)
    scan = log.scan(1)
    assert [loc for loc, _ in scan.records] == [locations[0]] and scan.torn  # the last record: could be a torn write
    data[locations[1][1] - HEADER.size] ^= 0xFF  # and its magic
    path.write_bytes(bytes(data))
    scan = log.scan(1)
    assert not scan.torn and scan.damage == (f"segment file seg-00000001.log, record at offset 29: bad magic "
                                             f"{MAGIC ^ 0xFF:#010x}, expected {MAGIC:#010x}")


def test_damage_before_the_last_record_is_not_torn(tmp_path):
    log = opened(tmp_path)
    locations = log.append([([b"first"], None), ([b"second"], None)])
    log.close()
    data = bytearray(log.path(1).read_bytes())
    data[locations[0][1]] ^= 0xFF
    log.path(1).write_bytes(bytes(data))
    scan = log.scan(1)
    assert scan.records == [] and scan.end == 0 and not scan.torn
    assert scan.damage is not None and scan.damage.startswith("segment file seg-00000001.log, record at offset 12: CRC")


@pytest.mark.parametrize("cut", [1, 5, 14])  # into the payload, and into the header
def test_a_torn_tail_is_cut_at_the_end_a_scan_finds(tmp_path, cut):
    log = opened(tmp_path)
    kept, torn = log.append([([b"kept"], None), ([b"torn record"], None)])
    log.close()
    path = log.path(1)
    path.write_bytes(path.read_bytes()[:-cut])
    again = SegmentLog(tmp_path, 1 << 20)
    scan = again.scan(again.current)
    assert scan.torn and [loc for loc, _ in scan.records] == [kept] and scan.end == kept[1] + kept[2]
    again.open_current(scan.end)
    assert path.stat().st_size == scan.end
    (after,) = again.append([([b"after"], None)])
    assert bytes(again.read_many([after])[0]) == b"after" and after[1] == scan.end + HEADER.size
    assert again.scan(1).damage is None
    again.close()


def test_segments_rotate_at_max_bytes_and_are_removed(tmp_path):
    log = opened(tmp_path, max_bytes=40)
    first = log.append([([b"a" * 20], None), ([b"b" * 20], None)])  # one append never splits: both in segment 1
    assert {loc[0] for loc in first} == {1}
    (second,) = log.append([([b"c" * 10], None)])
    assert second[0] == 2 and log.existing() == [1, 2]
    assert log.bytes_on_disk() == sum(log.path(n).stat().st_size for n in (1, 2))
    log.remove(1)
    assert log.existing() == [2] and log.bytes_on_disk() == log.path(2).stat().st_size
    mark = log.mark
    log.append([([b"d" * 10], None)])
    log.rewind(mark)
    assert log.path(2).stat().st_size == mark[1]
    log.close()
    assert SegmentLog(tmp_path, 40).current == 2  # reopened, appends continue in the newest


def allocated(path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.fixture
def reserving(tmp_path):
    """Skip unless the file system reserves blocks past a file's end
    (`fallocate` keeping the size), asked here without the module."""
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        call = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).fallocate
        call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        if call(fd, 1, 0, 1 << 20) != 0 or allocated(probe) < 1 << 20:
            pytest.skip("this file system does not reserve blocks past a file's end")
    except (OSError, AttributeError):
        pytest.skip("no fallocate(2) here")
    finally:
        os.close(fd)
        probe.unlink()
    return tmp_path / "log"


def test_appends_go_into_blocks_reserved_ahead_that_a_finished_segment_gives_back(reserving):
    log = opened(reserving, max_bytes=4 * RESERVE_AHEAD)
    log.append([([b"a" * 1000], None)])
    first = log.path(1)
    assert first.stat().st_size == HEADER.size + 1000  # the size is the records' end: scans stop there
    assert allocated(first) >= RESERVE_AHEAD
    log.append([([b"b" * (RESERVE_AHEAD + 10)], None)])  # past what was reserved: reserved again, up to its end
    assert allocated(first) >= first.stat().st_size
    log.rotate()
    assert allocated(first) < first.stat().st_size + (1 << 16), "a finished segment keeps its reserved blocks"
    log.append([([b"c" * 10], None)])
    mark = log.mark
    log.append([([b"d" * 10], None)])
    log.rewind(mark)
    second = log.path(2)
    assert second.stat().st_size == mark[1] and allocated(second) < 1 << 16
    log.append([([b"e" * 10], None)])
    assert allocated(second) >= RESERVE_AHEAD
    log.close()
    assert allocated(second) < 1 << 16


@pytest.mark.parametrize("max_bytes", [1 << 20, 4 * RESERVE_AHEAD])
def test_a_reservation_takes_at_most_reserve_step_beyond_the_records_it_is_made_for(reserving, max_bytes):
    """What a broker's free-space estimate counts on (`Store.unseen_growth`):
    the blocks a reservation takes past the records' end are never more
    than `reserve_step`, the smaller of `RESERVE_AHEAD` and the segment size."""
    log = opened(reserving, max_bytes=max_bytes)
    assert log.reserve_step == min(RESERVE_AHEAD, max_bytes)
    for record in (b"a" * 1000, b"b" * (max_bytes // 3), b"c" * max_bytes, b"d" * 1000):  # the last one starts segment 2
        log.append([([record], None)])
        path = log.path(log.current)
        assert allocated(path) - path.stat().st_size <= log.reserve_step + 4096  # a block's rounding
    assert log.current == 2 and allocated(path) - path.stat().st_size >= log.reserve_step - 4096
    log.close()


def cached(path, offset: int) -> bool:
    """Whether the page at `offset` is in the page cache: a read that may
    not wait for the disk fails otherwise."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def dropping(tmp_path):
    """Skip unless this file system drops a written-out file's pages from the
    page cache when asked (tmpfs keeps them), and reads say so."""
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT reads here")
    probe = tmp_path / "probe"
    probe.write_bytes(b"p" * (1 << 16))
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if cached(probe, 0):
        pytest.skip("this file system keeps written-out pages cached when told they are not needed")
    probe.unlink()
    return tmp_path / "log"


@pytest.mark.skipif(segments._SYNC_FILE_RANGE is None, reason="no sync_file_range(2) here")
def test_appends_are_written_behind_and_dropped_from_the_page_cache_a_window_at_a_time(dropping):
    """Three windows in, the first leaves the page cache (written out by
    then: the test syncs, as the disk would have by itself) and the last
    stays; every record still reads back, and after a rewind below what was
    dropped the windows start again from there."""
    log = opened(dropping, max_bytes=8 * WRITE_BEHIND, write_behind=True)
    quarter = WRITE_BEHIND // 4

    def append(times: int, byte: bytes, sync_after: int) -> list:
        out = []
        for i in range(times):
            out += log.append([([byte * quarter], None)])
            if i == sync_after:
                os.fsync(log._fd)  # what was written so far is on disk, so its pages are clean
        return out

    locations = append(12, b"w", sync_after=8)  # windows close near 8, 16 and 24 MiB; the third drops the first
    first = log.path(1)
    assert not cached(first, 0), "the first window is still in the page cache"
    assert cached(first, log.size - 1), "the window being written was dropped too soon"
    assert [bytes(p) for p in log.read_many(locations)] == [b"w" * quarter] * 12
    mark = (1, locations[1][1] + locations[1][2])  # the end of the second record, in the dropped window
    log.rewind(mark)
    more = append(12, b"x", sync_after=6)  # windows close again 8, 16 and 24 MiB on from the mark
    assert not cached(first, mark[1] + 4096), "appends after the rewind were not written behind"
    assert [bytes(p) for p in log.read_many(locations[:2] + more)] == [b"w" * quarter] * 2 + [b"x" * quarter] * 12
    log.close()
    scan = SegmentLog(dropping, 8 * WRITE_BEHIND).scan(1)
    assert [loc for loc, _ in scan.records] == locations[:2] + more and scan.damage is None


def test_a_log_not_asked_to_write_behind_keeps_what_it_wrote_cached(dropping):
    """The same appends and sync as above, without write-behind: the first
    window is still in the page cache."""
    log = opened(dropping, max_bytes=8 * WRITE_BEHIND)
    for i in range(12):
        log.append([([b"w" * (WRITE_BEHIND // 4)], None)])
        if i == 8:
            os.fsync(log._fd)
    assert cached(log.path(1), 0)
    log.close()


def test_a_segment_left_with_blocks_reserved_reopens_to_its_records(reserving):
    """A crash leaves the reservation past the end: a scan sees only records."""
    log = opened(reserving)
    locations = log.append([([b"first"], None), ([b"second"], None)])
    os.close(log._fd)  # no `close`: nothing given back
    reopened = SegmentLog(reserving, 1 << 20)
    scan = reopened.scan(1)
    assert [loc for loc, _ in scan.records] == locations and scan.damage is None and not scan.torn
    reopened.open_current(scan.end)
    assert [bytes(p) for p in reopened.read_many(locations)] == [b"first", b"second"]
    reopened.close()
    assert allocated(reopened.path(1)) < 1 << 16


def test_an_old_spool_is_refused_naming_file_and_formats(tmp_path):
    from rollstream.producer.spool import Spool, SpoolError

    (tmp_path / "0000000000000000.seg").write_bytes(struct.pack("<II", 0, 0))
    with pytest.raises(SpoolError, match=r"0000000000000000.seg is a spool file of format 1 \(NNNNNNNNNNNNNNNN.seg .*\), "
                                         r"this producer reads format 2 \(seg-NNNNNNNN.log .*\); spools are transient"):
        Spool(tmp_path, "p0", max_bytes=1 << 20)
    (tmp_path / "0000000000000000.seg").unlink()
    Spool(tmp_path, "p0", max_bytes=1 << 20).close()  # the lock was released with the refusal


def test_an_old_store_is_refused_naming_the_versions(tmp_path):
    from rollstream.broker.store import Store, StoreCorrupted

    store = Store(tmp_path / "data")
    store.open()
    store.db.execute("UPDATE meta SET value=1 WHERE key='schema_version'")
    store.close()
    with pytest.raises(StoreCorrupted, match="has schema version 1, this broker reads 2 or 3 or 4"):
        Store(tmp_path / "data").open()
