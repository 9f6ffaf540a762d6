"""Every broker setting with its default: the one list the command line, the
TOML file and the environment fill (see `rollstream.common.config`)."""
from __future__ import annotations

from dataclasses import dataclass

from rollstream.common.contract import DEFAULT_MAX_MESSAGE_BYTES


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
    sync: str = "normal"
    max_memory_bytes: int = 2 << 30
    max_disk_bytes: int = 64 << 30
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
