"""`rollstream top`: every broker of a job in one table, refreshed in place,
for an operator watching a run (`rollstream status` answers for one broker,
once).

Three parts, kept apart so that the figures and the layout are tested
without sockets, a clock or a terminal: `Top` turns each broker's
successive status reports into rows (rates from counter deltas, ack latency
from histogram deltas, refusals by recency), `layout` chooses and
abbreviates the columns for a terminal's width and `table` draws them with
rich, and `watch` and `snapshot` poll the brokers and draw.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import click
import zmq
from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from rollstream.common.admin import AdminClient, AdminError, read_endpoints_file
from rollstream.common.clock import Clock
from rollstream.common.curve import ClientCurve, CurveError, curve_client_options
from rollstream.common.errors import InvalidInput
from rollstream.common.messages import status_count

# The status report's counters each rate is taken from (docs/broker.md, Metrics and logs).
FRAMES = ("frames.", "nacks.producer.")  # producer frames answered: acked (any outcome) or refused
ENDED = "frames.end.applied"  # trajectories ended by their producer (in)
ACKED = "trajectories_acked"  # trajectories a consumer acked (out)
RECEIVED_BYTES = "received_bytes"
NACKS = "nacks."  # refusals, as nacks.ENDPOINT.CODE
QUEUES = ("open", "scoring", "awaiting_group", "queued", "leased", "dead")  # status counts, as the broker names them
WAITING = ("scoring", "awaiting_group")  # ended, not queued yet: its reward or the rest of its group to come
REFUSALS_SHOWN = 3  # per row, most recent first


# -- the figures, sans-I/O ------------------------------------------------------
@dataclass(frozen=True)
class Poll:
    """One broker's status report (`status`), or why none came (`error`),
    answered at monotonic time `at`."""

    at: float
    status: Mapping[str, Any] | None = None
    error: str = ""


@dataclass(frozen=True)
class Latency:
    """The broker's ack latency histogram over a window: its buckets' upper
    bounds in seconds, how many fell in each (the last: above every bound)
    and their sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile `q` (inf: above
        every bound); None without observations."""
        if not self.count:
            return None
        rank, seen = math.ceil(q * self.count), 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            seen += count
            if seen >= rank:
                return bound
        return math.inf

    def since(self, earlier: "Latency") -> "Latency":
        return Latency(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts)), self.sum - earlier.sum)

    def __add__(self, other: "Latency") -> "Latency":
        if other.bounds != self.bounds:
            raise InvalidInput(f"ack latency histograms add only with the same bounds, got {self.bounds} and {other.bounds}")
        return Latency(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)), self.sum + other.sum)

    @classmethod
    def of(cls, status: Mapping[str, Any]) -> "Latency | None":
        """The report's `ack_seconds`, or None from a broker that does not report it."""
        acks = status.get("ack_seconds")
        if not acks:
            return None
        return cls(tuple(acks["bounds"]), tuple(acks["counts"]), acks["sum"])


class Refusal(NamedTuple):
    """Refusals of one kind (`ENDPOINT.CODE`): how many in all, how many
    in the last window, and when their count last grew (-inf: not seen
    growing since `top` started)."""

    code: str
    total: int
    new: int
    seen: float


@dataclass(frozen=True)
class Row:
    """One line of the table: a broker, or the total. Rates are per second
    over the last window (None: not known yet); `error` says why a broker
    did not answer (its other fields are then empty)."""

    broker: str
    error: str = ""
    frames: float | None = None
    trajectories_in: float | None = None
    trajectories_out: float | None = None
    bytes: float | None = None
    queues: Mapping[str, int] | None = None
    producers: int = 0
    consumers: int = 0
    memory: tuple[int, int | None] = (0, None)  # bytes held, and the budget (None: not reported)
    disk: tuple[int, int | None] = (0, None)
    latency: Latency | None = None
    refusals: tuple[Refusal, ...] = ()
    resumed: Mapping[str, int] | None = None  # what restarted producers did with what they had open (`status`)


def _sum(counters: Mapping[str, float], prefixes: tuple[str, ...] | str) -> float:
    return sum(value for key, value in counters.items() if key.startswith(prefixes))


def _restarted(before: Mapping[str, float], now: Mapping[str, float]) -> bool:
    """Whether the counters started again (a broker restart): one went down, or is gone."""
    return any(now.get(key, 0) < value for key, value in before.items())


