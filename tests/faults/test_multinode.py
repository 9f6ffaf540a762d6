"""Several nodes on one machine: two nodes, each a broker with
its synthetic producer daemons, and a trainer node (a `DistributedConsumer`
of 2 gloo ranks whose source consumer fans in from both brokers), each in
its own network namespace, so every pipeline byte crosses a real network
stack between addresses of its own, with CURVE on every socket (keys made
by `_curve`, one directory of allowed keys per socket, as the DaemonSet's
Secret lays them out).

The network, built by the `network` fixture with `ip`: four namespaces
(node a, node b, the trainer t, and a switch holding a bridge), one veth
pair per node between its namespace (`eth0`, an address of NET) and the
bridge. Nothing is created in the test's own namespace, and the only
addresses used are NET's (inside these namespaces) and loopback. The
brokers bind their node's address on fixed ports (nothing else uses them in
a fresh namespace); each broker's admin endpoint is an ipc:// socket in the
test's tmp dir (a file, no address), which is how the test, outside the
namespaces, reads status and dead letters. The ranks rendezvous through a
gloo file store and talk over the trainer's address (`GLOO_SOCKET_IFNAME`).

Composed from the harness `rollstream.app.harness` (`LoopbackNode` with a bind address
and an `ip netns exec` command prefix, `Pipeline` for each node's producers
and status, `Trainer` with both brokers' endpoints); the end-to-end checker
reads zero over every ledger and both brokers' dead letters, with node a's
broker SIGKILLed and restarted (same data dir, address and ports) mid-run
while node b goes on.

Runs when root and `ip netns` works (probed by adding and deleting a
namespace); skipped with the reason otherwise.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from consumer_helpers import clean

from rollstream.app.harness import VOCAB, LoopbackNode, Pipeline, Trainer
from rollstream.common.admin import AdminClient, AdminError
from rollstream.common.checker import LedgerReader, check
from rollstream.common.curve import KeyLayout

NET = "10.231.0"  # a /24 that exists only inside the namespaces this test creates
ADDRESSES = {"a": f"{NET}.1", "b": f"{NET}.2", "t": f"{NET}.3"}
PORTS = {"producer": 5555, "consumer": 5556}  # fixed: each broker has its namespace to itself
FAST_BROKER = ("--heartbeat-interval", "0.5")  # a lost consumer is noticed after 1.5 s
FAST_PRODUCER = ("--heartbeat-interval", "0.5", "--heartbeat-timeout", "2")
PRODUCERS = {"a": (0, 1), "b": (2, 3)}  # producer indices (ids demo-producer-N) per node
TRAJECTORIES = 16  # per producer, whole groups of 4
RATE = "5"  # trajectory starts per second and producer: about 3 s of production
KILL_AT = 8  # node a's broker is killed once this many of node a's trajectories are acked
OUTAGE_SECONDS = 2.0
OUTAGE_LIMIT = 30.0  # node a stays down at most this long waiting for node b to show progress
DRAIN_SECONDS = 90  # a run takes about 15 s on 2 cores; this is only the limit of a failing one


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` must succeed: expected exit 0, got {done.returncode}: "
                           f"{done.stderr.strip()}")


def _netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can), found by making one."""
    if os.geteuid() != 0:
        return f"needs root to create network namespaces: expected uid 0, got uid {os.geteuid()}"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` on PATH (.ci/run installs it when root): not found"
    probe = f"rs{os.getpid()}p{secrets.token_hex(2)}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` does not work here: {exc}"
    try:
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"bridges or veth pairs cannot be made in a namespace here: {exc}"
    finally:
        _ip("netns", "delete", probe)
    return None


