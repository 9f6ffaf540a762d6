"""A broker daemon in a subprocess on ipc:// endpoints in a temp dir, for
integration tests. Readiness is checked with a raw admin `status` call."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import zmq
import zmq.auth


class BrokerProcess:
    def __init__(self, directory: Path, **flags):
        self.directory = Path(directory)
        self.producer = f"ipc://{self.directory}/producer.sock"
        self.consumer = f"ipc://{self.directory}/consumer.sock"
        self.admin = f"ipc://{self.directory}/admin.sock"
        self.data_dir = self.directory / "data"
        self.flags = {"metrics_port": 0, "heartbeat_interval": 0.5, **flags}
        self.proc: subprocess.Popen | None = None
        self.log_path = self.directory / "broker.log"
        self.admin_keys: tuple[Path, Path] | None = None  # (own .key_secret, the broker's .key) for a CURVE broker

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "rollstream.app.cli", "broker",
                "--producer-endpoint", self.producer, "--consumer-endpoint", self.consumer,
                "--admin-endpoint", self.admin, "--data-dir", str(self.data_dir)]
        for key, value in self.flags.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        return args

    def start(self, timeout: float = 30.0, preexec_fn=None) -> "BrokerProcess":
        """Start it and wait until it answers; with an `endpoints_file` flag
        (port 0 endpoints), the endpoints are then the ones it bound."""
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{self.log()}")
            endpoints_file = self.flags.get("endpoints_file")
            if endpoints_file is not None:
                if not Path(endpoints_file).exists():
                    time.sleep(0.05)
                    continue
                bound = json.loads(Path(endpoints_file).read_text())
                self.producer, self.consumer, self.admin = bound["producer"], bound["consumer"], bound["admin"]
            try:
                self.status(timeout=0.5)
                return self
            except TimeoutError:
                continue
        raise TimeoutError(f"broker did not answer within {timeout} s:\n{self.log()}")

    def _admin(self, request: dict, timeout: float) -> dict:
        """One raw admin request (no rollstream imports) and its decoded reply."""
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.admin_keys is not None:
            own_secret, server = self.admin_keys
            sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(own_secret)
            sock.curve_serverkey = zmq.auth.load_certificate(server)[0]
        sock.connect(self.admin)
        try:
            sock.send(msgpack.packb({"v": 1, **request}))
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"no reply to admin {request['type']}")
            return msgpack.unpackb(sock.recv())
        finally:
            sock.close()

    def status(self, timeout: float = 5.0) -> dict:
        return self._admin({"type": "status"}, timeout)

    def dead_letters(self, timeout: float = 5.0) -> list[dict]:
        return self._admin({"type": "dead_letters", "limit": 100_000}, timeout)["items"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 20.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __enter__(self) -> "BrokerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
