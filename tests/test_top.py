"""`rollstream top`: the figures from hand-written status reports (no
sockets, no clock), the status fields they come from, one snapshot of a
real broker in a pipe, and the live view in a real terminal (tmux)."""
from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import types
import uuid
from pathlib import Path

import click
import pytest
from broker_helpers import drive, end_msg, turn_msg
from broker_process import BrokerProcess
from click.testing import CliRunner
from waiting import wait_for

from rollstream.app.top import COLUMNS, Latency, Poll, Refusal, Row, Target, Top, cells, find_targets, human_bytes, total
from rollstream.broker.core import BrokerCore
from rollstream.broker.metrics import BrokerMetrics
from rollstream.broker.recovery import Rebuilt
from rollstream.broker.settings import BrokerSettings
from rollstream.common.clock import Clock
from rollstream.common.codec import decode, encode
from rollstream.common.errors import InvalidInput
from rollstream.common.messages import BROKER_TO_CONSUMER, CONSUMER_TO_BROKER

BOUNDS = [0.001, 0.01, 0.1]


def report(counters: dict, acks: list[int], ack_sum: float, **fields) -> dict:
    """A status report as a broker sends it, with only what `top` reads."""
    return {"open": 1, "scoring": 5, "awaiting_group": 6, "ready": 2, "leased": 3, "dead": 4, "producers": 1, "consumers": 2,
            "bytes_in_memory": 1024, "bytes_on_disk": 3072, "unsealed_bytes": 1024, "max_memory_bytes": 4096,
            "max_disk_bytes": 8192,
            "counters": counters, "ack_seconds": {"bounds": BOUNDS, "counts": acks, "sum": ack_sum}, **fields}


FIRST = report({"frames.turn.applied": 10, "frames.end.applied": 2, "nacks.producer.unavailable": 2,
                "trajectories_acked": 1, "received_bytes": 1000}, [5, 0, 0, 0], 0.25)
SECOND = report({"frames.turn.applied": 40, "frames.end.applied": 8, "nacks.producer.unavailable": 4,
                 "nacks.consumer.stale_lease": 1, "trajectories_acked": 5, "received_bytes": 9000}, [95, 9, 1, 0], 0.75)


# -- the figures ---------------------------------------------------------------
def test_rates_latency_and_refusals_come_from_the_deltas_between_two_answers():
    top = Top()
    first = top.update("b", Poll(10.0, FIRST))
    assert (first.frames, first.trajectories_in, first.trajectories_out, first.bytes, first.latency) == (None,) * 5
    assert first.refusals == (Refusal("producer.unavailable", 2, 0, -math.inf),)
    row = top.update("b", Poll(12.0, SECOND))
    # frames: turns + ends + refused producer frames, (40 + 8 + 4) - (10 + 2 + 2) over 2 s
    assert (row.frames, row.trajectories_in, row.trajectories_out, row.bytes) == (19.0, 3.0, 2.0, 4000.0)
    assert row.queues == {"open": 1, "scoring": 5, "awaiting_group": 6, "ready": 2, "leased": 3, "dead": 4}
    assert (row.producers, row.consumers) == (1, 2)
    assert row.memory == (1024, 4096) and row.disk == (2048, 8192)  # disk: less the unsealed bytes (a budget of their own)
    assert row.latency == Latency((0.001, 0.01, 0.1), (90, 9, 1, 0), 0.5)
    assert row.latency.mean == 0.005 and row.latency.quantile(0.99) == 0.01 and row.latency.quantile(0.5) == 0.001
    assert row.refusals == (Refusal("producer.unavailable", 4, 2, 12.0), Refusal("consumer.stale_lease", 1, 1, 12.0))
    third = report({**SECOND["counters"], "nacks.consumer.stale_lease": 2}, [95, 9, 1, 0], 0.75)
    later = top.update("b", Poll(13.0, third))
    # the refusal that grew last comes first, though fewer; the other keeps when it last grew
    assert later.refusals == (Refusal("consumer.stale_lease", 2, 1, 13.0), Refusal("producer.unavailable", 4, 0, 12.0))
    assert later.frames == 0.0 and later.latency == Latency((0.001, 0.01, 0.1), (0, 0, 0, 0), 0.0)
    assert later.latency.mean is None and later.latency.quantile(0.99) is None


