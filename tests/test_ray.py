"""rollstream.ray on a real Ray cluster of two nodes on this machine
(`ray.cluster_utils.Cluster`, every Ray address loopback).

`start_brokers` puts a broker on each node; a producer actor on each node
finds its own node's broker with `local_broker()`; a two-rank trainer runs
in two Ray actors (one per node, gloo), its source consumer fanning in from
`all_brokers()`. Mid-run node a's broker process is SIGKILLed and its
supervising actor starts it again on the same data directory and ports;
the end-to-end checker then reads zero over every ledger and both brokers'
dead letters. Skipped with the reason when Ray is not installed or cannot
start here.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from consumer_helpers import clean

# Ray publishes its nodes' addresses: on Linux the machine's own, unless told it runs one machine alone. Read by
# Ray at import and inherited by every process it starts, so set before anything imports it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'rollstream[ray]'")

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from rollstream.common.admin import AdminClient  # noqa: E402
from rollstream.common.checker import check, read_records  # noqa: E402
from rollstream.common.config import ConfigError  # noqa: E402
from rollstream.common.errors import InvalidInput, InvalidState  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 151_936
TRAJECTORIES = 16  # per producer, whole groups of 4
# Seconds a wait allows before it gives up: only reached when something hangs, so generous for a busy machine
# (Ray actors that import torch start in tens of seconds there).
PATIENCE = 300
RATE = 4.0  # trajectory starts per second and producer: about 4 s of production
KILL_AT = 6  # node a's broker is killed once its producer has this many trajectories acked
BROKER_SETTINGS = {"vocab_size": VOCAB, "heartbeat_interval": 0.5, "metrics_port": 0, "log_level": "warning"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes (2 CPUs each) on loopback, the driver connected."""
    from ray.cluster_utils import Cluster

    try:
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1"})
        nodes.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        ray.init(address=nodes.address, _node_ip_address="127.0.0.1", namespace="rollstream-test",
                 log_to_driver=False)
        nodes.wait_for_nodes()
    except Exception as exc:  # Ray cannot start here (no /dev/shm, ports): say so rather than fail
        pytest.skip(f"a two-node Ray cluster cannot start here: {type(exc).__name__}: {exc}")
    # The actors below are defined in this module, which Ray's workers cannot import: send them by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


def _on(node_id: str) -> dict:
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


@ray.remote(num_cpus=1)
class ProducerActor:
    """A rollout worker: synthetic trajectories to its own node's broker, with a ledger."""

    def run(self, index: int, ledger: str, spool: str) -> dict:
        from rollstream.producer.client import AsyncProducer
        from rollstream.producer.settings import ProducerSettings
        from rollstream.producer.synthetic import SyntheticSource
        from rollstream.ray import local_broker

        where = local_broker()
        settings = ProducerSettings(broker_endpoint=where.producer, producer_id=f"ray-producer-{index}",
                                    trajectories=TRAJECTORIES, group_size=4, turns=3, rate=RATE, seed=index,
                                    vocab_size=VOCAB, heartbeat_interval=0.5, heartbeat_timeout=2.0)

        async def produce() -> int:
            producer = AsyncProducer(where.producer, settings.producer_id, vocab_size=VOCAB, ledger=ledger,
                                     spool_dir=spool, heartbeat_interval=0.5, heartbeat_timeout=2.0)
            await producer.start()
            try:
                await SyntheticSource(settings, settings.producer_id).run(producer, asyncio.Event())
            finally:
                left = await producer.close(60.0)
            return left

        left = asyncio.run(produce())
        return {"node_id": ray.get_runtime_context().get_node_id(), "broker_node": where.node_id, "unsettled": left}


@ray.remote(num_cpus=1)
class TrainerRank:
    """One data-parallel rank of the mock trainer (`rollstream.app.demo_rank`), in a Ray actor."""

    def run(self, rank: int, argv: list[str]) -> int:
        from rollstream.app import demo_rank

        demo_rank.main(["--rank", str(rank), *argv])
        return rank


