"""Brokers on a Ray cluster: one per node, each the real `rollstream broker`
process under a supervising actor pinned to its node.

`start_brokers` checks the settings as the broker's own command line checks
them, then places a `BrokerSupervisor` on every live node (hard node
affinity, 0 CPUs: the broker is a daemon beside the node's work, as under
systemd). The supervisor runs the broker in its own process group with a
parent-death signal, so it never outlives its actor, and starts it again
after a crash on the same data directory and ports, so what it acknowledged
survives as it does under systemd; the broker's lock on its data directory
makes a second broker on it refuse. Producers ask `local_broker()` for
their own node's broker; a consumer fans in from `all_brokers()`.

Only endpoints and status reports cross Ray (plain strings, numbers and
maps); the data path stays on ZeroMQ. docs/ray.md is the recipe.
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("rollstream.ray needs Ray: pip install 'rollstream[ray]'") from exc

from rollstream.broker.cli import broker as broker_command
from rollstream.broker.settings import BrokerSettings
from rollstream.common.admin import ENDPOINT_NAMES, AdminClient, AdminError, read_endpoints_file, write_endpoints_file
from rollstream.common.clock import Clock
from rollstream.common.config import ConfigError, Problem, unknown_expected
from rollstream.common.errors import InvalidInput, InvalidState

NAMESPACE = "rollstream"  # the Ray namespace of the supervisors, whatever the driver's
ACTOR_PREFIX = "rollstream-broker-"  # a supervisor's name: this and its node id
DEFAULT_DATA_DIR = "/var/lib/rollstream/{node_id}"
# Settings rollstream.ray gives each node's broker itself (the arguments of `start_brokers` say how).
PER_NODE = {"producer_endpoint": "ports=", "consumer_endpoint": "ports=", "admin_endpoint": "ports=",
            "endpoints_file": "(kept by the supervisor)", "data_dir": "data_dir="}
SETTINGS_WHERE = "start_brokers settings"
RESTART_DELAYS = (0.2, 0.5, 1.0, 2.0, 5.0)  # seconds before each restart after a crash; the last repeats
STABLE_AFTER = 30.0  # seconds a broker must run before its next crash counts from the first delay again
LOG_KEPT_BYTES = 64 << 20  # a broker log this large when its broker (re)starts is kept as broker.log.1, begun afresh
REFUSED = 2  # the exit status of a broker whose settings were refused (a ConfigError)
METRICS_PORT_FLAG = "--metrics-port="  # as `broker_arguments` writes it
METRICS_PORT_VARIABLE = "ROLLSTREAM_BROKER_METRICS_PORT"  # the broker's command reads it for that setting

log = logging.getLogger("rollstream.ray")


@dataclass(frozen=True)
class BrokerEndpoints:
    """Where one node's broker listens."""

    node_id: str
    producer: str
    consumer: str
    admin: str
    data_dir: str


def broker_arguments(settings: Mapping[str, Any] | None) -> list[str]:
    """`rollstream broker` flags for `settings` (broker setting names, as
    in its TOML file), checked as the command checks them: every unknown
    key, value of the wrong type and broken rule at once, in a
    `ConfigError`. The per-node keys (`PER_NODE`) are refused."""
    settings = dict(settings or {})
    names = {f.name for f in fields(BrokerSettings)}
    problems = [Problem(key, SETTINGS_WHERE, f"left out: rollstream.ray sets it per node (see {PER_NODE[key]})",
                        repr(value), "per-node setting") for key, value in settings.items() if key in PER_NODE]
    problems += [Problem(key, SETTINGS_WHERE, unknown_expected(key, names, "a broker setting"), "an unknown key",
                         "known key") for key in settings if key not in names]
    args = [f"--{key.replace('_', '-')}={_flag_value(value)}" for key, value in settings.items()
            if value is not None and key in names and key not in PER_NODE]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the dry run's "configuration ok"
            broker_command.main([*args, "--check-config"], prog_name="rollstream broker", standalone_mode=False)
    except ConfigError as error:
        problems += [replace(problem, where=SETTINGS_WHERE) for problem in error.problems]
    if problems:
        raise ConfigError(problems)
    return args


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def check_data_dir(template: str, ray_temp_dir: str) -> None:
    """A broker's data directory must outlive Ray's session: an absolute
    path (an actor's working directory is inside the session) outside
    Ray's temporary folder, which a node's next session cleans."""
    if not os.path.isabs(template):
        raise InvalidInput(f"data_dir must be an absolute path on each node's local disk, got {template!r}")
    path = Path(template.split("{", 1)[0] or "/").resolve()
    temp = Path(ray_temp_dir).resolve()
    if path == temp or temp in path.parents:
        raise InvalidInput(f"data_dir must lie outside Ray's temporary folder {str(temp)!r} (a node's next session "
                           f"does not keep it), got {template!r}")