def test_a_restarted_broker_has_no_rates_until_its_second_answer():
    top = Top()
    top.update("b", Poll(10.0, SECOND))
    restarted = top.update("b", Poll(11.0, report({"frames.turn.applied": 3}, [1, 0, 0, 0], 0.0005)))
    assert (restarted.frames, restarted.bytes, restarted.latency) == (None, None, None)
    again = top.update("b", Poll(13.0, report({"frames.turn.applied": 7}, [3, 0, 0, 1], 3.0005)))
    assert again.frames == 2.0 and again.bytes == 0.0
    assert again.latency == Latency((0.001, 0.01, 0.1), (2, 0, 0, 1), 3.0) and again.latency.quantile(0.99) == math.inf


def test_an_unreachable_broker_shows_why_and_its_next_answer_rates_against_its_last():
    top = Top()
    top.update("b", Poll(10.0, FIRST))
    gone = top.update("b", Poll(11.0, error="no answer from the broker at ipc://x within 2.0 s"))
    assert gone == Row("b", error="no answer from the broker at ipc://x within 2.0 s")
    back = top.update("b", Poll(14.0, SECOND))
    assert back.frames == 38 / 4 and back.trajectories_out == 1.0


def test_the_total_sums_the_brokers_that_answered():
    top = Top()
    top.update("a", Poll(10.0, FIRST))
    a = top.update("a", Poll(12.0, SECOND))
    fresh = top.update("b", Poll(12.0, report({"nacks.producer.unavailable": 5}, [1, 0, 0, 0], 0.0005, ready=10)))
    top.update("e", Poll(10.0, report({}, [0, 0, 0, 0], 0.0)))
    idle = top.update("e", Poll(12.0, report({}, [0, 0, 1, 0], 0.05)))
    down = Row("c", error="no answer")
    whole = total([a, fresh, idle, down])
    assert whole.broker == "total (3 of 4 answering)"
    # b has no rates yet: the sums of a's and e's
    assert (whole.frames, whole.trajectories_in, whole.trajectories_out, whole.bytes) == (19.0, 3.0, 2.0, 4000.0)
    assert whole.queues == {"open": 3, "scoring": 15, "awaiting_group": 18, "ready": 14, "leased": 9, "dead": 12}
    assert (whole.producers, whole.consumers) == (3, 6)
    assert whole.memory == (3072, 12288) and whole.disk == (6144, 24576)
    assert whole.latency == Latency((0.001, 0.01, 0.1), (90, 9, 2, 0), 0.55)
    with pytest.raises(InvalidInput, match=r"add only with the same bounds, got \(0.001, 0.01, 0.1\) and \(1.0,\)"):
        whole.latency + Latency((1.0,), (0, 0), 0.0)
    assert whole.refusals == (Refusal("producer.unavailable", 9, 2, 12.0), Refusal("consumer.stale_lease", 1, 1, 12.0))
    older = Row("d", queues={}, memory=(100, None), disk=(100, None))  # a broker that reports no budgets
    assert total([a, older]).memory == (1124, None)
    assert total([down]) == Row("total (0 of 1 answering)", queues={"open": 0, "scoring": 0, "awaiting_group": 0, "ready": 0,
                                                                    "leased": 0, "dead": 0})


