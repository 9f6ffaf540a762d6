"""Fixtures the test modules share."""
from __future__ import annotations

import shutil
import tempfile

import pytest
from broker_process import BrokerProcess


@pytest.fixture
def brokers():
    """Start brokers (`brokers(lease_timeout=...)`), each in a short
    directory (ipc:// paths have a length limit); all stopped at the end."""
    started = []

    def start(lease_timeout: float = 30.0):
        broker = BrokerProcess(tempfile.mkdtemp(prefix="rsc", dir="/tmp"), lease_timeout=lease_timeout,
                               heartbeat_interval=0.2).start()
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.__exit__(None, None, None)
        shutil.rmtree(broker.directory, ignore_errors=True)
