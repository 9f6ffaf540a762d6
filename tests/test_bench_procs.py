"""bench/procs.py's whole-process times, which the bench scripts' CPU
figures (bench/scale.py's `support_4096_gbps`) are made of: every thread,
user and system time, and the minor faults of fresh memory."""
import importlib.util
import mmap
import os
import threading
import time
from pathlib import Path

spec = importlib.util.spec_from_file_location("procs", Path(__file__).resolve().parents[1] / "bench" / "procs.py")
assert spec is not None and spec.loader is not None
procs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(procs)


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_process_times_count_every_thread_not_only_the_main_one():
    before = procs.process_times(os.getpid())
    worker = threading.Thread(target=_spin, args=(0.3,))
    worker.start()
    worker.join()
    spent = procs.process_times(os.getpid()) - before
    assert spent.cpu >= 0.2, f"a thread's 0.3 s of CPU must count in the whole process's; counted {spent.cpu:.2f} s"
    assert spent.cpu == spent.user + spent.system


def test_process_times_count_the_faults_of_fresh_memory():
    size = 16 << 20
    before = procs.process_times(os.getpid())
    with mmap.mmap(-1, size) as fresh:
        for page in range(0, size, mmap.PAGESIZE):
            fresh[page] = 1
    faults = (procs.process_times(os.getpid()) - before).minor_faults
    assert faults >= size // (2 << 20), f"touching 16 MiB of fresh memory faults at least once per 2 MiB; got {faults}"
