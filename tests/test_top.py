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
from typing import Callable, TypeVar

import click
import pytest
from broker_helpers import drive, end_msg, turn_msg
from broker_process import BrokerProcess
from click.testing import CliRunner
from rich.console import Console
from waiting import wait_for

from rollstream.app.top import (
    COLUMNS,
    FIRST_NEEDED,
    PRIORITY,
    Latency,
    Poll,
    Refusal,
    Row,
    Target,
    Top,
    cells,
    compact,
    find_targets,
    fold,
    human_bytes,
    layout,
    table,
    total,
)
from rollstream.broker.core import BrokerCore
from rollstream.broker.metrics import BrokerMetrics
from rollstream.broker.recovery import Rebuilt
from rollstream.broker.settings import BrokerSettings
from rollstream.common.clock import Clock
from rollstream.common.codec import decode, encode
from rollstream.common.errors import InvalidInput
from rollstream.common.messages import BROKER_TO_CONSUMER, CONSUMER_TO_BROKER

BOUNDS = [0.001, 0.01, 0.1]
T = TypeVar("T")


def report(counters: dict, acks: list[int], ack_sum: float, **fields) -> dict:
    """A status report as a broker sends it, with only what `top` reads."""
    return {"open": 1, "scoring": 5, "awaiting_group": 6, "queued": 2, "leased": 3, "dead": 4, "producers": 1, "consumers": 2,
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
    assert row.queues == {"open": 1, "scoring": 5, "awaiting_group": 6, "queued": 2, "leased": 3, "dead": 4}
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
    fresh = top.update("b", Poll(12.0, report({"nacks.producer.unavailable": 5}, [1, 0, 0, 0], 0.0005, queued=10)))
    top.update("e", Poll(10.0, report({}, [0, 0, 0, 0], 0.0)))
    idle = top.update("e", Poll(12.0, report({}, [0, 0, 1, 0], 0.05)))
    down = Row("c", error="no answer")
    whole = total([a, fresh, idle, down])
    assert whole.broker == "total (3 of 4 answering)"
    # b has no rates yet: the sums of a's and e's
    assert (whole.frames, whole.trajectories_in, whole.trajectories_out, whole.bytes) == (19.0, 3.0, 2.0, 4000.0)
    assert whole.queues == {"open": 3, "scoring": 15, "awaiting_group": 18, "queued": 14, "leased": 9, "dead": 12}
    assert (whole.producers, whole.consumers) == (3, 6)
    assert whole.memory == (3072, 12288) and whole.disk == (6144, 24576)
    assert whole.latency == Latency((0.001, 0.01, 0.1), (90, 9, 2, 0), 0.55)
    with pytest.raises(InvalidInput, match=r"add only with the same bounds, got \(0.001, 0.01, 0.1\) and \(1.0,\)"):
        whole.latency + Latency((1.0,), (0, 0), 0.0)
    assert whole.refusals == (Refusal("producer.unavailable", 9, 2, 12.0), Refusal("consumer.stale_lease", 1, 1, 12.0))
    older = Row("d", queues={}, memory=(100, None), disk=(100, None))  # a broker that reports no budgets
    assert total([a, older]).memory == (1124, None)
    assert total([down]) == Row("total (0 of 1 answering)", queues={"open": 0, "scoring": 0, "awaiting_group": 0, "queued": 0,
                                                                    "leased": 0, "dead": 0})


def test_cells_show_rates_budgets_latency_and_refusals_and_name_an_unreachable_broker():
    top = Top()
    top.update("b", Poll(10.0, FIRST))
    row = top.update("b", Poll(12.0, SECOND))
    assert cells(row) == {"broker": "b", "frames/s": "19.0", "traj in/s": "3.0", "traj out/s": "2.0",
                          "in bytes/s": "3.9K/s", "open": "1", "waiting": "11", "queued": "2", "leased": "3", "dead": "4",
                          "producers": "1", "consumers": "2", "memory": "1.0K/4.0K 25%", "disk": "2.0K/8.0K 25%",
                          "ack latency": "5ms p99<=10ms",
                          "refusals (latest first)": "producer.unavailable 4 (+2), consumer.stale_lease 1 (+1)",
                          "producer restarts": "-"}
    restarted = Row("b", resumed={"listed": 14, "continued": 12, "restarted": 1, "aborted": 0})
    assert cells(restarted)["producer restarts"] == "12 continued, 1 restarted, 0 aborted"
    assert cells(restarted, brief=True)["producer restarts"] == "12/1/0"
    assert total([restarted, restarted, Row("c", resumed=None)]).resumed == {"continued": 24, "restarted": 2, "aborted": 0}
    # a narrow terminal's: budgets as a share, the p99 alone, a refusal a line
    assert cells(row, brief=True) == cells(row) | {
        "memory": "25%", "disk": "25%", "ack latency": "<=10ms",
        "refusals (latest first)": "producer.unavailable 4 (+2)\nconsumer.stale_lease 1 (+1)"}
    first = cells(Top().update("b", Poll(10.0, FIRST)))
    assert first["frames/s"] == first["ack latency"] == "-" and first["refusals (latest first)"] == "producer.unavailable 2"
    slow = Row("b", latency=Latency((0.001, 0.01, 0.1), (0, 0, 0, 1), 3.0), refusals=tuple(
        Refusal(f"producer.c{i}", 1, 0, -math.inf) for i in range(5)))
    assert cells(slow)["ack latency"] == "3s p99>100ms" and cells(slow, brief=True)["ack latency"] == ">100ms"
    assert cells(slow)["refusals (latest first)"] == "producer.c0 1, producer.c1 1, producer.c2 1, +2 more"
    assert cells(slow, brief=True)["refusals (latest first)"] == "producer.c0 1\nproducer.c1 1\nproducer.c2 1\n+2 more"
    for brief in (False, True):  # no budget reported: the bytes alone
        assert cells(Row("older", memory=(100, None)), brief)["memory"] == "100B"
    gone = Row("ipc://x", error="no answer")
    assert cells(gone) == {**{column.name: "-" for column in COLUMNS}, "broker": "ipc://x",
                           "refusals (latest first)": "unreachable: no answer"}
    assert cells(gone, brief=True)["refusals (latest first)"] == "unreachable"


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 512, 1023, 1024, 50 * 1024, 336 * 1024, 2 << 30, 5 << 50)] == \
        ["0B", "512B", "1023B", "1.0K", "50.0K", "336K", "2.0G", "5120T"]