def test_cells_show_rates_budgets_latency_and_refusals_and_name_an_unreachable_broker():
    top = Top()
    top.update("b", Poll(10.0, FIRST))
    row = dict(zip(COLUMNS, cells(top.update("b", Poll(12.0, SECOND)))))
    assert row == {"broker": "b", "frames/s": "19.0", "traj in/s": "3.0", "traj out/s": "2.0", "in bytes/s": "3.9K/s",
                   "open": "1", "waiting": "11", "ready": "2", "leased": "3", "dead": "4",
                   "producers": "1", "consumers": "2",
                   "memory": "1.0K/4.0K 25%", "disk": "2.0K/8.0K 25%", "ack latency": "5ms p99<=10ms",
                   "refusals (latest first)": "producer.unavailable 4 (+2), consumer.stale_lease 1 (+1)"}
    first = dict(zip(COLUMNS, cells(Top().update("b", Poll(10.0, FIRST)))))
    assert first["frames/s"] == first["ack latency"] == "-" and first["refusals (latest first)"] == "producer.unavailable 2"
    slow = Row("b", latency=Latency((0.001, 0.01, 0.1), (0, 0, 0, 1), 3.0), refusals=tuple(
        Refusal(f"producer.c{i}", 1, 0, -math.inf) for i in range(5)))
    slow_cells = dict(zip(COLUMNS, cells(slow)))
    assert slow_cells["ack latency"] == "3s p99>100ms"
    assert slow_cells["refusals (latest first)"] == "producer.c0 1, producer.c1 1, producer.c2 1, +2 more"
    assert dict(zip(COLUMNS, cells(Row("older", memory=(100, None)))))["memory"] == "100B"  # no budget reported
    gone = cells(Row("ipc://x", error="no answer"))
    assert len(gone) == len(COLUMNS) and gone[:2] == ["ipc://x", "unreachable"] and gone[-1] == "no answer"


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 512, 1023, 1024, 50 * 1024, 336 * 1024, 2 << 30, 5 << 50)] == \
        ["0B", "512B", "1023B", "1.0K", "50.0K", "336K", "2.0G", "5120T"]


# -- the status fields top reads ---------------------------------------------
def test_the_status_report_carries_the_budgets_the_ack_latency_and_the_trajectories_acked():
    """The core's report, fed to `Top` as the admin reply carries it: a
    consumer's ack counts `trajectories_acked`, the rate out."""
    broker = BrokerCore(BrokerSettings(max_memory_bytes=1 << 20, max_disk_bytes=1 << 30), "b-1", BrokerMetrics(),
                        disk_reserve=0)
    broker.restore(Rebuilt([], (), {}, {}, {}), 0, 1 << 40)

    def at(t: float) -> Clock:
        return Clock(t, 1000.0 + t)

    def consumer(t: float, *messages) -> list:
        received = [(b"c", decode(encode(CONSUMER_TO_BROKER, kind, fields), CONSUMER_TO_BROKER), None)
                    for kind, fields in messages]
        asked = drive(broker.consumer_batch(received, at(t))) + drive(broker.deliver(at(t)))
        return [decode(r.frames, BROKER_TO_CONSUMER) for r in asked if getattr(r, "socket", None) == "consumer"]

    for tid in ("t", "u"):
        drive(broker.producer_batch([(b"p", turn_msg(tid, 0, seq=1), None), (b"p", end_msg(tid, seq=2), None)], at(0.0)))
    broker.metrics.ack_seconds.observe(0.003)  # the service's figure, once per producer batch
    top = Top()
    top.update("b", Poll(0.0, broker.status(at(0.0))))
    deliveries = consumer(1.0, ("hello", {"consumer_id": "c"}), ("credit", {"n": 2, "unit": "trajectory"}))[1:]
    consumer(1.0, ("ack", {"leases": [d["lease"] for d in deliveries]}))
    status = broker.status(at(2.0))
    assert status["max_memory_bytes"] == 1 << 20 and status["max_disk_bytes"] == 1 << 30
    assert status["ack_seconds"] == {"bounds": list(broker.metrics.ack_seconds.bounds),
                                     "counts": [0, 0, 0, 1, *[0] * 9], "sum": 0.003}
    assert status["counters"]["trajectories_acked"] == 2 == status["counters"]["trajectories.delivered"]
    row = top.update("b", Poll(2.0, status))
    assert row.trajectories_out == 1.0 and row.memory[1] == 1 << 20 and row.disk[1] == 1 << 30