class Top:
    """Rows from each broker's successive polls. Rates and latency need two
    answers from one broker run: a broker's first answer, and its first
    after a restart (a counter went down), show none. A broker that does
    not answer in between leaves its last answer to rate against."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, Mapping[str, Any]]] = {}  # by broker, when it last answered and what
        self._seen: dict[str, dict[str, float]] = {}  # by broker, when each refusal count last grew

    def update(self, broker: str, poll: Poll) -> Row:
        status = poll.status
        if status is None:
            return Row(broker, error=poll.error or "no answer")
        counters = status.get("counters", {})
        last = self._last.get(broker)
        self._last[broker] = (poll.at, status)
        # the answer differences are taken from: this broker run's last, from an earlier time
        before = None
        if last is not None and last[0] < poll.at and not _restarted(last[1].get("counters", {}), counters):
            before = last[1]
        window = 0.0 if last is None else poll.at - last[0]
        old = {} if before is None else before.get("counters", {})
        seen = self._seen.setdefault(broker, {})
        refusals = []
        for key, total in counters.items():
            if not key.startswith(NACKS):
                continue
            new = 0 if before is None else int(total - old.get(key, 0))
            if new:
                seen[key] = poll.at
            refusals.append(Refusal(key[len(NACKS):], int(total), new, seen.get(key, -math.inf)))
        latency, earlier = Latency.of(status), None if before is None else Latency.of(before)
        window_latency = None
        if latency is not None and earlier is not None and earlier.bounds == latency.bounds:
            window_latency = latency.since(earlier)

        def rate(keys: tuple[str, ...] | str) -> float | None:
            return None if before is None else (_sum(counters, keys) - _sum(old, keys)) / window

        return Row(
            broker,
            frames=rate(FRAMES),
            trajectories_in=rate(ENDED),
            trajectories_out=rate(ACKED),
            bytes=rate(RECEIVED_BYTES),
            queues={name: status_count(status, name) for name in QUEUES},
            producers=int(status.get("producers", 0)),
            consumers=int(status.get("consumers", 0)),
            memory=(int(status.get("bytes_in_memory", 0)), status.get("max_memory_bytes")),
            # what counts against max_disk_bytes: trained data not yet sealed has a budget of its own
            disk=(max(0, int(status.get("bytes_on_disk", 0)) - int(status.get("unsealed_bytes", 0))),
                  status.get("max_disk_bytes")),
            latency=window_latency,
            refusals=_ordered(refusals),
            resumed=status.get("resumed"),
        )


def _ordered(refusals: list[Refusal]) -> tuple[Refusal, ...]:
    """Most recently grown first, then the most numerous."""
    return tuple(sorted(refusals, key=lambda r: (-r.seen, -r.total, r.code)))


def total(rows: Sequence[Row]) -> Row:
    """The sum of the brokers that answered; a rate only where one of them has it."""
    answered = [row for row in rows if not row.error]

    def rate(name: str) -> float | None:
        known = [getattr(row, name) for row in answered if getattr(row, name) is not None]
        return sum(known) if known else None

    def budget(name: str) -> tuple[int, int | None]:
        """Bytes held in all, against the budgets' sum where every broker reports its budget."""
        limits = [getattr(row, name)[1] for row in answered]
        known = [limit for limit in limits if limit is not None]
        return sum(getattr(row, name)[0] for row in answered), sum(known) if known and len(known) == len(limits) else None

    latencies = [row.latency for row in answered if row.latency is not None]
    latency = None
    if latencies and all(item.bounds == latencies[0].bounds for item in latencies):
        latency = sum(latencies[1:], latencies[0])
    merged: dict[str, Refusal] = {}
    for row in answered:
        for r in row.refusals:
            had = merged.get(r.code)
            merged[r.code] = r if had is None else Refusal(r.code, had.total + r.total, had.new + r.new,
                                                           max(had.seen, r.seen))
    return Row(
        f"total ({len(answered)} of {len(rows)} answering)",
        frames=rate("frames"),
        trajectories_in=rate("trajectories_in"),
        trajectories_out=rate("trajectories_out"),
        bytes=rate("bytes"),
        queues={name: sum((row.queues or {}).get(name, 0) for row in answered) for name in QUEUES},
        producers=sum(row.producers for row in answered),
        consumers=sum(row.consumers for row in answered),
        memory=budget("memory"),
        disk=budget("disk"),
        latency=latency,
        refusals=_ordered(list(merged.values())),
        resumed={action: sum((row.resumed or {}).get(action, 0) for row in answered) for action in RESUMED}
        if any(row.resumed for row in answered) else None,
    )