def test_rates_take_four_characters_at_most():
    values = (0, 0.04, 3, 19.04, 99.94, 99.96, 150, 999.4, 999.6, 1234, 9949, 9951, 12_345, 999_499, 999_501, 3.4e6,
              2.5e9, 7.7e12, 5e14)
    assert [compact(v) for v in values] == ["0.0", "0.0", "3.0", "19.0", "99.9", "100", "150", "999", "1.0k", "1.2k",
                                            "9.9k", "10k", "12k", "999k", "1.0M", "3.4M", "2.5G", "7.7T", "500T"]


def test_text_folds_after_slashes_and_commas_and_at_spaces_never_inside_a_word_that_fits():
    assert fold("/tmp/rtopab12cd34/demo-endpoints.json", 24) == "/tmp/rtopab12cd34/\ndemo-endpoints.json"
    assert fold("0123456789ab tcp://10.0.0.12:5557", 19) == "0123456789ab tcp://\n10.0.0.12:5557"
    assert fold("0123456789ab tcp://10.0.0.12:5557", 18) == "0123456789ab\ntcp://\n10.0.0.12:5557"  # not between slashes
    assert fold("a 1, b 2\nproducer.unavailable 1234 (+12)", 20) == "a 1, b 2\nproducer.unavailable\n1234 (+12)"
    assert fold("no-break-here", 5) == "no-br\neak-h\nere"  # a word longer than the width folds at the width
    assert fold("short", 5) == "short"