# -- finding the brokers --------------------------------------------------------
def test_brokers_are_named_once_each_and_some_must_be_named():
    assert find_targets(["tcp://127.0.0.1:1", "tcp://127.0.0.1:1"], ["e.json"], None) == [
        Target("tcp://127.0.0.1:1", admin="tcp://127.0.0.1:1"), Target("e.json", endpoints_file="e.json")]
    with pytest.raises(click.UsageError, match="name the brokers to watch: --admin ENDPOINT, --endpoints-file FILE or "
                                                "--ray .*, got none"):
        find_targets([], [], None)


def test_ray_brokers_come_from_rollstream_ray_and_without_it_the_extra_is_named(monkeypatch):
    """--ray connects to the cluster unless connected, and names each
    node's broker; without Ray, the command says what to install."""
    calls = []
    brokers = types.ModuleType("rollstream.ray")
    brokers.connect = calls.append  # type: ignore[attr-defined]
    brokers.all_brokers = lambda: [types.SimpleNamespace(node_id="0123456789abcdef", admin="tcp://127.0.0.1:7")]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rollstream.ray", brokers)
    assert find_targets([], [], "auto") == [Target("0123456789ab tcp://127.0.0.1:7", admin="tcp://127.0.0.1:7")]
    assert calls == ["auto"], "--ray must join the cluster at --ray-address"
    monkeypatch.setitem(sys.modules, "rollstream.ray", None)  # as when the extra is not installed
    from rollstream.app.cli import main

    result = CliRunner().invoke(main, ["top", "--ray"])
    assert result.exit_code == 1 and "pip install 'rollstream[ray]'" in result.output, result.output


# -- a real broker ----------------------------------------------------------------
@pytest.fixture
def node():
    """A broker on ipc:// endpoints in a short directory, with an endpoints file, holding
    four ready trajectories from the synthetic producer daemon."""
    directory = Path(tempfile.mkdtemp(prefix="rtop", dir="/tmp"))
    broker = BrokerProcess(directory, endpoints_file=str(directory / "endpoints.json"), heartbeat_interval=0.2)
    try:
        broker.start()
        subprocess.run([sys.executable, "-m", "rollstream.app.cli", "producer", "--broker-endpoint", broker.producer,
                        "--source", "synthetic", "--trajectories", "4", "--turns", "2", "--vocab-size", "1000",
                        "--metrics-port", "0", "--log-level", "warning"], check=True, timeout=120)
        yield broker
    finally:
        broker.__exit__(None, None, None)
        shutil.rmtree(directory, ignore_errors=True)


def table_row(text: str, first_cell: str) -> dict[str, str]:
    """The cells of the table line whose first cell is `first_cell`, by column."""
    for line in text.splitlines():
        parts = [part.strip() for part in re.split(r"[│|]", line)]
        if len(parts) == len(COLUMNS) + 2 and parts[1] == first_cell:
            return dict(zip(COLUMNS, parts[1:-1]))
    raise AssertionError(f"no table row for {first_cell!r} in:\n{text}")