# -- drawing, sans-I/O: the layout is a function of the rows and the width --------
class Column(NamedTuple):
    """A column of the table: its header, the shorter header of a narrow
    terminal, and whether its cells are text (a name, a list: left-aligned)
    that folds onto more lines when room is short, where a figure never
    does."""

    name: str
    short: str
    folds: bool = False


COLUMNS = (Column("broker", "broker", folds=True), Column("frames/s", "fr/s"), Column("traj in/s", "in/s"),
           Column("traj out/s", "out/s"), Column("in bytes/s", "in B/s"), Column("open", "open"),
           Column("waiting", "wait"), Column("queued", "queued"), Column("leased", "leased"), Column("dead", "dead"),
           Column("producers", "prod"), Column("consumers", "cons"), Column("memory", "mem"), Column("disk", "disk"),
           Column("ack latency", "ack p99"), Column("refusals (latest first)", "refusals", folds=True),
           Column("producer restarts", "restarts", folds=True))
# The columns in the order they are kept as a terminal narrows: what an operator needs first, then the rest.
FIRST_NEEDED = ("broker", "traj in/s", "traj out/s", "queued", "memory", "disk", "ack latency", "refusals (latest first)")
THEN = ("consumers", "producers", "frames/s", "waiting", "leased", "dead", "in bytes/s", "open", "producer restarts")
# What restarted producers did with the trajectories they had open (`resumed` in `status`).
RESUMED = ("continued", "restarted", "aborted")
PRIORITY = FIRST_NEEDED + THEN
GAP = 2  # characters between two columns as `table` draws them: a space of padding and the rule's gap
WHOLE_TEXT = 24  # the first needed text is unfolded up to this wide before more columns are taken
# Where text may go on to the next line: after a comma or a slash (not between two slashes), at a space.
BREAKS = re.compile(r"(?<=[/,])(?!/)|\s")


def human_bytes(n: float) -> str:
    """`n` bytes in binary units, short: 512B, 336K, 2.0G."""
    units, power = ("B", "K", "M", "G", "T"), 0
    while abs(n) >= 1024 and power < len(units) - 1:
        n, power = n / 1024, power + 1
    return f"{n:.0f}{units[power]}" if power == 0 or abs(n) >= 100 else f"{n:.1f}{units[power]}"


def compact(n: float) -> str:
    """A rate in four characters at most below 10^15: 19.0, 150, 1.2k, 12k, 3.4M."""
    if round(n, 1) < 100:
        return f"{n:.1f}"
    unit = ""
    for larger in ("k", "M", "G", "T"):
        if round(n) < 1000:
            break
        n, unit = n / 1000, larger
    return f"{n:.1f}{unit}" if round(n, 1) < 10 else f"{n:.0f}{unit}"


def _seconds(value: float) -> str:
    return f"{value * 1000:.3g}ms" if value < 1 else f"{value:.3g}s"


def cells(row: Row, brief: bool = False) -> dict[str, str]:
    """`row`'s cells by column name; `brief`: a narrow terminal's, budgets
    as a percentage, the ack latency's p99 alone, one refusal a line, an
    unreachable broker without the reason."""
    if row.error:
        return {column.name: "-" for column in COLUMNS} | {
            "broker": row.broker, "refusals (latest first)": "unreachable" if brief else f"unreachable: {row.error}"}

    def rate(value: float | None, fmt=compact) -> str:
        return "-" if value is None else fmt(value)

    def budget(used: int, limit: int | None) -> str:
        if not limit:
            return human_bytes(used)
        share = f"{100 * used / limit:.0f}%"
        return share if brief else f"{human_bytes(used)}/{human_bytes(limit)} {share}"

    latency = "-"
    if row.latency is not None and row.latency.mean is not None:
        p99 = row.latency.quantile(0.99)
        assert p99 is not None  # a histogram with a mean has observations
        latency = f">{_seconds(row.latency.bounds[-1])}" if p99 == math.inf else f"<={_seconds(p99)}"
        if not brief:
            latency = f"{_seconds(row.latency.mean)} p99{latency}"
    refusals = [f"{r.code} {r.total}" + (f" (+{r.new})" if r.new else "") for r in row.refusals[:REFUSALS_SHOWN]]
    if len(row.refusals) > REFUSALS_SHOWN:
        refusals.append(f"+{len(row.refusals) - REFUSALS_SHOWN} more")
    queues = row.queues or {}
    return {"broker": row.broker, "frames/s": rate(row.frames), "traj in/s": rate(row.trajectories_in),
            "traj out/s": rate(row.trajectories_out), "in bytes/s": rate(row.bytes, lambda v: human_bytes(v) + "/s"),
            "open": str(queues.get("open", 0)), "waiting": str(sum(queues.get(name, 0) for name in WAITING)),
            **{name: str(queues.get(name, 0)) for name in ("queued", "leased", "dead")},
            "producers": str(row.producers), "consumers": str(row.consumers),
            "memory": budget(*row.memory), "disk": budget(*row.disk), "ack latency": latency,
            "refusals (latest first)": ("\n" if brief else ", ").join(refusals) or "-",
            "producer restarts": _resumed(row.resumed, brief)}