# -- the layout: which columns a terminal's width shows ---------------------------
LAYOUT_ROWS = [
    Row("/tmp/rtopab12cd34/endpoints.json", frames=12345.6, trajectories_in=310.2, trajectories_out=298.0,
        bytes=123456789, queues={"open": 120, "scoring": 30, "awaiting_group": 12, "queued": 123456, "leased": 64, "dead": 12345},
        producers=32, consumers=8, memory=(3 << 30, 64 << 30), disk=(900 << 30, 1 << 40),
        latency=Latency((0.001, 0.01, 0.1), (90, 9, 1, 0), 0.3),
        refusals=(Refusal("producer.unavailable", 1234, 12, 5.0), Refusal("consumer.stale_lease", 3, 0, 1.0))),
    Row("0123456789ab tcp://10.0.0.12:5557", frames=0.0, trajectories_in=0.0, trajectories_out=0.0, bytes=0.0, queues={},
        memory=(0, 2 << 30)),
    Row("ipc:///tmp/rtopab12cd34/nobody.sock", error="no answer from the broker at ipc:///tmp/rtopab12cd34/nobody.sock "
                                                    "within 0.5 s"),
]


def squeezed(text: str) -> str:
    """`text` without its white space: the same, however it folds."""
    return re.sub(r"\s+", "", text)


def read_table(screen: str) -> tuple[list[str], list[dict[str, str]]]:
    """The columns of the table on `screen` (the names of the headers
    shown, full or short) and its rows, each cell by column name, a folded
    cell's lines joined by newlines. The rule under the headers gives each
    column's place; a row begins on a line with figures, since only text
    folds."""
    lines = screen.splitlines()
    rule = next(at for at, line in enumerate(lines) if line.startswith("─"))
    places = [match.span() for match in re.finditer("─+", lines[rule])]
    by_header = {column.name: column for column in COLUMNS} | {column.short: column for column in COLUMNS}
    columns = [by_header[lines[rule - 1][start:end].strip()] for start, end in places]
    rows: list[dict[str, str]] = []
    for line in lines[rule + 1:]:
        if line.startswith("─") or not line.strip():  # the rule above the total; the screen below the table
            continue
        parts = {column.name: line[start:end].strip() for column, (start, end) in zip(columns, places)}
        if any(parts[column.name] for column in columns if not column.folds):
            rows.append(parts)
        else:
            assert rows, f"a table's first row begins with its figures, got {line!r} in:\n{screen}"
            rows[-1] = {name: f"{rows[-1][name]}\n{part}" if part else rows[-1][name] for name, part in parts.items()}
    return [column.name for column in columns], rows


def row_named(rows: list[dict[str, str]], broker: str) -> dict[str, str]:
    """The row whose broker cell reads `broker`, however it folds."""
    found = [row for row in rows if squeezed(row["broker"]) == squeezed(broker)]
    assert len(found) == 1, f"expected one row for {broker!r}, got {len(found)} in {rows}"
    return found[0]


def drawn(rows: list[Row], width: int) -> str:
    """The table as a terminal `width` wide shows it."""
    console = Console(width=width, color_system=None)
    with console.capture() as captured:
        console.print(table(rows, "rollstream top", width))
    return captured.get()


@pytest.mark.parametrize("width, headers", [
    (80, ["broker", "in/s", "out/s", "queued", "mem", "disk", "ack p99", "refusals"]),
    (120, ["broker", "fr/s", "in/s", "out/s", "wait", "queued", "prod", "cons", "mem", "disk", "ack p99", "refusals"]),
    # every column; the refusals stay a line each: on one line, the unreachable broker's reason leaves no room
    (250, ["broker", "frames/s", "traj in/s", "traj out/s", "in bytes/s", "open", "waiting", "queued", "leased", "dead",
           "producers", "consumers", "memory", "disk", "ack latency", "refusals",
           "producer restarts"]),
])
def test_a_terminals_width_shows_the_columns_that_fit_by_priority_with_every_cell_whole(width, headers):
    shown = layout([*LAYOUT_ROWS, total(LAYOUT_ROWS)], width)
    assert [column.header for column in shown] == headers
    screen = drawn(LAYOUT_ROWS, width)
    assert max(len(line) for line in screen.splitlines()) <= width, screen
    assert "…" not in screen, screen
    names, rows = read_table(screen)
    assert names == [column.column.name for column in shown]
    for index, row in enumerate([*LAYOUT_ROWS, total(LAYOUT_ROWS)]):
        seen = row_named(rows, row.broker)
        for column in shown:  # each cell whole, its full or its brief text: a figure on its line, text on more
            assert squeezed(column.cells[index]) in {squeezed(cells(row, brief)[column.column.name])
                                                     for brief in (False, True)}, (column.header, column.cells[index])
            assert seen[column.column.name] == column.cells[index], screen


