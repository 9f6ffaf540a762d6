"""The producer's disk spool: records, recovery, torn tails, corruption,
ownership, the byte budget and compaction. Record layout is read back here
independently (struct + zlib), not through the spool's own parser."""
import os
import struct
import subprocess
import sys
import zlib

import pytest
from test_segments import cached, dropping  # noqa: F401, F811 (a fixture)

from rollstream.common.segments import WRITE_BEHIND
from rollstream.producer.spool import Spool, SpoolError, record_bytes


def frames(seq, size=10):
    return [b"header-%d" % seq, bytes([seq % 256]) * size]


def open_spool(path, producer_id="p0", max_bytes=1 << 20, **options):
    return Spool(path, producer_id, max_bytes=max_bytes, **options)


def backlog(spool):
    out = []
    while (item := spool.next_backlog()) is not None:
        out.append(item)
    return out


def segments(path):
    return sorted(p for p in os.listdir(path) if p.startswith("seg-") and p.endswith(".log"))


def test_records_are_magic_length_crc_framed_wire_frames(tmp_path):
    spool = open_spool(tmp_path)
    spool.append(7, [b"abc", b"\x00\x01"], handed_out=True)
    data = (tmp_path / segments(tmp_path)[0]).read_bytes()
    magic, length, crc = struct.unpack_from("<III", data)
    payload = data[12 : 12 + length]
    assert magic == 0x52534731 and zlib.crc32(payload) == crc
    assert payload == b"F" + struct.pack("<QI", 7, 2) + struct.pack("<I", 3) + b"abc" + struct.pack("<I", 2) + b"\x00\x01"
    assert len(data) == 12 + length == record_bytes([b"abc", b"\x00\x01"])
    spool.close()


def test_a_restart_resends_exactly_the_unsettled_frames_in_order(tmp_path):
    """A process that dies without closing (os._exit) leaves a spool the next
    one opens, resending what was never settled."""
    child = (
        "import os, sys\n"
        "from rollstream.producer.spool import Spool\n"
        "spool = Spool(sys.argv[1], 'p0', max_bytes=1 << 20)\n"
        "for seq in range(1, 7):\n"
        "    spool.append(seq, [b'header-%d' % seq, bytes([seq]) * 10], handed_out=True)\n"
        "for seq in (1, 3, 4):\n"
        "    spool.settle(seq)\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", child, str(tmp_path)], check=True, timeout=60)
    again = open_spool(tmp_path)
    assert again.last_seq == 6 and again.backlog == 3
    assert backlog(again) == [(seq, frames(seq)) for seq in (2, 5, 6)]
    again.close()


def test_frames_beyond_the_window_are_read_back_in_order(tmp_path):
    spool = open_spool(tmp_path)
    spool.append(1, frames(1), handed_out=True)
    for seq in (2, 3, 4):
        spool.append(seq, frames(seq), handed_out=False)
    spool.settle(1)
    assert spool.backlog == 3
    assert spool.next_backlog() == (2, frames(2))
    spool.settle(2)
    assert backlog(spool) == [(3, frames(3)), (4, frames(4))]
    assert spool.backlog == 0
    spool.append(5, frames(5), handed_out=False)
    with pytest.raises(ValueError, match="ahead of 1 older"):
        spool.append(6, frames(6), handed_out=True)
    spool.close()


def test_a_torn_final_record_is_cut_off(tmp_path):
    spool = open_spool(tmp_path)
    for seq in (1, 2):
        spool.append(seq, frames(seq), handed_out=True)
    spool.close()
    path = tmp_path / segments(tmp_path)[0]
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # the last write was cut short
    again = open_spool(tmp_path)
    assert backlog(again) == [(1, frames(1))]
    assert path.stat().st_size == record_bytes(frames(1))
    again.append(2, frames(2), handed_out=True)  # appending continues after the cut
    again.close()


def test_a_bad_record_before_the_end_is_corruption(tmp_path):
    spool = open_spool(tmp_path)
    for seq in (1, 2):
        spool.append(seq, frames(seq), handed_out=True)
    spool.close()
    path = tmp_path / segments(tmp_path)[0]
    data = bytearray(path.read_bytes())
    data[12] ^= 0xFF  # inside the first record's payload
    path.write_bytes(bytes(data))
    with pytest.raises(SpoolError, match=r"segment file seg-00000001.log, record at offset 12: CRC mismatch: "
                                         r"header says \d+, payload gives \d+"):
        open_spool(tmp_path)


def test_a_spool_belongs_to_one_producer_and_one_live_process(tmp_path):
    spool = open_spool(tmp_path, "p0")
    with pytest.raises(SpoolError, match="in use by another live producer"):
        open_spool(tmp_path, "p0")
    spool.append(1, frames(1), handed_out=True)
    spool.close()
    with pytest.raises(SpoolError, match="belongs to producer 'p0', not 'p1'"):
        open_spool(tmp_path, "p1")


def test_the_budget_counts_bytes_on_disk(tmp_path):
    one = record_bytes(frames(1))
    spool = open_spool(tmp_path, max_bytes=3 * one)
    for seq in (1, 2):
        spool.append(seq, frames(seq), handed_out=True)
    assert spool.fits(frames(3))
    spool.append(3, frames(3), handed_out=True)
    assert not spool.fits(frames(4))
    assert spool.nbytes == 3 * one
    with pytest.raises(ValueError, match=r"exceeds spool_bytes=\d+"):
        spool.append(4, frames(4, size=10 * one), handed_out=True)
    spool.close()


def test_settled_segments_are_deleted_oldest_first(tmp_path):
    one = record_bytes(frames(1))
    spool = open_spool(tmp_path, segment_bytes=2 * one)
    for seq in range(1, 7):
        spool.append(seq, frames(seq), handed_out=True)
    assert len(segments(tmp_path)) == 3  # three full segments: the next write starts a fourth
    spool.settle(3)
    spool.settle(4)  # the second segment is settled but the first is not: kept (oldest first)
    assert len(segments(tmp_path)) >= 3
    spool.settle(1)
    spool.settle(2)
    remaining = segments(tmp_path)
    assert "seg-00000001.log" not in remaining and "seg-00000002.log" not in remaining
    assert spool.nbytes == sum((tmp_path / name).stat().st_size for name in remaining)
    spool.close()
    again = open_spool(tmp_path)
    assert backlog(again) == [(5, frames(5)), (6, frames(6))]
    again.close()


def test_a_clean_close_with_nothing_unsettled_leaves_no_segments(tmp_path):
    spool = open_spool(tmp_path)
    spool.append(1, frames(1), handed_out=True)
    spool.settle(1)
    spool.close()
    assert segments(tmp_path) == []
    assert open_spool(tmp_path).last_seq == 0


def test_seqs_must_increase(tmp_path):
    spool = open_spool(tmp_path)
    spool.append(3, frames(3), handed_out=True)
    with pytest.raises(ValueError, match="must increase: got 3 after 3"):
        spool.append(3, frames(3), handed_out=True)
    spool.close()


def test_a_backlog_stays_in_the_page_cache_to_be_read_back(dropping):  # noqa: F811 (the fixture)
    """The spool is not written behind (the broker's store is): three
    windows of backlog on, written out, the first frames are still cached."""
    spool = open_spool(dropping, max_bytes=64 * WRITE_BEHIND)
    size = WRITE_BEHIND // 4
    for seq in range(1, 13):
        spool.append(seq, frames(seq, size), handed_out=False)
    os.sync()
    assert cached(dropping / segments(dropping)[0], 0)
    assert spool.next_backlog() == (1, frames(1, size))
    spool.close()