def _resumed(resumed: Mapping[str, int] | None, brief: bool) -> str:
    """`12 continued, 1 restarted, 0 aborted` (`12/1/0` brief); `-` before any restart."""
    if not resumed or not any(resumed.get(action, 0) for action in RESUMED):
        return "-"
    counts = [int(resumed.get(action, 0)) for action in RESUMED]
    return "/".join(map(str, counts)) if brief else ", ".join(f"{n} {action}" for n, action in zip(counts, RESUMED))


def fold(text: str, width: int) -> str:
    """`text` in lines of `width` characters at most, each broken at the
    last place `BREAKS` allows within the width, else at the width."""
    lines = []
    for line in text.split("\n"):
        while len(line) > width:
            cut = max((at for match in BREAKS.finditer(line, 1, width + 1) if (at := match.start()) <= width),
                      default=width)
            lines.append(line[:cut].rstrip())
            line = line[cut:].lstrip()
        lines.append(line)
    return "\n".join(lines)


class Shown(NamedTuple):
    """A column as drawn: its header, its width, and its cells (one per
    row) folded to that width."""

    column: Column
    header: str
    width: int
    cells: tuple[str, ...]


def layout(rows: Sequence[Row], width: int) -> list[Shown]:
    """The columns that draw `rows` in `width` characters, in `COLUMNS`
    order, chosen by what an operator needs first. The columns of
    `FIRST_NEEDED` are taken brief while they fit (a figure as wide as its
    widest cell, text as its longest word: no word folds, no figure is cut);
    then their text on fewer lines (up to `WHOLE_TEXT` wide); then the
    columns of `THEN` while they fit; then text unfolded; then full
    headers and cells, by priority, where they fit."""
    texts = {brief: [cells(row, brief) for row in rows] for brief in (True, False)}
    columns = {column.name: column for column in COLUMNS}

    def widest(name: str, brief: bool) -> int:
        """The width of the header and of the longest line of any cell."""
        header = columns[name].short if brief else name
        return max([len(header), *(len(line) for row in texts[brief] for line in row[name].split("\n"))])

    chosen: dict[str, tuple[bool, int]] = {}  # by column name: whether brief, and the width
    room = width + GAP  # each column takes a gap, but the first

    def take(names: tuple[str, ...]) -> bool:
        """Take `names` brief, in order, while they fit: whether all did
        (text may be taken narrower than its longest word where nothing
        else would fit)."""
        nonlocal room
        for name in names:
            least = widest(name, True)
            if columns[name].folds:
                longest_word = max(len(word) for row in texts[True] for word in BREAKS.split(row[name]))
                least = max(len(columns[name].short), min(longest_word, room - GAP))
            if least + GAP > room:
                return False
            chosen[name], room = (True, least), room - least - GAP
        return True

    def unfold(most: int) -> None:
        """Widen the text taken, by priority, towards its longest line, up to `most`."""
        nonlocal room
        for name in [name for name in chosen if columns[name].folds]:
            now = chosen[name][1]
            grown = max(now, min(widest(name, True), most, now + room))
            chosen[name], room = (True, grown), room - (grown - now)

    if take(FIRST_NEEDED):
        unfold(WHOLE_TEXT)
        take(THEN)
    unfold(width)
    for name, (_, now) in list(chosen.items()):
        if (full := widest(name, False)) - now <= room:
            chosen[name], room = (False, full), room - (full - now)
    shown = []
    for column in COLUMNS:
        if column.name in chosen:
            brief, wide = chosen[column.name]
            shown.append(Shown(column, column.short if brief else column.name, wide,
                               tuple(fold(row[column.name], wide) for row in texts[brief])))
    return shown