def test_the_columns_shown_are_the_most_important_at_any_width():
    """Whatever the width: a prefix of PRIORITY, each figure on one line,
    nothing past the width, nothing cut; the full table where the width
    allows it."""
    rows = [*LAYOUT_ROWS, total(LAYOUT_ROWS)]
    assert sorted(PRIORITY) == sorted(column.name for column in COLUMNS)
    for width in range(20, 400, 7):
        shown = layout(rows, width)
        assert sorted(column.column.name for column in shown) == sorted(PRIORITY[:len(shown)]), width
        screen = drawn(LAYOUT_ROWS, width)
        assert max(len(line) for line in screen.splitlines()) <= width and "…" not in screen, screen
        for column in shown:
            assert len(column.header) <= column.width and all(
                len(line) <= column.width for cell in column.cells for line in cell.split("\n")), (width, column)
            assert column.column.folds or all("\n" not in cell for cell in column.cells), (width, column)
    assert [column.header for column in layout(rows, sys.maxsize)] == [column.name for column in COLUMNS]


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
        asked = drive(broker.consumer_read(received, at(t))) + drive(broker.deliver(at(t)))
        return [decode(r.frames, BROKER_TO_CONSUMER) for r in asked if getattr(r, "socket", None) == "consumer"]

    for tid in ("t", "u"):
        drive(broker.producer_read([(b"p", turn_msg(tid, 0, seq=1), None), (b"p", end_msg(tid, seq=2), None)], at(0.0)))
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
    four queued trajectories from the synthetic producer daemon."""
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


@pytest.mark.slow
def test_a_snapshot_in_a_pipe_shows_each_broker_and_an_unreachable_one(node):
    endpoints_file = node.flags["endpoints_file"]
    assert node._admin({"type": "nope"}, 5.0)["code"] == "schema"  # a refusal, counted nacks.admin.schema
    nobody = f"ipc://{node.directory}/nobody.sock"
    done = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "top", "--endpoints-file", endpoints_file,
                           "--admin", nobody, "--interval", "0.5", "--timeout", "0.5"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert done.returncode == 0, done.stderr
    names, rows = read_table(done.stdout)
    assert names == [column.name for column in COLUMNS], done.stdout  # in a pipe: every column, in full
    row = row_named(rows, endpoints_file)
    # two polls: an idle window rates 0 (one poll alone would show "-")
    assert (row["frames/s"], row["traj in/s"], row["in bytes/s"]) == ("0.0", "0.0", "0B/s"), row
    assert [row[name] for name in ("open", "waiting", "queued", "leased", "dead", "consumers")] == \
        ["0", "0", "4", "0", "0", "0"], row
    assert row["memory"].endswith("/2.0G 0%") and row["disk"].endswith("/64.0G 0%"), row
    assert row["refusals (latest first)"] == "admin.schema 1", row
    down = row_named(rows, nobody)
    assert down["frames/s"] == "-" and down["refusals (latest first)"] == \
        f"unreachable: no answer from the broker at {nobody} within 0.5 s", down
    assert row_named(rows, "total (1 of 2 answering)")["queued"] == "4"
    assert all("\n" not in cell for row in rows for cell in row.values()), done.stdout  # nothing folds in a pipe
    report = node.status()  # what the service adds: bytes read and one ack latency per producer batch
    assert report["counters"]["received_bytes"] > 0 and sum(report["ack_seconds"]["counts"]) >= 1, report


class Pane:
    """A real terminal: a tmux pane of a given size on a server of its
    own, running a shell command, read back as the screen it shows."""

    def __init__(self, directory: Path):
        self.directory = directory  # short: the server's socket lives here
        self.socket = f"rollstream-top-test-{uuid.uuid4().hex[:12]}"
        # The pane's size is the terminal's: no COLUMNS or LINES from whoever runs the tests (rich would take them, and
        # readline sets them).
        self.env = {**{key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")},
                    "TMUX_TMPDIR": str(directory)}

    def tmux(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], capture_output=True, text=True,
                              timeout=30, env=self.env)

    def start(self, command: str, columns: int, lines: int) -> None:
        started = self.tmux("new-session", "-d", "-x", str(columns), "-y", str(lines), "-c", os.getcwd(), "sh", "-c", command)
        assert started.returncode == 0, started.stderr

    def shows(self, wanted: Callable[[str], T], what: str) -> T:
        """What `wanted` makes of the screen once it is something: the
        screen is read until then (the error shows it as last read). A
        screen `wanted` cannot read (no table yet, or one caught halfway
        through a draw) is not it yet."""
        screens = [""]

        def read() -> T | None:
            screens.append(self.tmux("capture-pane", "-p").stdout)
            try:
                return wanted(screens[-1])
            except (StopIteration, KeyError, AssertionError):
                return None

        try:
            return wait_for(read, timeout=60, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the pane showed last:\n{screens[-1]}") from None


@pytest.fixture
def pane():
    directory = Path(tempfile.mkdtemp(prefix="rtty", dir="/tmp"))
    terminal = Pane(directory)
    try:
        yield terminal
    finally:
        terminal.tmux("kill-server")
        shutil.rmtree(directory, ignore_errors=True)


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="the live view is tested in a tmux terminal; tmux is not on PATH")
EVERY_COLUMN = 250  # a terminal this wide shows every column of the brokers of these tests


@pytest.mark.slow
@needs_tmux
@pytest.mark.parametrize("columns, lines", [(80, 24), (120, 40), (250, 50)])
def test_the_live_view_fits_the_terminal_with_the_columns_needed_first_and_every_figure_whole(node, pane, columns, lines):
    """`rollstream top` in a real terminal of each size, on a broker with
    four queued trajectories and a refusal, and on one that does not answer:
    the columns by priority, the figures whole, the names and the
    refusals folded where they must be, nothing past the width."""
    endpoints_file = node.flags["endpoints_file"]
    node._admin({"type": "nope"}, 5.0)  # a refusal: admin.schema 1
    nobody = f"ipc://{node.directory}/nobody.sock"
    pane.start(shlex.join([sys.executable, "-m", "rollstream.app.cli", "top", "--endpoints-file", endpoints_file,
                           "--admin", nobody, "--interval", "0.3", "--timeout", "0.5"]), columns, lines)

    def rated(screen: str) -> str:
        """The screen once it shows the whole table with the broker's rates (its second poll)."""
        rows = read_table(screen)[1]
        for other in (nobody, "total (1 of 2 answering)"):  # every row drawn, not a frame caught halfway
            row_named(rows, other)
        return screen if row_named(rows, endpoints_file)["traj in/s"] == "0.0" else ""

    screen = pane.shows(rated, f"top's table at {columns}x{lines} with the broker's rates")
    assert max(len(line) for line in screen.splitlines()) <= columns and "…" not in screen, screen
    names, rows = read_table(screen)
    assert sorted(names) == sorted(PRIORITY[:len(names)]) and set(FIRST_NEEDED) <= set(names), screen
    assert columns < EVERY_COLUMN or len(names) == len(COLUMNS), screen
    idle = {"frames/s": "0.0", "traj in/s": "0.0", "traj out/s": "0.0", "in bytes/s": "0B/s", "open": "0", "waiting": "0",
            "queued": "4", "leased": "0", "dead": "0", "consumers": "0", "refusals (latest first)": "admin.schema 1"}
    broker = row_named(rows, endpoints_file)
    # A refusal folds at a space where the column is narrow: read its lines as one text.
    shown = {name: " ".join(broker[name].split()) for name in idle if name in names}
    assert shown == {name: idle[name] for name in idle if name in names}, screen
    assert re.fullmatch(r"0%|\d+(\.\d)?[BK]/2\.0G 0%", broker["memory"]), screen  # the fixture broker's budgets
    assert re.fullmatch(r"0%|\d+(\.\d)?[BKM]/64\.0G 0%", broker["disk"]), screen
    down = row_named(rows, nobody)
    assert all(down[name] == "-" for name in names if name not in ("broker", "refusals (latest first)")), screen
    assert squeezed(down["refusals (latest first)"]) in (
        "unreachable", squeezed(f"unreachable: no answer from the broker at {nobody} within 0.5 s")), screen
    assert row_named(rows, "total (1 of 2 answering)")["queued"] == "4", screen


