"""Every broker setting with its default: the one list the command line, the
TOML file and the environment fill (see `rollstream.common.config`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rollstream.common.config import Problem
from rollstream.common.contract import DEFAULT_MAX_MESSAGE_BYTES
from rollstream.common.curve import CurveError, KeyPair
from rollstream.common.errors import InvalidInput

from .filters import FILTER_NAMES, parse_filters

# Each socket's directory of allowed client keys, by socket name.
CURVE_DIRECTORIES = {"producer": "curve_producers", "consumer": "curve_consumers", "admin": "curve_admin"}


@dataclass
class BrokerSettings:
    producer_endpoint: str = "tcp://127.0.0.1:5555"
    consumer_endpoint: str = "tcp://127.0.0.1:5556"
    admin_endpoint: str = "tcp://127.0.0.1:5557"
    endpoints_file: str | None = None  # where the bound endpoints are written (JSON) once they accept peers
    data_dir: str = "rollstream-data"
    broker_id: str | None = None  # default: derived from the host name and data dir
    vocab_size: int | None = None
    lease_timeout: float = 60.0
    heartbeat_interval: float = 1.0
    trajectory_ttl: float = 3600.0
    dedup_window: float = 86_400.0
    max_deliveries: int = 10
    max_staleness: int | None = None  # policy versions a trajectory may lag its trainer when trained; None: no bound
    dispatch_order: str = "oldest_first"
    abort_stale: bool = False  # give up open trajectories already staler than the bound (their producers told)
    abandoned_lineage: str = "drop"  # or "keep": data weights of a lineage a resumed trainer abandoned sampled
    group_filters: str = ""  # comma-separated `name[:threshold]` (broker/filters.py); none by default
    filter_reward_key: str | None = None  # the entry of a map reward the group filters compare
    starvation_share: float = 0.9  # of a job's trajectories thrown away (filtered, stale) over the window: an alarm
    starvation_window: float = 60.0
    starvation_after: float = 120.0  # seconds a job's consumer waits with nothing becoming ready: an alarm
    sync: str = "normal"
    max_memory_bytes: int = 2 << 30
    max_disk_bytes: int = 64 << 30
    max_unsealed_bytes: int = 16 << 30  # trained and not yet sealed: a budget apart from max_disk_bytes
    max_dead_letter_bytes: int = 1 << 30  # dead letters kept for inspection; past it the oldest are deleted
    disk_reserve_bytes: int | None = None  # free space kept for ends and acks; default: 5% of the file system, at most 1 GiB
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    window: int = 256
    max_in_flight: int = 1024
    batch_max: int = 256
    batch_max_bytes: int = 8 << 20
    segment_bytes: int = 64 << 20
    high_water_mark: int = 1000
    metrics_port: int = 9464
    metrics_host: str = "127.0.0.1"
    log_level: str = "info"
    # CurveZMQ (docs/operations.md, Security): with a secret key every socket requires CURVE and allows the
    # client keys (*.key files) in its directory; a socket given no directory allows nobody.
    curve_secret_key: str | None = None
    curve_producers: str | None = None
    curve_consumers: str | None = None
    curve_admin: str | None = None

    def curve_directories(self) -> dict[str, str]:
        """The sockets given a directory of allowed keys, by socket name."""
        return {socket: getattr(self, key) for socket, key in CURVE_DIRECTORIES.items() if getattr(self, key)}


def broker_problems(settings: BrokerSettings) -> list[Problem]:
    """What a start would refuse in otherwise well-typed settings: CURVE
    directories without a secret key, a secret key file that cannot be
    used, a directory that is not one."""
    problems = []
    try:
        parse_filters(settings.group_filters)
    except InvalidInput as exc:
        problems.append(Problem("group_filters", "", "comma-separated name[:threshold] of "
                                f"{', '.join(FILTER_NAMES)}", str(exc)))
    if settings.curve_secret_key is None:
        problems += [Problem(key, "", "set only together with curve_secret_key (the broker's own .key_secret)",
                             f"{getattr(settings, key)!r} without it")
                     for key in CURVE_DIRECTORIES.values() if getattr(settings, key)]
        return problems
    try:
        KeyPair.load(settings.curve_secret_key)
    except CurveError as exc:
        problems.append(Problem("curve_secret_key", "", "the broker's own .key_secret file (rollstream keys generate)",
                                str(exc)))
    for key in CURVE_DIRECTORIES.values():
        directory = getattr(settings, key)
        if directory and not Path(directory).is_dir():
            problems.append(Problem(key, "", "an existing directory of allowed client keys (*.key files)",
                                    f"{directory!r}, which is not a directory"))
    return problems