# A rule under the header and above the total; no border, so that the columns have the room.
RULED = box.Box("    \n    \n ─  \n    \n ─  \n ─  \n    \n    \n")


def table(rows: Sequence[Row], title: str, width: int) -> Table:
    """The brokers' rows and their total under `title`, in `width`
    characters; unreachable brokers in red."""
    drawn = [*rows, total(rows)]
    grid = Table(title=title, title_justify="left", box=RULED, show_edge=False, pad_edge=False, collapse_padding=True)
    shown = layout(drawn, width)
    for column in shown:
        grid.add_column(column.header, justify="left" if column.column.folds else "right", width=column.width,
                        no_wrap=True)
    for index, row in enumerate(rows):
        grid.add_row(*(column.cells[index] for column in shown), style="red" if row.error else None)
    grid.add_section()
    grid.add_row(*(column.cells[-1] for column in shown), style="bold")
    return grid


# -- the brokers, and polling them ---------------------------------------------
class Target(NamedTuple):
    """A broker to poll: its row's name, and its admin endpoint or the
    endpoints file to read it from at every poll (a restarted broker may
    have bound other ports)."""

    name: str
    admin: str | None = None
    endpoints_file: str | None = None


def find_targets(admins: Sequence[str], endpoints_files: Sequence[str], ray_address: str | None) -> list[Target]:
    """The brokers named by the options, each once, in the order given;
    with `ray_address`, every node's broker of that Ray cluster too."""
    found = [Target(admin, admin=admin) for admin in admins]
    found += [Target(path, endpoints_file=path) for path in endpoints_files]
    if ray_address is not None:
        found += ray_targets(ray_address)
    if not found:
        raise click.UsageError("name the brokers to watch: --admin ENDPOINT, --endpoints-file FILE or --ray "
                               "(any of them, repeated), got none")
    return list(dict.fromkeys(found))


def ray_targets(address: str) -> list[Target]:
    """Every node's broker of the Ray cluster at `address` (ray.init's),
    through rollstream.ray, imported only here: Ray is an optional extra."""
    try:
        from rollstream.ray import all_brokers, connect
    except ImportError as exc:
        raise click.ClickException(f"--ray needs Ray and rollstream.ray: pip install 'rollstream[ray]' ({exc})") from None
    try:
        connect(address)
    except ConnectionError as exc:
        raise click.ClickException(f"--ray found no Ray cluster at --ray-address {address}: {exc}") from None
    brokers = all_brokers()
    if not brokers:
        raise click.ClickException("--ray found no rollstream broker on the cluster's nodes: has "
                                   "rollstream.ray.start_brokers() run?")
    return [Target(f"{broker.node_id[:12]} {broker.admin}", admin=broker.admin) for broker in brokers]