@pytest.mark.slow
@needs_tmux
def test_the_live_view_shows_a_running_demo_follows_a_resize_and_quits_on_q_restoring_the_terminal(pane, tmp_path):
    """`rollstream demo --endpoints-file` in the background, `rollstream top`
    on that file in a real terminal (tmux): the demo's broker with its
    trainer's consumer; narrowed to 80 columns, the narrow layout; `q`
    quits, exit status 0, the terminal as it was. The demo is given more
    trajectories than it can finish while the test runs, so its trainer is
    still there whenever `top` first draws; the test then interrupts it,
    and it removes its endpoints file on the way out."""
    out = pane.directory
    endpoints_file = str(out / "demo-endpoints.json")
    with open(tmp_path / "demo.log", "wb") as log:
        demo = subprocess.Popen([sys.executable, "-m", "rollstream.app.cli", "demo", "--producers", "1", "--dp-size", "1",
                                 "--trajectories", "1000000", "--endpoints-file", endpoints_file], stdout=log,
                                stderr=subprocess.STDOUT)
    top = shlex.join([sys.executable, "-m", "rollstream.app.cli", "top", "--endpoints-file", endpoints_file,
                      "--interval", "0.3"])
    try:
        wait_for(lambda: os.path.exists(endpoints_file), timeout=60, what="the demo's broker to write its endpoints")
        # after top: its exit status and the terminal's settings, as the shell sees them
        pane.start(f"{top}; echo $? > {out}/top.status; stty -a > {out}/stty.txt", EVERY_COLUMN, 50)

        def trainer_shown(screen: str) -> dict[str, str] | None:
            row = row_named(read_table(screen)[1], endpoints_file)
            return row if "total (1 of 1" in screen and row["consumers"] == "1" else None

        def narrowed(screen: str) -> list[str]:
            """The columns once drawn for 80 (not the wide table cropped)."""
            names = read_table(screen)[0]
            return names if set(FIRST_NEEDED) <= set(names) and len(names) < len(COLUMNS) else []

        row = pane.shows(trainer_shown, "the demo's broker with its trainer in top's table")
        assert "/2.0G" in row["memory"], row  # the demo broker's memory budget
        assert pane.tmux("resize-window", "-x", "80", "-y", "24").returncode == 0
        pane.shows(narrowed, "top's table narrowed to 80 columns, with the columns needed first")
        assert pane.tmux("send-keys", "q").returncode == 0
        status = wait_for(lambda: (out / "top.status").exists() and (out / "top.status").read_text().strip(),
                          timeout=30, what="top to exit after q")
        assert status == "0"
        settings = wait_for(lambda: (out / "stty.txt").exists() and (out / "stty.txt").read_text(), what="stty's output")
        assert re.search(r"(?<!-)\bicanon\b", settings) and re.search(r"(?<!-)\becho\b", settings), settings
        wait_for(lambda: pane.tmux("has-session").returncode != 0, timeout=30, what="the pane to close")
        demo.send_signal(signal.SIGINT)
        assert demo.wait(240) == 1, (tmp_path / "demo.log").read_text()[-3000:]  # click's "Aborted!"
        assert not os.path.exists(endpoints_file), "the demo's broker must remove its endpoints file when it stops"
    finally:
        if demo.poll() is None:  # an interrupt, so the demo stops its daemons on the way out
            demo.send_signal(signal.SIGINT)
            demo.wait(60)