def _acked(ledger: Path) -> int:
    if not ledger.exists():
        return 0
    return sum(1 for record in read_records([ledger]) if record["kind"] == "acked" and record.get("applied"))


def test_settings_and_data_dir_are_checked_before_anything_starts(cluster):
    import rollstream.ray as rsray

    with pytest.raises(ConfigError) as refused:
        rsray.start_brokers({"sync": "fast", "max_stalness": 2, "data_dir": "/srv/x"}, data_dir="/srv/{node_id}")
    message = str(refused.value)
    for expected in ("sync must be one of 'normal', 'full', got 'fast'", "did you mean max_staleness",
                     "data_dir must be left out"):
        assert expected in message, f"the refusal must name each broken rule: expected {expected!r} in {message!r}"
    with pytest.raises(InvalidInput, match="outside Ray's temporary folder"):
        rsray.start_brokers(BROKER_SETTINGS, data_dir="/tmp/ray/session_latest/rollstream")
    with pytest.raises(InvalidInput, match="absolute path"):
        rsray.start_brokers(BROKER_SETTINGS, data_dir="rollstream-data")
    assert rsray.all_brokers() == [], "a refused start must start no broker"
    with pytest.raises(InvalidState, match="start_brokers"):
        ray.get(ray.remote(num_cpus=0)(lambda: rsray.local_broker()).remote())


def test_a_broker_per_node_survives_a_kill_and_nothing_is_lost(cluster, tmp_path):
    import rollstream.ray as rsray

    started = time.monotonic()
    nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
    assert len(nodes) == 2, f"the cluster must have two live nodes, got {len(nodes)}"
    brokers = rsray.start_brokers(BROKER_SETTINGS, data_dir=str(tmp_path / "data-{node_id}"))
    try:
        _run(rsray, nodes, {b.node_id: b for b in brokers}, tmp_path)
    finally:
        codes = rsray.stop_brokers()
    assert codes == {node: 0 for node in nodes}, f"a stopped broker must exit cleanly (0), got {codes}"
    assert rsray.all_brokers() == [], "stop_brokers must leave no supervisor"
    print(f"ray, two nodes: {time.monotonic() - started:.1f} s")


