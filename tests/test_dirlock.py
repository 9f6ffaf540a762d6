"""One live owner per directory (`rollstream.common.dirlock`): a second
broker on a data directory a first one holds refuses to start and names the
first's pid, as `rollstream salvage` does; the lock goes with its holder,
however it dies. The producer's spool takes the same lock."""
import os
import re
import subprocess
import sys

import pytest
from broker_process import BrokerProcess

from rollstream.broker.store import Store
from rollstream.common.dirlock import DirectoryHeld, hold
from rollstream.common.errors import InvalidState
from rollstream.producer.spool import Spool, SpoolError


def test_a_held_directory_refuses_a_second_holder_naming_the_first(tmp_path):
    fd = hold(tmp_path / "d")
    named = rf"directory {re.escape(str(tmp_path / 'd'))} is held by another process \(pid {os.getpid()}\)"
    with pytest.raises(DirectoryHeld, match=named) as refused:
        hold(tmp_path / "d")
    assert refused.value.holder == os.getpid() and isinstance(refused.value, InvalidState)
    os.close(fd)
    os.close(hold(tmp_path / "d"))  # free again once its holder lets go


def test_a_holder_that_wrote_no_pid_is_named_as_another_process(tmp_path):
    import fcntl

    (tmp_path / "LOCK").write_text("")
    fd = os.open(tmp_path / "LOCK", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    with pytest.raises(DirectoryHeld, match="held by another process") as refused:
        hold(tmp_path)
    assert refused.value.holder is None
    os.close(fd)


def test_a_store_holds_its_data_directory_until_it_is_closed(tmp_path):
    first = Store(tmp_path / "data")
    first.open()
    with pytest.raises(DirectoryHeld, match=rf"data directory .* is held by another broker \(pid {os.getpid()}\)"):
        Store(tmp_path / "data")
    first.close()
    Store(tmp_path / "data").close()


def test_a_spool_names_the_producer_that_holds_it(tmp_path):
    spool = Spool(tmp_path / "spool", "p", max_bytes=1 << 20)
    with pytest.raises(SpoolError, match=rf"in use by another live producer \(pid {os.getpid()}\)"):
        Spool(tmp_path / "spool", "p", max_bytes=1 << 20)
    spool.close()


@pytest.mark.slow
def test_a_second_broker_on_a_held_data_directory_refuses_naming_the_first(tmp_path):
    with BrokerProcess(tmp_path / "first") as first:
        second = BrokerProcess(tmp_path / "second")
        second.directory.mkdir()  # where its ipc endpoints go: their folder must exist
        second.data_dir = first.data_dir
        done = subprocess.run(second.command(), capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert f"refusing to start: data directory {first.data_dir} is held by another broker (pid {first.pid})" \
            in done.stderr, done.stderr
        salvage = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "salvage", "--data-dir", str(first.data_dir)],
                                 capture_output=True, text=True, timeout=60)
        assert salvage.returncode != 0 and f"(pid {first.pid})" in salvage.stderr, salvage.stderr
        first.status()  # the first never noticed
        first.kill()  # a crash: the kernel lets the lock go with the process
        with second:
            assert second.status()["open"] == 0