def _ray_temp_dir() -> str:
    """This process's Ray temporary folder (`/tmp/ray` unless Ray was told otherwise)."""
    node: Any = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    with contextlib.suppress(Exception):  # not connected yet, or a Ray whose private layout moved
        return node.get_temp_dir_path()
    return os.path.join(tempfile.gettempdir(), "ray")


def supervisor_dir(data_dir: str) -> Path:
    """Where a node's supervisor keeps its broker's log and the endpoints it
    bound: beside the data directory, so they outlive the node's temporary
    folder as the data does, and outside it (the data directory is the
    broker's own)."""
    data = Path(data_dir)
    return data.with_name(data.name + ".supervisor")


def _rotated(log: Path) -> Path:
    """`log`, moved to `<name>.1` (replacing the one before) once it holds
    `LOG_KEPT_BYTES`: what a broker starting now writes begins a new file."""
    with contextlib.suppress(FileNotFoundError):
        if log.stat().st_size >= LOG_KEPT_BYTES:
            log.replace(log.with_name(log.name + ".1"))
    return log


def _free_port() -> int:
    """A TCP port no process holds now: the system's pick for port 0."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _set_parent_death_signal() -> None:  # pragma: no cover - runs in the child between fork and exec
    """In the broker's process, before it runs: SIGTERM when the thread
    that started it (the supervisor's, alive as long as the actor) ends."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class BrokerSupervisor:
    """A Ray actor on one node: runs that node's broker, restarts it after
    a crash, stops it with the actor. Its methods answer while the broker
    runs (the actor is threaded)."""

    def __init__(self, node_id: str, args: list[str], data_dir: str, host: str, ports: dict[str, int],
                 admin_keys: tuple[str, str] | None = None):
        check_data_dir(data_dir, _ray_temp_dir())
        self.node_id, self.args, self.host, self.ports = node_id, list(args), host, dict(ports)
        self.data_dir = data_dir.format(node_id=node_id, node_ip=host)
        self.admin_keys = admin_keys
        self.work = supervisor_dir(self.data_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.state = "starting"
        self.restarts = 0
        self.last_exit: int | None = None
        self.process: subprocess.Popen | None = None
        remembered = self._remembered()
        self.endpoints: dict[str, str] | None = (None if remembered is None
                                                 else {name: remembered[name] for name in ENDPOINT_NAMES})
        self.metrics_port = self._metrics_port(remembered)
        self._has_run = remembered is not None  # a broker that ran here before is restarted whatever its exit
        self._ready = threading.Event()  # the broker bound its endpoints, or its first start was refused
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._supervise, name="rollstream-broker-supervisor", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"BrokerSupervisor(node={self.node_id[:12]}, data_dir={self.data_dir})"

    @property
    def _endpoints_file(self) -> Path:
        return self.work / "endpoints.json"

    @property
    def _bound_file(self) -> Path:
        """The endpoints the first broker bound, which every restart binds again (kept across actor restarts)."""
        return self.work / "bound.json"

    def _remembered(self) -> dict[str, str] | None:
        """What the broker that last ran on this data directory bound, if it was not stopped cleanly."""
        with contextlib.suppress(AdminError):
            bound = read_endpoints_file(str(self._bound_file))
            if bound.get("data_dir") == self.data_dir:
                return bound
        return None

    def _metrics_port(self, remembered: dict[str, str] | None) -> int | None:
        """The /metrics port this supervisor picks for its broker when
        neither the settings nor the broker's environment set one (None
        when they do): with the default, every broker on one machine would
        bind the same port and all but one refuse to start. A restart keeps
        the port picked before; a first start takes a free one."""
        if any(arg.startswith(METRICS_PORT_FLAG) for arg in self.args) or METRICS_PORT_VARIABLE in os.environ:
            return None
        kept = (remembered or {}).get("metrics_port", "")
        return int(kept) if kept.isdigit() else _free_port()

    def _command(self) -> list[str]:
        bind = self.endpoints or {name: f"tcp://{self.host}:{self.ports.get(name, 0)}" for name in ENDPOINT_NAMES}
        metrics = [] if self.metrics_port is None else [f"{METRICS_PORT_FLAG}{self.metrics_port}"]
        return [sys.executable, "-m", "rollstream.app.cli", "broker", *self.args, *metrics,
                f"--data-dir={self.data_dir}", f"--endpoints-file={self._endpoints_file}",
                *(f"--{name}-endpoint={bind[name]}" for name in ENDPOINT_NAMES)]

    def _supervise(self) -> None:
        """Start the broker, wait for it, start it again after a crash,
        until `stop`. A first start whose settings the broker refuses (exit
        status 2: a port another process holds, say) is not tried again:
        the same settings would be refused again, and `where` says so at
        once. Runs on one thread for the actor's life: the broker's
        parent-death signal follows this thread."""
        crashes = 0  # in a row, each within STABLE_AFTER of its start
        while not self._stopping.is_set():
            self._endpoints_file.unlink(missing_ok=True)
            with open(_rotated(self.work / "broker.log"), "ab") as output, self._lock:
                if self._stopping.is_set():
                    break
                self.process = subprocess.Popen(self._command(), stdout=output, stderr=subprocess.STDOUT,
                                                start_new_session=True, preexec_fn=_set_parent_death_signal)
            started = Clock.monotonic()
            while self.process.poll() is None and not self._ready.is_set() and not self._stopping.is_set():
                if self._endpoints_file.exists():
                    self._note_bound(read_endpoints_file(str(self._endpoints_file)))
                time.sleep(0.05)
            code = self.process.wait()
            if self._stopping.is_set():
                break
            if code == REFUSED and not self._has_run:
                self.last_exit, self.state = code, "failed"
                log.error("broker refused its settings at its first start; not starting it again",
                          extra={"node_id": self.node_id, "exit": code, "log": str(self.work / "broker.log")})
                self._ready.set()
                return
            crashes = 1 if Clock.monotonic() - started > STABLE_AFTER else crashes + 1
            self.restarts, self.last_exit, self.state = self.restarts + 1, code, "restarting"
            log.warning("broker exited; restarting it", extra={"node_id": self.node_id, "exit": code,
                                                               "restarts": self.restarts})
            self._ready.clear()
            self._stopping.wait(RESTART_DELAYS[min(crashes, len(RESTART_DELAYS)) - 1])
        self.state = "stopped"

    def _note_bound(self, endpoints: dict[str, str]) -> None:
        self.endpoints = {name: endpoints[name] for name in ENDPOINT_NAMES}
        metrics = {} if self.metrics_port is None else {"metrics_port": str(self.metrics_port)}
        write_endpoints_file(str(self._bound_file), {**self.endpoints, "data_dir": self.data_dir, **metrics})
        self.state, self._has_run = "running", True
        self._ready.set()

    def where(self, timeout: float = 60.0) -> dict[str, str]:
        """This node's broker endpoints (as `BrokerEndpoints` fields), once
        it has bound them; `InvalidState` with its log's tail if its first
        start was refused (at once) or it has not bound them within
        `timeout` seconds."""
        if not self._ready.wait(timeout):
            raise InvalidState(f"the broker on node {self.node_id} must bind its endpoints within {timeout} s; "
                               f"state {self.state}, {self.restarts} restart(s), last exit {self.last_exit}; "
                               f"its log ends:\n{self.log_tail()}")
        if self.state == "failed":
            raise InvalidState(f"the broker on node {self.node_id} refused its settings at its first start (exit "
                               f"status {self.last_exit}, a configuration error) and is not started again; its log "
                               f"names the setting:\n{self.log_tail()}")
        assert self.endpoints is not None
        return {"node_id": self.node_id, **self.endpoints, "data_dir": self.data_dir}

    def status(self) -> dict[str, Any]:
        """The supervisor's view (state, pid, restarts, last exit, endpoints)
        and the broker's own status report, or why it gave none."""
        process = self.process
        report: dict[str, Any] = {"node_id": self.node_id, "state": self.state, "restarts": self.restarts,
                                  "last_exit": self.last_exit, "data_dir": self.data_dir,
                                  "metrics_port": self.metrics_port,
                                  "pid": process.pid if process is not None and process.poll() is None else None,
                                  "endpoints": self.endpoints, "log": str(self.work / "broker.log")}
        if self.endpoints is not None and self.state == "running":
            secret, server = self.admin_keys or (None, None)
            try:
                with AdminClient(self.endpoints["admin"], timeout=5.0, curve_secret_key=secret,
                                 curve_server_key=server) as admin:
                    report["broker"] = admin.status()
            except AdminError as exc:
                report["broker_error"] = str(exc)
        return report

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.work / "broker.log").read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the broker (SIGTERM: it closes its store cleanly; SIGKILL
        after `timeout` seconds) and do not start it again; its exit status."""
        with self._lock:
            self._stopping.set()
            process = self.process
        if process is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            code = process.wait()
        self._thread.join(timeout)
        self.state = "stopped"
        self._bound_file.unlink(missing_ok=True)  # a clean stop: the next start picks its ports afresh
        return code


_SUPERVISOR = ray.remote(BrokerSupervisor)
# The supervisors this driver started, by node id. Ray ends an actor that is not detached once no handle to
# it is left, named or not: these keep them (and their brokers) for the driver's life or until `stop_brokers`.
_STARTED: dict[str, Any] = {}


def _require_ray() -> None:
    if not ray.is_initialized():
        raise InvalidState("rollstream.ray needs a connected Ray: call ray.init() first")


def connect(address: str = "auto") -> None:
    """Join the Ray cluster at `address` (`ray.init`'s; quietly, as a
    tool rather than a job's driver) unless this process already is
    connected: for a process outside the job, such as `rollstream top --ray`."""
    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)


def _alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def _supervisor(node_id: str):
    """The supervisor actor of `node_id`, or None."""
    try:
        return ray.get_actor(ACTOR_PREFIX + node_id, namespace=NAMESPACE)
    except ValueError:
        return None


def _supervisors() -> Iterator[tuple[str, Any]]:
    for node in _alive_nodes():
        actor = _supervisor(node["NodeID"])
        if actor is not None:
            yield node["NodeID"], actor


def start_brokers(settings: Mapping[str, Any] | None = None, *, data_dir: str = DEFAULT_DATA_DIR,
                  host: str | None = None, ports: Mapping[str, int] | None = None, detached: bool = False,
                  admin_keys: tuple[str, str] | None = None, timeout: float = 120.0) -> list[BrokerEndpoints]:
    """A broker on every live node that has none yet (calling it again
    after nodes join starts theirs), and the endpoints of every node's.

    `settings` are broker settings by name, checked before anything starts.
    `data_dir` is each node's data directory on its local disk
    (`{node_id}` and `{node_ip}` are filled in), never under Ray's
    temporary folder. The brokers bind `host` (default: their node's
    address as Ray knows it) on `ports` (by endpoint name; 0 or absent:
    a free port on first start, kept across restarts); unless `settings`
    set `metrics_port`, each broker serves /metrics on a free port too, so
    brokers sharing a machine do not all bind the default. `detached`
    brokers outlive the driver's job until `stop_brokers`. `admin_keys`
    (a secret key file and the brokers' public key) let the supervisors
    read status from brokers that require CURVE."""
    _require_ray()
    args = broker_arguments(settings)
    check_data_dir(data_dir, _ray_temp_dir())
    ports = dict(ports or {})
    unknown = sorted(set(ports) - set(ENDPOINT_NAMES))
    if unknown or not all(isinstance(port, int) and 0 <= port < 65536 for port in ports.values()):
        raise InvalidInput(f"ports must map endpoint names {list(ENDPOINT_NAMES)} to ports in [0, 65535], got {ports}")
    started: dict[str, Any] = {}  # by node id
    for node in _alive_nodes():
        node_id = node["NodeID"]
        if _supervisor(node_id) is not None:
            continue
        options: dict[str, Any] = dict(
            name=ACTOR_PREFIX + node_id, namespace=NAMESPACE, num_cpus=0, max_restarts=-1, max_concurrency=8,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
        if detached:
            options["lifetime"] = "detached"
        started[node_id] = _STARTED[node_id] = _SUPERVISOR.options(**options).remote(
            node_id, args, data_dir, host or node["NodeManagerAddress"], ports, admin_keys)
    try:
        ray.get([actor.where.remote(timeout) for actor in started.values()])
    except Exception:
        for node_id, actor in started.items():
            with contextlib.suppress(Exception):
                ray.get(actor.stop.remote(10.0))
            ray.kill(actor)
            del _STARTED[node_id]
        raise
    return all_brokers(timeout)


def all_brokers(timeout: float = 60.0) -> list[BrokerEndpoints]:
    """Every live node's broker, for a consumer to fan in from."""
    _require_ray()
    found = [actor.where.remote(timeout) for _, actor in _supervisors()]
    return [BrokerEndpoints(**where) for where in ray.get(found)]


def local_broker(timeout: float = 60.0) -> BrokerEndpoints:
    """The broker of the node this actor, task or driver runs on (a
    producer always talks to its own node's)."""
    _require_ray()
    node_id = ray.get_runtime_context().get_node_id()
    actor = _supervisor(node_id)
    if actor is None:
        raise InvalidState(f"no rollstream broker on node {node_id}: call rollstream.ray.start_brokers() first")
    return BrokerEndpoints(**ray.get(actor.where.remote(timeout)))


def brokers_status() -> dict[str, dict]:
    """Each node's supervisor view and its broker's status report, by node id."""
    _require_ray()
    pending = {node_id: actor.status.remote() for node_id, actor in _supervisors()}
    return {node_id: ray.get(ref) for node_id, ref in pending.items()}


def broker_logs(lines: int = 50) -> dict[str, str]:
    """The last `lines` lines of each node's broker log, by node id (each
    log stays on its node, beside the data directory)."""
    _require_ray()
    pending = {node_id: actor.log_tail.remote(lines) for node_id, actor in _supervisors()}
    return {node_id: ray.get(ref) for node_id, ref in pending.items()}


def stop_brokers(timeout: float = 30.0) -> dict[str, int | None]:
    """Stop every node's broker (it closes its store cleanly) and its
    supervisor; each broker's exit status, by node id."""
    _require_ray()
    codes = {}
    for node_id, actor in list(_supervisors()):
        codes[node_id] = ray.get(actor.stop.remote(timeout))
        ray.kill(actor)
        _STARTED.pop(node_id, None)
    return codes


__all__ = ["BrokerEndpoints", "BrokerSupervisor", "all_brokers", "broker_arguments", "broker_logs", "brokers_status",
           "check_data_dir", "connect", "local_broker", "start_brokers", "stop_brokers", "supervisor_dir"]