def _run(rsray, nodes: list[str], brokers: dict, tmp_path: Path) -> None:
    assert sorted(brokers) == nodes, f"every node must get its own broker: expected {nodes}, got {sorted(brokers)}"
    for broker in brokers.values():
        assert broker.producer.startswith("tcp://127.0.0.1:") and broker.data_dir.endswith(broker.node_id), broker
    again = rsray.start_brokers(BROKER_SETTINGS, data_dir=str(tmp_path / "data-{node_id}"))
    assert {b.node_id: b for b in again} == brokers, "a second start must keep each node's running broker"

    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    stop_file = tmp_path / "trainer.stop"
    consumers = [arg for b in rsray.all_brokers() for arg in ("--endpoint", b.consumer)]
    trainer_argv = ["--world", "2", "--init-file", str(tmp_path / "gloo"), *consumers, "--batch-size", "2",
                    "--vocab-size", str(VOCAB), "--stop-file", str(stop_file),
                    "--checkpoint-dir", str(tmp_path / "checkpoints")]
    ranks = [TrainerRank.options(**_on(nodes[rank])).remote() for rank in range(2)]
    trained = [rank.run.remote(i, [*trainer_argv, "--ledger", str(ledgers / f"rank-{i}.jsonl")])
               for i, rank in enumerate(ranks)]
    deadline = time.monotonic() + PATIENCE
    while not all((status.get("broker") or {}).get("consumers", 0) >= 1 for status in rsray.brokers_status().values()):
        assert time.monotonic() < deadline, f"the trainer must reach both brokers within {PATIENCE} s: {rsray.brokers_status()}"
        time.sleep(0.2)

    producers = [ProducerActor.options(**_on(node)).remote() for node in nodes]
    produced = [p.run.remote(i, str(ledgers / f"producer-{i}.jsonl"), str(tmp_path / f"spool-{i}"))
                for i, p in enumerate(producers)]

    # Node a's broker is SIGKILLed mid-run; its supervisor starts it again on the same data dir and ports.
    victim = nodes[0]
    deadline = time.monotonic() + PATIENCE
    while _acked(ledgers / "producer-0.jsonl") < KILL_AT:
        assert time.monotonic() < deadline, f"node a's producer must have {KILL_AT} trajectories acked within {PATIENCE} s"
        ray.get(ray.wait([*produced, *trained], timeout=0.1)[0])  # one that ended early: its error, if any
    before = rsray.brokers_status()[victim]
    assert before["state"] == "running" and before["pid"], before
    os.kill(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + PATIENCE
    while (after := rsray.brokers_status()[victim])["restarts"] < 1 or after["state"] != "running" or not after["pid"]:
        assert time.monotonic() < deadline, f"the supervisor must restart the killed broker within {PATIENCE} s: {after}"
        time.sleep(0.2)
    assert after["pid"] != before["pid"] and after["last_exit"] == -signal.SIGKILL, (before, after)
    assert after["endpoints"] == before["endpoints"], "the restarted broker must bind the same endpoints"
    # Its log (both lives of it) beside its data directory, outside Ray's temporary folder; read through Ray.
    assert after["log"] == str(tmp_path / f"data-{victim}.supervisor" / "broker.log") and Path(after["log"]).is_file()
    logs = rsray.broker_logs(lines=5)
    assert sorted(logs) == nodes and all(isinstance(tail, str) for tail in logs.values()), logs

    results = ray.get(produced, timeout=PATIENCE)
    for i, result in enumerate(results):
        assert result["broker_node"] == result["node_id"] == nodes[i], (
            f"producer {i} must talk to its own node's broker: ran on {result['node_id']}, got {result['broker_node']}")
        assert result["unsettled"] == 0, f"producer {i} must settle every frame, {result['unsettled']} left"

    def backlog() -> int:
        reports = [status["broker"] for status in rsray.brokers_status().values()]
        return sum(report["queued"] + report["leased"] + report["open"] for report in reports)

    planned = 2 * TRAJECTORIES

    def committed() -> int:
        return len({record["id"] for record in read_records(sorted(ledgers.glob("*.jsonl"))) if record["kind"] == "committed"})

    # Drained, and the last batch's commit in a trainer's ledger; past the bound the checker says what is missing.
    deadline = time.monotonic() + PATIENCE
    while (backlog() or committed() < planned) and time.monotonic() < deadline:
        time.sleep(0.2)
    stop_file.touch()
    ray.get(trained, timeout=PATIENCE)

    dead = []
    for broker in rsray.all_brokers():
        with AdminClient(broker.admin, timeout=5.0) as admin:
            dead += admin.dead_letters(1000)
    records = read_records(sorted(ledgers.glob("*.jsonl")))
    report = check(records, dead, broker_backlog=backlog())
    assert report.counts() == clean(report), f"the checker must read zero over both nodes: got {report.summary()}"
    assert report.acked == report.committed == planned, (
        f"every planned trajectory must be acked and committed once: expected {planned}, "
        f"got {report.acked} acked, {report.committed} committed")


def test_a_broker_log_is_kept_once_and_begun_afresh_when_it_has_grown(tmp_path, monkeypatch):
    import rollstream.ray as rsray

    monkeypatch.setattr(rsray, "LOG_KEPT_BYTES", 10)
    log = tmp_path / "broker.log"
    assert rsray._rotated(log) == log and not log.exists()  # no log yet: nothing to keep
    log.write_text("short\n")
    rsray._rotated(log)
    assert log.read_text() == "short\n" and not (tmp_path / "broker.log.1").exists()  # under the size: kept writing
    log.write_text("the first life's lines\n")
    rsray._rotated(log)
    assert not log.exists() and (tmp_path / "broker.log.1").read_text() == "the first life's lines\n"
    log.write_text("the second life's lines\n")
    rsray._rotated(log)
    assert (tmp_path / "broker.log.1").read_text() == "the second life's lines\n"  # only the one before is kept
    assert rsray.supervisor_dir("/var/lib/rollstream/n1") == Path("/var/lib/rollstream/n1.supervisor")


def test_brokers_on_one_machine_each_get_a_free_metrics_port_and_stop_to_no_status(cluster, tmp_path):
    """docs/ray.md, "Trying it on one machine": settings that leave
    `metrics_port` out start a broker per node on one machine, each serving
    /metrics on a port of its own. After `stop_brokers()`, no node has a
    broker: `brokers_status()` is empty, as `all_brokers()` is."""
    import urllib.request

    import rollstream.ray as rsray

    settings = {key: value for key, value in BROKER_SETTINGS.items() if key != "metrics_port"}
    brokers = rsray.start_brokers(settings, data_dir=str(tmp_path / "data-{node_id}"), timeout=PATIENCE)
    try:
        ports = {node: status["metrics_port"] for node, status in rsray.brokers_status().items()}
        assert sorted(ports) == sorted(b.node_id for b in brokers) and len(set(ports.values())) == 2, ports
        for port in ports.values():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=PATIENCE) as page:
                assert b"rollstream_" in page.read()
    finally:
        codes = rsray.stop_brokers()
    assert sorted(codes) == sorted(ports) and set(codes.values()) == {0}, codes
    assert rsray.brokers_status() == {} and rsray.all_brokers() == []


