"""The public harness for running a loopback pipeline in tests and demos.

A `LoopbackNode` is a broker on a fresh data directory with producer
daemons beside it; a `Trainer` is a mock trainer of gloo rank processes
(`rollstream.app.demo_rank`); a `Pipeline` is a node's synthetic producers
and a trainer, all keeping ledgers, watched until drained and then judged
by the end-to-end checker (`rollstream.common.checker`). `Chaos` and
`inject_due` kill the broker, a producer and the trainer's source rank
during a run and restart each, as a crash and a supervisor would. Every
process is real and every address is loopback (or the `bind` a caller
gives). `rollstream demo` and the fault suite (tests/faults/) compose their
runs from these.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Sequence

from rollstream.common.admin import AdminClient, AdminError, ask_status
from rollstream.common.checker import LedgerReader, broker_backlog, check
from rollstream.common.clock import Clock
from rollstream.common.errors import InternalError, TimedOut

VOCAB = 151_936  # the producers' default vocabulary size (ProducerSettings.vocab_size)


class DaemonFailed(InternalError):
    """A daemon or trainer rank the harness started exited with an error
    (its output is in the node's daemons.log)."""


class ArchiveBehind(TimedOut):
    """The broker's archive did not hold what the ended runs trained within
    the time given (`end_runs`): the demo names it instead of a traceback."""


def _cli(*args: str) -> list[str]:
    """The `rollstream` command line running `args`, as this interpreter runs it."""
    return [sys.executable, "-m", "rollstream.app.cli", *args]


class LoopbackNode:
    """A broker on a fresh data directory and producer daemons beside it,
    all on loopback, as the demos run them: `with LoopbackNode(...) as
    node:` starts the broker on ports the system picks and waits until it
    answers (`endpoints` are then the ones it bound; a restarted broker
    binds the same ones); on exit every daemon still running is stopped
    (SIGTERM, then SIGKILL after 30 s) and the directory removed unless
    `keep_data`. The daemons' output goes to `daemons.log` in it.

    `bind` replaces some of the broker's endpoints (`producer`, `consumer`,
    `admin`: fixed addresses instead of loopback ports the system picks);
    `command_prefix` comes before every daemon's command line (e.g.
    `ip netns exec NAME`, so the node's processes run in its network
    namespace; the prefix must exec the command, keeping its pid).
    `admin_keys` are the node's own admin client's CURVE keys (its
    .key_secret and the broker's .key) for a broker that requires them.
    `endpoints_file` is where the broker writes its bound endpoints (default:
    in the node's directory), e.g. for `rollstream top --endpoints-file`."""

    def __init__(self, prefix: str, vocab_size: int, *, keep_data: bool = False, broker_args: tuple[str, ...] = (),
                 bind: dict[str, str] | None = None, command_prefix: Sequence[str] = (),
                 admin_keys: tuple[str, str] | None = None, endpoints_file: str | None = None):
        self.vocab_size = vocab_size
        self.keep_data = keep_data
        self.broker_args = tuple(broker_args)
        self.bind = dict(bind or {})
        self.command_prefix = tuple(command_prefix)
        self.admin_keys: tuple[str | None, str | None] = admin_keys or (None, None)
        self.work = Path(tempfile.mkdtemp(prefix=prefix))
        self.endpoints_file = endpoints_file or str(self.work / "endpoints.json")
        self.endpoints: dict[str, str] = {}  # as the broker bound them, once it answers
        self.broker: subprocess.Popen | None = None
        self._daemons: list[subprocess.Popen] = []
        self._producers: list[tuple[subprocess.Popen, tuple[str, ...]]] = []
        self.producer_starts = 0  # producer processes started so far, restarts included
        self._killed: set[int] = set()  # producers killed on purpose and not restarted
        self._log: BinaryIO | None = None
        self.admin: AdminClient | None = None

    def __enter__(self) -> "LoopbackNode":
        self._log = open(self.work / "daemons.log", "ab")
        try:
            any_port = "tcp://127.0.0.1:0"
            self._start_broker({"producer": any_port, "consumer": any_port, "admin": any_port, **self.bind})
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start_broker(self, endpoints: dict[str, str]) -> None:
        endpoints_file = self.endpoints_file
        self.broker = self._start("broker", "--producer-endpoint", endpoints["producer"], "--consumer-endpoint",
                                  endpoints["consumer"], "--admin-endpoint", endpoints["admin"], "--endpoints-file",
                                  endpoints_file, "--data-dir", str(self.work / "data"), "--vocab-size",
                                  str(self.vocab_size), "--metrics-port", "0", "--log-level", "warning",
                                  *self.broker_args)
        secret, server = self.admin_keys
        status = self._answering(60.0)
        self.endpoints = status["endpoints"]
        if self.admin is None:
            self.admin = AdminClient(self.endpoints["admin"], timeout=5.0, curve_secret_key=secret,
                                     curve_server_key=server).__enter__()

    def _answering(self, timeout: float) -> dict:
        """The just started broker's status once it answers (within
        `timeout` seconds); a broker that exits first fails at once, with
        its exit status and the tail of daemons.log."""
        assert self.broker is not None, "_answering follows the broker's start"
        secret, server = self.admin_keys
        deadline = Clock.monotonic() + timeout
        while True:
            try:
                status, _ = ask_status(None, endpoints_file=self.endpoints_file, wait=5.0, curve_secret_key=secret,
                                       curve_server_key=server)
                return status
            except AdminError as error:
                if self.broker.poll() is not None:
                    raise self.failed(f"a started broker must run until it answers: expected it running, got exit "
                                      f"status {self.broker.returncode}") from None
                if error.code == "handshake_refused" or Clock.monotonic() >= deadline:
                    raise

    def kill_broker(self) -> None:
        """SIGKILL the broker, as a crash would."""
        assert self.broker is not None, "the broker is started on entering the node"
        self.broker.kill()
        self.broker.wait()

    def restart_broker(self) -> None:
        """Start the broker again on its data directory and the endpoints it had."""
        self._start_broker(self.endpoints)

    def dead_letters(self) -> list[dict]:
        """Every dead letter the broker holds or pruned and still remembers."""
        assert self.admin is not None, "the admin client is made when the broker first answers"
        return self.admin.dead_letters(1_000_000, pruned=True)

    def _start(self, *args: str) -> subprocess.Popen:
        return self.stops_with(subprocess.Popen([*self.command_prefix, *_cli(*args)], stdout=self._log,
                                                stderr=self._log))

    def stops_with(self, process: subprocess.Popen) -> subprocess.Popen:
        """`process` is stopped when the node is (first, if it started last): a
        run cut short, by an interrupt or a failure, leaves no process behind."""
        self._daemons.append(process)
        return process

    def producer(self, *args: str) -> int:
        """Start a producer daemon of this node with `args`; its index."""
        args = ("producer", "--broker-endpoint", self.endpoints["producer"], "--vocab-size", str(self.vocab_size),
                "--metrics-port", "0", "--log-level", "warning", *args)
        self._producers.append((self._start(*args), args))
        self.producer_starts += 1
        return len(self._producers) - 1

    def kill_producer(self, index: int) -> None:
        daemon, _ = self._producers[index]
        daemon.kill()
        daemon.wait()
        self._killed.add(index)

    def restart_producer(self, index: int, *more_args: str) -> None:
        """Start producer `index` again with its arguments (and `more_args`, which win)."""
        _, args = self._producers[index]
        self._producers[index] = (self._start(*args, *more_args), args)
        self.producer_starts += 1
        self._killed.discard(index)

    @property
    def producer_count(self) -> int:
        return len(self._producers)

    @property
    def producers_exited(self) -> bool:
        """Every producer process has exited, however it ended (`producers_done` also judges how)."""
        return all(daemon.poll() is not None for daemon, _ in self._producers)

    @property
    def producers_done(self) -> bool:
        """Every producer exited; raises if one did not exit cleanly (one killed on purpose is done)."""
        for index, (daemon, _) in enumerate(self._producers):
            if daemon.poll() is None:
                return False
            if daemon.returncode != 0 and index not in self._killed:
                raise self.failed(f"a producer not killed on purpose must exit with 0, got {daemon.returncode}")
        return True

    def finish_producers(self, *, stop: bool = False) -> None:
        """Wait for every producer to exit (after a SIGTERM when `stop`);
        raises if one did not exit cleanly."""
        if stop:
            for daemon, _ in self._producers:
                daemon.send_signal(signal.SIGTERM)
        for daemon, _ in self._producers:
            daemon.wait(60)
        assert self.producers_done

    def failed(self, message: str, lines: int = 40) -> DaemonFailed:
        """`message` with the tail of daemons.log: the work folder goes with the node."""
        if self._log is not None:
            self._log.flush()
        tail = (self.work / "daemons.log").read_bytes().decode(errors="replace").splitlines()[-lines:]
        return DaemonFailed(message + f"; the last lines of {self.work / 'daemons.log'}:\n" + "\n".join(tail))

    def __exit__(self, *exc) -> None:
        if self.admin is not None:
            self.admin.__exit__(None, None, None)
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(30)
                except subprocess.TimeoutExpired:
                    daemon.kill()
        if self._log is not None:
            self._log.close()
        if not self.keep_data:
            shutil.rmtree(self.work, ignore_errors=True)


class Trainer:
    """The mock trainer: `dp_size` rank processes fanning in from the
    node's broker, each keeping its ledger. `restart` starts a fresh group
    (new rendezvous, new consumer) after one was lost, as a job supervisor
    would. `endpoint` may name several brokers (the source rank's consumer
    fans in from all of them); `command_prefix` comes before each rank's
    command line (as the node's daemons'), `rank_args` (e.g. CURVE keys) after it."""

    def __init__(self, node: LoopbackNode, *, dp_size: int, batch_size: int, ledgers: Path,
                 endpoint: str | Sequence[str] | None = None, command_prefix: Sequence[str] = (),
                 rank_args: Sequence[str] = ()):
        self.node, self.dp_size, self.batch_size, self.ledgers = node, dp_size, batch_size, ledgers
        self.endpoint = endpoint  # where the ranks reach the broker: its consumer endpoint unless given
        self.command_prefix = tuple(command_prefix)
        self.rank_args = tuple(rank_args)
        self.stop_file = node.work / "trainer.stop"
        self.generation = 0
        self.ranks: list[subprocess.Popen] = []

    def start(self, *, die_before_commit: int = 0, die_after_commit: int = 0, die_before_seal: int = 0,
              step_seconds: float = 0.0) -> None:
        self.generation += 1
        init = self.node.work / f"gloo-{self.generation}"
        endpoint = self.endpoint or self.node.endpoints["consumer"]
        endpoints = [arg for one in ([endpoint] if isinstance(endpoint, str) else endpoint) for arg in ("--endpoint", one)]
        self.ranks = [self.node.stops_with(subprocess.Popen(
            [*self.command_prefix, sys.executable, "-m", "rollstream.app.demo_rank", "--rank", str(rank),
             "--world", str(self.dp_size), "--init-file", str(init), *endpoints, "--batch-size", str(self.batch_size),
             "--vocab-size", str(self.node.vocab_size), "--ledger", str(self.ledgers / f"rank-{rank}.jsonl"),
             "--stop-file", str(self.stop_file), "--checkpoint-dir", str(self.node.work / "checkpoints"),
             "--step-seconds", str(step_seconds), *self.rank_args,
             *(["--die-before-commit", str(die_before_commit)] if rank == 0 and die_before_commit else []),
             *(["--die-after-commit", str(die_after_commit)] if rank == 0 and die_after_commit else []),
             *(["--die-before-seal", str(die_before_seal)] if rank == 0 and die_before_seal else [])],
            stdout=self.node._log, stderr=self.node._log)) for rank in range(self.dp_size)]

    def wait_welcomed(self, timeout: float) -> None:
        """Until the broker counts the trainer's consumer (its ranks took a few seconds to start)."""
        deadline = Clock.monotonic() + timeout
        while (_status(self.node) or {}).get("consumers", 0) < 1:
            if self.lost:
                raise self.node.failed(f"every trainer rank must run until the trainer connects, got exit statuses "
                                       f"{[rank.poll() for rank in self.ranks]}")
            if Clock.monotonic() > deadline:
                raise TimedOut(f"the trainer must connect within {timeout} s, the broker counts no consumer; "
                               f"see {self.node.work / 'daemons.log'}")
            time.sleep(0.1)

    @property
    def lost(self) -> bool:
        """A rank died (the rest of its group cannot go on without it)."""
        return any(rank.poll() not in (None, 0) for rank in self.ranks)

    def signal(self, signum: int) -> None:
        """Send every rank `signum` (SIGSTOP and SIGCONT: a trainer that stalls, then goes on)."""
        for rank in self.ranks:
            rank.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL every rank still running and reap them all."""
        for rank in self.ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait()

    def restart(self, **faults) -> None:
        """A fresh group (resuming from the latest checkpoint), with `start`'s `faults`."""
        self.kill()
        self.start(**faults)

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the source rank to stop after its last batch; every rank then exits."""
        self.stop_file.touch()
        for rank in self.ranks:
            try:
                rank.wait(timeout)
            except subprocess.TimeoutExpired:
                rank.kill()
                rank.wait()
        if any(rank.returncode != 0 for rank in self.ranks):
            raise self.node.failed(f"every trainer rank must exit with 0, got {[r.returncode for r in self.ranks]}")


@dataclass
class Chaos:
    """When `--chaos` strikes, by the share of planned trajectories acked
    so far (so it lands during the run whatever the machine's speed)."""

    broker_kills_at: tuple[float, ...] = (0.15, 0.4, 0.65)
    # producer 0 is killed once it sent this share of its plan, in the middle of a trajectory, and restarted with its
    # spool: it continues what it had open
    producer_kill_at: float | None = 0.3
    trainer_kill_before_commit: int = 2  # the source rank dies just before this commit (0: never)
    # ... and, restarted from its checkpoint, right after this commit of its new lineage (0: never): between a
    # commit and the next checkpoint, so the next start resumes and trains the batches since again
    trainer_kill_after_commit: int = 2
    done: list[str] = field(default_factory=list)  # the faults injected, in order

    def due(self, acked_share: float, producer_share: float) -> list[str]:
        """Faults due now and not yet injected: the broker's by the share of
        the plan acked, the producer's by the share of its own plan it sent."""
        due = [f"broker-{i}" for i, share in enumerate(self.broker_kills_at)
               if acked_share >= share and f"broker-{i}" not in self.done]
        if self.producer_kill_at is not None and producer_share >= self.producer_kill_at and "producer" not in self.done:
            due.append("producer")
        return due


@dataclass
class Counts:
    """Counts the demo shows while it runs."""

    produced: int = 0
    acked: int = 0
    merged: int = 0
    delivered: int = 0
    committed: int = 0
    retried: int = 0  # trajectories discarded by an `abort` and produced again (not a stage)
    late_rewards: int = 0  # rewards that came after their trajectory's end (not a stage)
    continued: int = 0  # trajectories a restarted producer took up where they stood, as its ledger says (not a stage)


class Pipeline:
    """A node's synthetic producers and a trainer, all keeping ledgers,
    watched: `poll` reads what happened since the last poll, `drained`
    says whether everything acknowledged has left the broker, `finish`
    stops the trainer and asks the checker. The demo and the fault suite
    compose their runs from it."""

    def __init__(self, node: LoopbackNode, *, dp_size: int = 2, batch_size: int = 4, trainer_endpoint: str | None = None,
                 rank_args: Sequence[str] = ()):
        self.node = node
        self.ledgers = node.work / "ledgers"
        self.ledgers.mkdir(exist_ok=True)
        self.trainer = Trainer(node, dp_size=dp_size, batch_size=batch_size, ledgers=self.ledgers,
                               endpoint=trainer_endpoint, rank_args=rank_args)
        self.records: list[dict] = []
        self.counts = Counts()
        self.status: dict | None = None
        self.dead: list[dict] = []
        self._reader = LedgerReader([self.ledgers])
        self._counters = _BrokerCounters()
        self._acked: set[str] = set()  # counted as each poll reads new records, not over all of them again
        # `node.producer_starts` when the last poll began with every producer exited, else None (see `idle`).
        self._exited_before_poll: int | None = None
        self._committed: set[str] = set()
        # Per producer id, as its ledger says: the trajectories it ended (sent), and those it issued and has not ended.
        self.ended: defaultdict[str, set[str]] = defaultdict(set)
        self.under_way: defaultdict[str, set[str]] = defaultdict(set)
        self._resumes = 0  # trainer starts that resumed from a checkpoint (each restart does: there is one at step 0)
        # The source rank's last committed and last sealed step (a resume goes back to its checkpoint's): the
        # trainer seals every step, so a commit not yet sealed is one a restart may have to train again.
        self._committed_step = self._sealed_step = 0

    def add_producer(self, index: int, *, trajectories: int, turns: int = 3, group_size: int = 4,
                     abort_rate: float = 0.1, retry_rate: float = 0.1, endpoint: str | None = None,
                     extra: tuple[str, ...] = ()) -> int:
        """Start synthetic producer `index` (its own id, spool and ledger); its node index."""
        return self.node.producer(
            "--source", "synthetic", "--producer-id", f"demo-producer-{index}", "--trajectories", str(trajectories),
            "--turns", str(turns), "--group-size", str(group_size), "--abort-rate", str(abort_rate),
            "--retry-rate", str(retry_rate), "--seed",
            str(index), "--spool-dir", str(self.node.work / f"spool-{index}"),
            "--ledger", str(self.ledgers / f"producer-{index}.jsonl"),
            *(("--broker-endpoint", endpoint) if endpoint else ()), *extra)

    def poll(self) -> None:
        # Looked at before anything is read: once every producer has exited, the ledgers read below hold every
        # ack there will be and the broker's status every trajectory a producer sent. One that exits while this
        # poll reads (or later) may have written acks this poll missed and sent trajectories its status missed.
        node = self.node
        self._exited_before_poll = node.producer_starts if node.producers_exited else None
        self.read_records()
        self.status = _status(self.node)
        counters = self._counters.update(self.status)
        counts = self.counts
        counts.merged = counters["frames.end.applied"]
        # trained by the trainer: gone, or kept as trained until a checkpoint is sealed
        counts.delivered = counters["trajectories.delivered"] + (self.status or {}).get("unsealed", 0)
        counts.retried = counters["trajectories.aborted"]
        counts.late_rewards = counters["frames.reward.applied"]

    def read_records(self) -> None:
        """Read what the ledgers gained since, and count it."""
        new = self._reader.read_new()
        self.records += new
        counts = self.counts
        for record in new:
            kind = record["kind"]
            if kind == "sent":
                counts.produced += 1
                self.ended[record["producer"]].add(record["id"])
                self.under_way[record["producer"]].discard(record["id"])
            elif kind == "acked" and (record["applied"] or record.get("duplicate")):
                self._acked.add(record["id"])
            elif kind == "committed":
                self._committed.add(record["id"])
                if record.get("rank") == 0:
                    self._committed_step = record["step"]
            elif kind == "sealed":
                self._sealed_step = record["step"]
            elif kind == "taken_up" and record["action"] == "continue":
                counts.continued += 1
            elif kind == "issued" and record["id"] not in self.ended[record["producer"]]:
                self.under_way[record["producer"]].add(record["id"])
            elif kind == "resumed":
                self._resumes += 1
                self._committed_step = self._sealed_step = record["from_step"]
        counts.acked, counts.committed = len(self._acked), len(self._committed)

    @property
    def idle(self) -> bool:
        """The producers are done and the broker holds nothing open or still to
        deliver, as the last `poll` read them: every producer had exited
        before that poll read the ledgers and the broker's status, and none
        was started since, so those reads are all there will be of them. (A
        producer that finishes after a poll's reads, while a broker restart
        or a busy machine holds the harness up, acked trajectories that poll
        never saw, and the broker holds them still to deliver.)"""
        status = self.status
        return (status is not None and self.node.producers_done and self._exited_before_poll == self.node.producer_starts
                and not (status["open"] or broker_backlog(status)))

    @property
    def backlog(self) -> int:
        """What the broker still has to deliver (`broker_backlog`); 1 while its status is unknown."""
        return 1 if self.status is None else broker_backlog(self.status)

    @property
    def drained(self) -> bool:
        """Idle, every acked trajectory committed or dead-lettered, the
        trainer's last commit sealed, the trainer alive and a restarted
        trainer resumed: until a trainer that died after a commit is
        restarted and has resumed, what it must train again looks trained."""
        if (not self.idle or self._sealed_step < self._committed_step or self.trainer.lost
                or self._resumes < self.trainer.generation - 1):
            return False
        try:
            self.dead = self.node.dead_letters()
        except AdminError:  # a broker too busy to answer now: asked again after the next poll
            return False
        return not check(self.records, self.dead, broker_backlog=1).unseen

    def run(self, timeout: float, each: Callable[[], None] | None = None) -> bool:
        """Poll (calling `each` after every poll) until drained or `timeout`
        seconds passed; whether it drained."""
        deadline = Clock.monotonic() + timeout
        while Clock.monotonic() < deadline:
            self.poll()
            if each is not None:
                each()
            if self.drained:
                return True
            time.sleep(0.2)
        return False

    def finish(self):
        """Stop the trainer and read the last records; the checker's report."""
        self.trainer.stop()
        self.poll()
        self.dead = self.node.dead_letters()
        return check(self.records, self.dead, broker_backlog=self.backlog)


class _BrokerCounters:
    """The broker's counters summed over its restarts (each restart starts them at 0)."""

    def __init__(self) -> None:
        self.before: Counter = Counter()
        self.last: dict[str, int] = {}

    def update(self, status: dict | None) -> Counter:
        if status is not None:
            now = status["counters"]
            if any(now.get(key, 0) < value for key, value in self.last.items()):  # a new broker
                self.before.update(self.last)
            self.last = now
        return self.before + Counter(self.last)


def _status(node: LoopbackNode) -> dict | None:
    if node.broker is None or node.admin is None or node.broker.poll() is not None:
        return None
    try:
        return node.admin.status()
    except AdminError:  # restarting
        return None


def end_runs(node: LoopbackNode, runs: Iterable[str], timeout: float) -> int:
    """Tell the node's broker that each trainer run in `runs` is over, so it
    reclaims all the run trained (`end_run`), and wait (at most `timeout`
    seconds) until its archive holds it: the status says nothing waits.
    How many trajectories the ends reclaimed.

    The status's `archive` is as the broker's last housekeeping pass found
    it, which may precede the ends: only a pass after them counts, one that
    archived rows since (the `archive_rows` counter moved) or one of a
    broker started since (a restart reads the store afresh). When the ends
    reclaimed nothing, the last pass's word is taken."""
    assert node.admin is not None and node.broker is not None, "the broker answers once the node is entered"
    runs = sorted(runs)
    reclaimed = sum(node.admin.end_run(run) for run in runs)
    broker = node.broker
    before = node.admin.status()["counters"].get("archive_rows", 0)
    deadline = Clock.monotonic() + timeout
    while True:
        status = _status(node) or {}
        archive = status.get("archive")
        if archive is not None:
            moved = status["counters"].get("archive_rows", 0) - before
            after_the_ends = node.broker is not broker or moved > 0 or not reclaimed
            if after_the_ends and archive["waiting"] == 0 and archive["writing"] == 0 and archive["lacking"] == 0:
                return reclaimed
        if Clock.monotonic() > deadline:
            raise ArchiveBehind(f"the archive must hold what runs {runs} trained within {timeout} s of their end "
                                f"({reclaimed} reclaimed): expected 0 waiting, 0 being written and 0 segments lacking, got "
                                f"{archive or 'no archive status'}; see {node.work / 'daemons.log'}")
        time.sleep(0.1)


def archived_rows(directory: str | Path, runs: Iterable[str]) -> int:
    """The rows an archive (docs/archive.md) holds of what the trainer runs `runs` trained."""
    import pyarrow.dataset as ds  # the archive extra: only a demo with an archive reads one

    wanted = sorted(runs)
    if not wanted or not Path(directory).exists():
        return 0
    archive = ds.dataset(directory, format="parquet", partitioning="hive")
    return archive.count_rows(filter=ds.field("run").isin(wanted))


def inject_due(faults: Chaos, pipeline: Pipeline, plan: int) -> None:
    """Inject the faults now due; restart what they killed."""
    node = pipeline.node
    sent = len(pipeline.ended["demo-producer-0"])
    for fault in faults.due(pipeline.counts.acked / plan, sent / (plan / node.producer_count)):
        if fault.startswith("broker"):
            node.kill_broker()
            node.restart_broker()
        else:
            pipeline.read_records()  # as the ledger stands now (a broker restart may have come first)
            if not pipeline.under_way["demo-producer-0"]:
                continue  # killed while it has trajectories under way, which its restart takes up
            node.kill_producer(0)
            # under the same id and spool: its spooled frames go first, then what it had open goes on, and its
            # prompt cursor issues the rest of its plan
            node.restart_producer(0)
        faults.done.append(fault)
    if pipeline.trainer.lost:
        first = "trainer-source" not in faults.done
        faults.done.append("trainer-source" if first else "trainer-resumed")
        pipeline.trainer.restart(die_after_commit=faults.trainer_kill_after_commit if first else 0)



