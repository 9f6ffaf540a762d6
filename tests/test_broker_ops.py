"""Operator-facing pieces: the metrics endpoint, structured logs, and the
shipped configuration files."""
import os
import socket
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import zmq
from broker_process import BrokerProcess

from rollstream.broker.settings import BrokerSettings
from rollstream.common.codec import decode, encode
from rollstream.common.config import load_toml
from rollstream.common.messages import BROKER_TO_PRODUCER, PRODUCER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn

ROOT = Path(__file__).resolve().parents[1]


def free_http_port() -> int:
    """A port free on 127.0.0.1 now, for the metrics endpoint (`--metrics-port 0`
    turns metrics off, so it cannot be left to the system as the broker's
    ZeroMQ endpoints are)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_metrics_endpoint_and_trajectory_ids_in_logs(tmp_path):
    port = free_http_port()
    with BrokerProcess(tmp_path, metrics_port=port) as broker:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(broker.producer)
        turn0 = Turn.build([5], [-0.1], supports=[[5, 6]], forced_tokens=[7])
        sock.send_multipart(encode_turn("traj-metrics", 0, turn0, seq=1, prompt_tokens=np.array([1], np.int32)))
        sock.send_multipart(encode_turn("traj-metrics", 1, Turn.build([8], [-0.2]), seq=2))  # replay gap
        sock.send_multipart([b"junk"])
        sock.send_multipart(encode(PRODUCER_TO_BROKER, "abort", {"seq": 3, "trajectory_id": "traj-metrics", "reason": "x"}))
        replies = [decode(sock.recv_multipart(), BROKER_TO_PRODUCER) for _ in range(4)]
        assert [r.type for r in replies] == ["ack", "ack", "nack", "ack"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'rollstream_broker_frames_total{outcome="applied",type="turn"} 1.0' in text
        assert 'rollstream_broker_replay_gaps_total{field="mask"} 1.0' in text
        assert 'rollstream_broker_nacks_total{code="malformed",endpoint="producer"} 1.0' in text
        assert 'rollstream_broker_trajectories_total{exit="aborted"} 1.0' in text
        assert "rollstream_broker_commit_seconds_bucket" in text
        log = broker.log()
    gap_lines = [line for line in log.splitlines() if "replay gap" in line]
    assert gap_lines and all("trajectory_id=traj-metrics" in line for line in gap_lines)
    assert any("trajectory aborted" in line and "trajectory_id=traj-metrics" in line for line in log.splitlines())


def test_shipped_broker_config_uses_only_known_keys():
    names = set(BrokerSettings.__dataclass_fields__)
    values = load_toml(ROOT / "deploy" / "systemd" / "broker.toml", names, "broker")
    assert values["sync"] == "normal" and values["metrics_port"] == 9464


def test_the_broker_never_imports_torch():
    import subprocess
    import sys

    code = (
        "import sys, click\n"
        "from rollstream.app.cli import main\n"
        "ctx = click.Context(main)\n"
        "main.get_command(ctx, 'broker'); main.get_command(ctx, 'status')\n"
        "import rollstream.broker.service, rollstream.broker.recovery\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_broker_keeps_freed_batch_buffers_instead_of_faulting_in_fresh_pages():
    """After `keep_freed_memory`, a freed 1 MB array's pages are reused by
    the next one: page faults per allocation drop from ~256 to ~0."""
    import platform
    import subprocess
    import sys

    import pytest

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt tuning is glibc's")
    code = (
        "import resource, sys, numpy as np\n"
        "from rollstream.broker.cli import keep_freed_memory\n"
        "def faults_per_alloc():\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    for i in range(50):\n"
        "        np.ones((1 << 20) + 4096 * i, np.uint8)  # growing: each is a new largest block\n"
        "    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50\n"
        "untuned = faults_per_alloc()\n"
        "assert keep_freed_memory()\n"
        "faults_per_alloc()  # the heap grows once\n"
        "tuned = faults_per_alloc()\n"
        "print(untuned, tuned)\n"
        "assert untuned > 100 and tuned < 0.1 * untuned, (untuned, tuned)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.slow
def test_a_taken_port_is_refused_at_start_naming_the_setting(tmp_path):
    """A port another process holds shows only when a daemon binds it: exit
    2 naming the setting, where it came from and the rule, no traceback;
    the broker's own endpoints as well as either daemon's metrics port."""
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ipc = ["--producer-endpoint", f"ipc://{tmp_path}/p", "--consumer-endpoint", f"ipc://{tmp_path}/c",
               "--admin-endpoint", f"ipc://{tmp_path}/a"]
        starts = [
            (["broker", "--data-dir", str(tmp_path / "data"), *ipc, "--metrics-port", str(port)],
             f"metrics_port must be a port no other process holds, got '127.0.0.1:{port}'", "flag --metrics-port"),
            (["producer", "--broker-endpoint", f"ipc://{tmp_path}/p", "--trajectories", "1", "--metrics-port", str(port)],
             f"metrics_port must be a port no other process holds, got '127.0.0.1:{port}'", "flag --metrics-port"),
            (["broker", "--data-dir", str(tmp_path / "data"), *ipc[2:], "--metrics-port", "0"],
             f"producer_endpoint must be a port no other process holds, got 'tcp://127.0.0.1:{port}'",
             "environment ROLLSTREAM_BROKER_PRODUCER_ENDPOINT"),
        ]
        for command, refusal, where in starts:
            env = {**os.environ, "ROLLSTREAM_BROKER_PRODUCER_ENDPOINT": f"tcp://127.0.0.1:{port}"}
            result = subprocess.run([sys.executable, "-m", "rollstream.app.cli", *command], capture_output=True,
                                    text=True, timeout=120, env=env)
            assert result.returncode == 2, (command, result.returncode, result.stderr[-2000:])
            assert f"{refusal}: Address already in use ({where}) [rule: free port]" in result.stderr, result.stderr[-2000:]
            assert "Traceback" not in result.stderr