def test_a_broker_that_refuses_its_settings_is_reported_at_once_naming_the_setting(cluster, tmp_path):
    """A metrics port another process holds: each broker exits 2 at its
    first start. `start_brokers` raises as soon as one has, with the
    broker's own words naming the setting, instead of restarting it until
    its timeout, and leaves no broker behind."""
    import socket

    import rollstream.ray as rsray

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        settings = {**BROKER_SETTINGS, "metrics_port": held.getsockname()[1]}
        with pytest.raises(InvalidState) as refused:
            rsray.start_brokers(settings, data_dir=str(tmp_path / "data-{node_id}"), timeout=PATIENCE)
    message = str(refused.value)
    for expected in ("refused its settings at its first start (exit status 2", "metrics_port must be a port no other "
                     "process holds", "[rule: free port]"):
        assert expected in message, f"expected {expected!r} in {message!r}"
    assert rsray.brokers_status() == {}, "a refused start must leave no broker"


def test_a_broker_dies_with_its_supervisor(cluster, tmp_path):
    import rollstream.ray as rsray

    brokers = rsray.start_brokers(BROKER_SETTINGS, data_dir=str(tmp_path / "data-{node_id}"))
    try:
        node = brokers[0].node_id
        pid = rsray.brokers_status()[node]["pid"]
        ray.kill(ray.get_actor(rsray.ACTOR_PREFIX + node, namespace=rsray.NAMESPACE))
        deadline = time.monotonic() + PATIENCE
        while _alive(pid):
            assert time.monotonic() < deadline, f"the broker (pid {pid}) must exit within {PATIENCE} s of its actor's death"
            time.sleep(0.1)
    finally:
        rsray.stop_brokers()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().split(") ", 1)[1][0] != "Z"


def test_rollstream_top_finds_every_nodes_broker(cluster, tmp_path):
    """`rollstream top --ray`, a process outside the job, joins the cluster and shows each node's broker."""
    import subprocess

    import rollstream.ray as rsray

    brokers = rsray.start_brokers(BROKER_SETTINGS, data_dir=str(tmp_path / "data-{node_id}"))
    try:
        shown = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "top", "--ray", "--ray-address",
                                cluster.address, "--once", "--interval", "0.3"], capture_output=True, text=True,
                               timeout=PATIENCE, env={**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "250"})
    finally:
        rsray.stop_brokers()
    assert shown.returncode == 0, shown.stderr[-2000:]
    for broker in brokers:
        assert f"{broker.node_id[:12]} {broker.admin}" in shown.stdout, (
            f"top must show node {broker.node_id[:12]}'s broker at {broker.admin}:\n{shown.stdout}")
    assert "total (2 of 2 answering)" in shown.stdout, shown.stdout