class Poller:
    """Asks every target for its status at once (one thread each, so a
    broker that does not answer delays a refresh by `timeout`, not by its
    share of the brokers), feeding the answers to a `Top`."""

    def __init__(self, targets: Sequence[Target], timeout: float, curve_secret_key: str | None,
                 curve_server_key: str | None):
        self.targets, self.timeout = list(targets), timeout
        self.curve_secret_key, self.curve_server_key = curve_secret_key, curve_server_key
        self.top = Top()
        self._pool = ThreadPoolExecutor(min(32, len(self.targets)), thread_name_prefix="rollstream-top")

    def ask(self, target: Target) -> Poll:
        """One status report, or why none came; nothing a broker does raises here."""
        try:
            endpoint = target.admin or read_endpoints_file(target.endpoints_file or "")["admin"]
            with AdminClient(endpoint, timeout=self.timeout, curve_secret_key=self.curve_secret_key,
                             curve_server_key=self.curve_server_key) as admin:
                return Poll(Clock.monotonic(), admin.status())
        except (AdminError, zmq.ZMQError) as exc:
            return Poll(Clock.monotonic(), error=str(exc))

    def rows(self) -> list[Row]:
        polls = list(self._pool.map(self.ask, self.targets))
        return [self.top.update(target.name, poll) for target, poll in zip(self.targets, polls)]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def keypresses(stream) -> Iterator[int | None]:
    """`stream`'s descriptor in cbreak mode (each key read as it is typed,
    unechoed), its settings restored on the way out however it is left
    (q, Ctrl-C, an error); None when it is no terminal."""
    if not stream.isatty():
        yield None
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def quit_within(fd: int | None, seconds: float) -> bool:
    """Wait up to `seconds` for keys on `fd`: whether q came."""
    if fd is None:
        time.sleep(max(0.0, seconds))
        return False
    deadline = Clock.monotonic() + seconds
    while (left := deadline - Clock.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            keys = os.read(fd, 64)
            if not keys or b"q" in keys.lower():  # end of input: nobody left to press q
                return True
    return False


def watch(poller: Poller, interval: float, console: Console) -> None:
    """Redraw every `interval` seconds until q (or Ctrl-C)."""
    title = f"rollstream top: {len(poller.targets)} broker(s), rates over the last {interval:g} s; q quits"
    with keypresses(sys.stdin) as fd, Live(console=console, screen=True, auto_refresh=False) as live:
        while True:
            started = Clock.monotonic()
            live.update(table(poller.rows(), title, console.width), refresh=True)  # the width now: it may have changed
            if quit_within(fd, started + interval - Clock.monotonic()):
                return


def snapshot(poller: Poller, interval: float, console: Console) -> None:
    """One table, of two polls `interval` apart (so that it has rates); on
    a terminal in its width, off one as wide as its rows, so that none
    wraps in a pipe."""
    started = Clock.monotonic()
    poller.rows()
    time.sleep(max(0.0, started + interval - Clock.monotonic()))
    grid = table(poller.rows(), f"rollstream top: {len(poller.targets)} broker(s), rates over {interval:g} s",
                 console.width if console.is_terminal else sys.maxsize)
    if not console.is_terminal:
        console = Console(width=Console(width=10_000).measure(grid).maximum)
    console.print(grid)


def run_top(admins: Sequence[str], endpoints_files: Sequence[str], ray_address: str | None, interval: float,
            timeout: float, once: bool, curve_secret_key: str | None, curve_server_key: str | None) -> None:
    """The `rollstream top` command: live on a terminal unless `once`, else one snapshot."""
    try:
        ClientCurve.from_files(curve_secret_key, curve_server_key)  # a key file's fault is told once, not per broker
    except CurveError as exc:
        raise click.ClickException(str(exc)) from None
    poller = Poller(find_targets(admins, endpoints_files, ray_address), timeout, curve_secret_key, curve_server_key)
    console = Console()
    try:
        if once or not console.is_terminal:
            snapshot(poller, interval, console)
        else:
            watch(poller, interval, console)
    except KeyboardInterrupt:
        pass  # Ctrl-C quits as q does; the terminal is already restored
    finally:
        poller.close()


@click.command()
@click.option("--admin", "admins", multiple=True, help="A broker's admin endpoint (repeat for more brokers).")
@click.option("--endpoints-file", "endpoints_files", multiple=True, type=click.Path(dir_okay=False),
              help="The file a broker's --endpoints-file names, read again at every refresh (repeat for more).")
@click.option("--ray", is_flag=True, help="Every node's broker of a Ray cluster (rollstream.ray; the ray extra).")
@click.option("--ray-address", default="auto", show_default=True,
              help="With --ray: the cluster to connect to (ray.init's address; auto: the one this node belongs to).")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes; the rates are over the last one.")
@click.option("--timeout", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
              help="Seconds to wait for each broker's answer; one that does not answer shows as unreachable.")
@click.option("--once", is_flag=True, help="Print one table and exit, as when stdout is no terminal: two polls "
              "--interval apart, rates over that interval.")
@curve_client_options
def top(admins: tuple[str, ...], endpoints_files: tuple[str, ...], ray: bool, ray_address: str, interval: float,
        timeout: float, once: bool, curve_secret_key: str | None, curve_server_key: str | None) -> None:
    """A live table of every broker of a job: frame, trajectory and byte
    rates, queues, memory and disk against their budgets, producers and
    consumers, ack latency and the latest refusals, with their total. On a
    terminal it refreshes until q; otherwise it prints one table."""
    run_top(admins, endpoints_files, ray_address if ray else None, interval, timeout, once, curve_secret_key,
            curve_server_key)