class Network:
    """The namespaces and links; `exec_in(role)` is the command prefix of a
    process of that role's node. Names carry the pid and a random tag, so a
    leftover of a crashed run cannot collide."""

    def __init__(self):
        tag = f"rs{os.getpid()}{secrets.token_hex(2)}"
        self.namespaces = {role: f"{tag}-{role}" for role in (*ADDRESSES, "sw")}
        self.made: list[str] = []

    def build(self) -> None:
        switch = self.namespaces["sw"]
        for name in self.namespaces.values():
            _ip("netns", "add", name)
            self.made.append(name)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for role, address in ADDRESSES.items():
            namespace = self.namespaces[role]
            # Both ends are made from the switch's namespace: nothing ever appears in the test's own.
            _ip("-n", switch, "link", "add", f"to-{role}", "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("-n", switch, "link", "set", f"to-{role}", "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")  # the daemons' metrics listen on its loopback

    def exec_in(self, role: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.namespaces[role])

    def bytes_to(self, role: str) -> int:
        """Bytes the bridge sent down the veth to `role`'s namespace."""
        out = subprocess.run(["ip", "-n", self.namespaces["sw"], "-s", "-j", "link", "show", f"to-{role}"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return json.loads(out)[0]["stats64"]["tx"]["bytes"]

    def peers(self, role: str) -> set[str]:
        """The remote ends of the established TCP connections in `role`'s namespace."""
        out = subprocess.run([*self.exec_in(role), "ss", "-Htn", "state", "established"], capture_output=True,
                             text=True, check=True, timeout=30).stdout
        return {line.split()[-1] for line in out.splitlines() if line.strip()}

    def tear_down(self) -> None:
        """Delete every namespace made (their veths and the bridge go with them); raises if one stays."""
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        left = [name for name in self.made if name in listed.split()]
        assert not left, f"every namespace of the test must be deleted at the end: expected none left, got {left}"


@pytest.fixture
def network(request):
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    net = Network()
    request.addfinalizer(net.tear_down)  # before building: a half-built network is removed too
    net.build()
    return net


def _curve(keys: Path) -> dict[str, tuple[str, ...]]:
    """CURVE for every role, as the DaemonSet's Secret gives it: one broker key pair shared by both brokers, a
    producer key (both nodes' producers), the trainer's and the test's admin key, each allowed on its own socket
    only. Returns each role's flags; "admin" is the admin client's (own secret key, broker key)."""
    layout = KeyLayout.generate(keys, {"producers": "producer", "consumers": "trainer", "admin": "admin"})
    return {"broker": layout.broker_args(), "producer": layout.client_args("producer"),
            "rank": layout.client_args("trainer"), "admin": layout.client_keys("admin")}


def _log_tails(nodes: dict[str, LoopbackNode]) -> str:
    tails = []
    for name, node in nodes.items():
        lines = (node.work / "daemons.log").read_text(errors="replace").splitlines()[-30:]
        tails.append(f"--- node {name} (and, on node a, the trainer's ranks): last lines of daemons.log\n" + "\n".join(lines))
    return "\n".join(tails)


def test_two_nodes_and_a_trainer_in_their_own_network_namespaces(network, tmp_path):
    started = time.monotonic()
    (tmp_path / "keys").mkdir()
    curve = _curve(tmp_path / "keys")
    with contextlib.ExitStack() as stack:
        nodes: dict[str, LoopbackNode] = {}
        for name in PRODUCERS:
            nodes[name] = stack.enter_context(LoopbackNode(
                f"rs-multinode-{name}-", VOCAB, broker_args=(*FAST_BROKER, *curve["broker"]),
                admin_keys=(curve["admin"][0], curve["admin"][1]),  # the test's own status and dead-letter reads
                bind={**{kind: f"tcp://{ADDRESSES[name]}:{port}" for kind, port in PORTS.items()},
                      "admin": f"ipc://{tmp_path}/admin-{name}.sock"},
                command_prefix=network.exec_in(name)))
        for name, node in nodes.items():
            bound = {kind: node.endpoints[kind] for kind in PORTS}
            expected = {kind: f"tcp://{ADDRESSES[name]}:{port}" for kind, port in PORTS.items()}
            assert bound == expected, f"node {name}'s broker must bind its node address: expected {expected}, got {bound}"
            with AdminClient(node.endpoints["admin"], timeout=5.0) as plain:  # CURVE is on: a plain client is refused
                with pytest.raises(AdminError, match="CURVE is on at one end only"):
                    plain.status()
        pipelines = {name: Pipeline(node) for name, node in nodes.items()}  # each node's producers and status
        trainer_ledgers = tmp_path / "trainer-ledgers"
        trainer_ledgers.mkdir()
        # The trainer's rendezvous file, stop file and output live in node a's work dir (a shared tmp dir, not a
        # network path); its ranks run in the trainer's namespace and fan in from both brokers.
        trainer = Trainer(nodes["a"], dp_size=2, batch_size=2, ledgers=trainer_ledgers,
                          endpoint=[node.endpoints["consumer"] for node in nodes.values()],
                          command_prefix=(*network.exec_in("t"), "env", "GLOO_SOCKET_IFNAME=eth0"), rank_args=curve["rank"])
        stack.callback(trainer.kill)  # on any failure, before the nodes stop
        try:
            _run(network, nodes, pipelines, trainer, trainer_ledgers, curve["producer"])
        except BaseException:
            print(_log_tails(nodes))
            raise
    print(f"several nodes: {time.monotonic() - started:.1f} s")


def _run(network: Network, nodes: dict[str, LoopbackNode], pipelines: dict[str, Pipeline], trainer: Trainer,
         trainer_ledgers: Path, producer_curve: tuple[str, ...]) -> None:
    trainer.start()
    deadline = time.monotonic() + 120
    while not all(pipeline.status and pipeline.status["consumers"] >= 1 for pipeline in pipelines.values()):
        assert not trainer.lost and time.monotonic() < deadline, (
            f"the trainer's consumer must reach both brokers within 120 s: expected 1 consumer on each, got "
            f"{ {name: (p.status or {}).get('consumers') for name, p in pipelines.items()} }, ranks lost {trainer.lost}")
        time.sleep(0.2)
        for pipeline in pipelines.values():
            pipeline.poll()
    brokers = {f"{ADDRESSES[name]}:{PORTS['consumer']}" for name in nodes}
    assert brokers <= network.peers("t"), (f"the trainer's namespace must hold TCP connections to both brokers' node "
                                           f"addresses: expected {sorted(brokers)}, got {sorted(network.peers('t'))}")
    for name, indices in PRODUCERS.items():
        for index in indices:
            pipelines[name].add_producer(index, trajectories=TRAJECTORIES,
                                         extra=("--rate", RATE, *FAST_PRODUCER, *producer_curve))

    reader = LedgerReader([trainer_ledgers])
    trainer_records: list[dict] = []

    def poll() -> list[dict]:
        for pipeline in pipelines.values():
            pipeline.poll()
        trainer_records.extend(reader.read_new())
        return [*pipelines["a"].records, *pipelines["b"].records, *trainer_records]

    def committed_of(name: str) -> int:
        ids = {r["id"] for r in pipelines[name].records if r["kind"] == "sent"}
        return len({r["id"] for r in trainer_records if r["kind"] == "committed"} & ids)

    # Node a's broker dies mid-run and comes back on its data dir, address and ports; node b goes on meanwhile.
    deadline = time.monotonic() + 120
    while pipelines["a"].counts.acked < KILL_AT:
        poll()
        assert time.monotonic() < deadline, (f"node a must ack {KILL_AT} trajectories within 120 s before its broker "
                                             f"is killed: got {pipelines['a'].counts.acked}")
        time.sleep(0.1)
    nodes["a"].kill_broker()
    before = pipelines["b"].counts.acked, committed_of("b")
    outage_ends, deadline = time.monotonic() + OUTAGE_SECONDS, time.monotonic() + OUTAGE_LIMIT
    while True:  # down for OUTAGE_SECONDS at least, and until node b shows it went on (on a loaded machine, longer)
        time.sleep(0.1)
        poll()
        during = pipelines["b"].counts.acked - before[0], committed_of("b") - before[1]
        if time.monotonic() >= deadline or (time.monotonic() >= outage_ends and min(during) > 0):
            break
    nodes["a"].restart_broker()
    assert nodes["a"].endpoints["producer"] == f"tcp://{ADDRESSES['a']}:{PORTS['producer']}"
    assert during[0] > 0 and during[1] > 0, (
        f"node b must go on while node a's broker is down: expected trajectories acked and committed during the "
        f"outage (up to {OUTAGE_LIMIT} s), got {during[0]} acked, {during[1]} committed")

    def drained() -> bool:
        records = poll()
        if not all(pipeline.idle for pipeline in pipelines.values()):
            return False
        dead = [item for node in nodes.values() for item in node.dead_letters()]
        return not check(records, dead, broker_backlog=1).unseen

    deadline = time.monotonic() + DRAIN_SECONDS
    while not (done := drained()) and time.monotonic() < deadline:
        time.sleep(0.2)
    trainer.stop()
    records = poll()
    dead = [item for node in nodes.values() for item in node.dead_letters()]
    backlog = sum(pipeline.backlog for pipeline in pipelines.values())
    report = check(records, dead, broker_backlog=backlog)
    planned = sum(len(indices) for indices in PRODUCERS.values()) * TRAJECTORIES
    assert done, (f"every acked trajectory of both nodes must be committed or dead-lettered within {DRAIN_SECONDS} s: "
                  f"got {report.summary()}, statuses { {n: p.status for n, p in pipelines.items()} }")
    assert report.counts() == clean(report), f"the checker must read zero over both nodes: got {report.summary()}"
    assert report.acked == report.committed == planned, (
        f"every planned trajectory of both nodes must be acked and committed once: expected {planned}, "
        f"got {report.acked} acked, {report.committed} committed")
    # What the trainer committed crossed the bridge: at least its sampling supports (CSR) came down its veth.
    committed = {r["id"]: r for r in trainer_records if r["kind"] == "committed"}
    csr_bytes = sum(4 * r["support_ids"] + 8 * (r["tokens"] + 1) for r in committed.values())
    assert network.bytes_to("t") >= csr_bytes, (
        f"the trainer's batches must reach it over its veth: expected at least {csr_bytes} bytes (the committed "
        f"supports), got {network.bytes_to('t')}")
    print(f"bytes down the veths: { {role: network.bytes_to(role) for role in ADDRESSES} }, committed CSR {csr_bytes}")
    for name in PRODUCERS:
        assert committed_of(name) == len(PRODUCERS[name]) * TRAJECTORIES, (
            f"the trainer must commit node {name}'s trajectories: expected {len(PRODUCERS[name]) * TRAJECTORIES}, "
            f"got {committed_of(name)}")