@pytest.mark.slow
def test_a_snapshot_in_a_pipe_shows_each_broker_and_an_unreachable_one(node):
    endpoints_file = node.flags["endpoints_file"]
    assert node._admin({"type": "nope"}, 5.0)["code"] == "schema"  # a refusal, counted nacks.admin.schema
    nobody = f"ipc://{node.directory}/nobody.sock"
    done = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "top", "--endpoints-file", endpoints_file,
                           "--admin", nobody, "--interval", "0.5", "--timeout", "0.5"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 0, done.stderr
    row = table_row(done.stdout, endpoints_file)
    # two polls: an idle window rates 0 (one poll alone would show "-")
    assert (row["frames/s"], row["traj in/s"], row["in bytes/s"]) == ("0.0", "0.0", "0B/s"), row
    assert [row[name] for name in ("open", "waiting", "ready", "leased", "dead", "consumers")] == \
        ["0", "0", "4", "0", "0", "0"], row
    assert row["memory"].endswith("/2.0G 0%") and row["disk"].endswith("/64.0G 0%"), row
    assert row["refusals (latest first)"] == "admin.schema 1", row
    down = table_row(done.stdout, nobody)
    assert down["frames/s"] == "unreachable" and "no answer from the broker" in down["refusals (latest first)"], down
    assert table_row(done.stdout, "total (1 of 2 answering)")["ready"] == "4"
    report = node.status()  # what the service adds: bytes read and one ack latency per producer batch
    assert report["counters"]["received_bytes"] > 0 and sum(report["ack_seconds"]["counts"]) >= 1, report


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="the live view is tested in a tmux terminal; tmux is not on PATH")
def test_the_live_view_shows_a_running_demo_and_quits_on_q_restoring_the_terminal(tmp_path):
    """`rollstream demo --endpoints-file` in the background, `rollstream top`
    on that file in a real terminal (tmux): the demo's broker with its
    trainer's consumer; `q` quits, exit status 0, the terminal as it was."""
    out = Path(tempfile.mkdtemp(prefix="rtop", dir="/tmp"))  # short: tmux's socket path lives here
    endpoints_file = str(out / "demo-endpoints.json")
    socket = f"rollstream-top-test-{uuid.uuid4().hex[:12]}"
    # The pane's size is the terminal's: no COLUMNS or LINES from whoever runs the tests (rich would take them, and
    # readline sets them); the server's socket in `out`, removed with it.
    env = {**{key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}, "TMUX_TMPDIR": str(out)}

    def tmux(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", socket, "-f", "/dev/null", *args], capture_output=True, text=True, timeout=30,
                              env=env)

    with open(tmp_path / "demo.log", "wb") as log:
        demo = subprocess.Popen([sys.executable, "-m", "rollstream.app.cli", "demo", "--producers", "1", "--dp-size", "1",
                                 "--endpoints-file", endpoints_file], stdout=log, stderr=subprocess.STDOUT)
    top = shlex.join([sys.executable, "-m", "rollstream.app.cli", "top", "--endpoints-file", endpoints_file,
                      "--interval", "0.3"])
    # after top: its exit status and the terminal's settings, as the shell sees them
    shell = f"{top}; echo $? > {out}/top.status; stty -a > {out}/stty.txt"
    try:
        wait_for(lambda: os.path.exists(endpoints_file), timeout=60, what="the demo's broker to write its endpoints")
        started = tmux("new-session", "-d", "-x", "200", "-y", "50", "-c", os.getcwd(), "sh", "-c", shell)
        assert started.returncode == 0, started.stderr
        screens = []  # what the pane showed, for the error if the table never comes

        def trainer_shown() -> str:
            screens.append(tmux("capture-pane", "-p").stdout)
            shown = endpoints_file in screens[-1] and "total (1 of 1" in screens[-1]
            return screens[-1] if shown and table_row(screens[-1], endpoints_file)["consumers"] == "1" else ""

        try:
            screen = wait_for(trainer_shown, timeout=60, what="the demo's broker with its trainer in top's table")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the pane showed last:\n{screens[-1] if screens else ''}") from None
        row = table_row(screen, endpoints_file)
        assert "/2.0G" in row["memory"], screen  # the demo broker's memory budget
        assert tmux("send-keys", "q").returncode == 0
        status = wait_for(lambda: (out / "top.status").exists() and (out / "top.status").read_text().strip(),
                          timeout=30, what="top to exit after q")
        assert status == "0"
        settings = wait_for(lambda: (out / "stty.txt").exists() and (out / "stty.txt").read_text(), what="stty's output")
        assert re.search(r"(?<!-)\bicanon\b", settings) and re.search(r"(?<!-)\becho\b", settings), settings
        wait_for(lambda: tmux("has-session").returncode != 0, timeout=30, what="the pane to close")
        assert demo.wait(240) == 0, (tmp_path / "demo.log").read_text()[-3000:]
        assert not os.path.exists(endpoints_file), "the demo's broker must remove its endpoints file when it stops"
    finally:
        tmux("kill-server")
        if demo.poll() is None:  # an interrupt, so the demo stops its daemons on the way out
            demo.send_signal(signal.SIGINT)
            demo.wait(60)
        shutil.rmtree(out, ignore_errors=True)
