"""Every broker setting with its default and its declaration (kind, unit,
range, help): the one list the command line, the TOML file and the
environment fill (see `rollstream.common.config`)."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from rollstream.common.config import (
    DIRECTORY,
    FILE,
    FOLDER,
    OUTPUT_FILE,
    Problem,
    choice,
    count,
    endpoint,
    flag,
    log_level,
    port,
    seconds,
    setting,
    share,
    size,
    text,
    vocabulary,
)
from rollstream.common.contract import DEFAULT_MAX_MESSAGE_BYTES, LONGEST_HEARTBEAT_INTERVAL
from rollstream.common.curve import CurveError, KeyPair
from rollstream.common.errors import InvalidInput

from .filters import FILTER_NAMES, parse_filters
from .staleness import ABANDONED_ACTIONS, DISPATCH_ORDERS

# Each socket's directory of allowed client keys, by socket name.
CURVE_DIRECTORIES = {"producer": "curve_producers", "consumer": "curve_consumers", "admin": "curve_admin"}
# The settings naming the sockets the broker binds, by socket name.
ENDPOINT_SETTINGS = {"producer": "producer_endpoint", "consumer": "consumer_endpoint", "admin": "admin_endpoint"}


@dataclass
class BrokerSettings:
    producer_endpoint: str = endpoint("tcp://127.0.0.1:5555", "Where producers connect.", binds=True)
    consumer_endpoint: str = endpoint("tcp://127.0.0.1:5556", "Where consumers connect.", binds=True)
    admin_endpoint: str = endpoint("tcp://127.0.0.1:5557", "Where `rollstream status` and other admin peers connect.",
                                   binds=True)
    endpoints_file: str | None = setting(
        None, OUTPUT_FILE, "Write the bound endpoints here as JSON once they accept peers (port 0 in an endpoint "
                           "picks a free one).")
    data_dir: str = setting("rollstream-data", DIRECTORY, "Directory of the durable store (created if missing).")
    broker_id: str | None = text(None, "Name reported to peers; default host:data-dir.")
    vocab_size: int | None = vocabulary(None, "Refuse token and support ids outside [0, vocab_size) (out_of_vocab). "
                                              "Unset: no bound.")
    lease_timeout: float = seconds(60.0, "Seconds a consumer has to ack a delivery before it is redelivered.")
    heartbeat_interval: float = seconds(1.0, "Seconds between consumer heartbeats; three missed ones drop the "
                                             "consumer.", high=LONGEST_HEARTBEAT_INTERVAL)
    trajectory_ttl: float = seconds(3600.0, "Seconds without a frame after which an open trajectory expires to dead "
                                            "letters.")
    dedup_window: float = seconds(86_400.0, "Seconds delivered or expired trajectory ids are remembered.")
    max_deliveries: int = count(10, "Deliveries before a trajectory is dead-lettered (max_deliveries).", "deliveries")
    max_staleness: int | None = count(
        None, "Policy versions a trajectory's oldest turn may lag its trainer's when trained (a trainer may lower "
              "it); older ones are dead-lettered stale, and new trajectories wait while the job holds what its "
              "trainer can train within the bound. Unset: no bound.", "policy versions", low=0)
    dispatch_order: str = choice("oldest_first", "Which policy version is handed out first.", DISPATCH_ORDERS)
    abort_stale: bool = flag(
        False, "Give up an open trajectory as soon as its oldest turn is staler than max_staleness (dead letter "
               "stale), so its producer, whose next frame is answered not applied with reason stale, stops "
               "sampling it. Off: it runs on and is dropped stale when it ends.")
    abandoned_lineage: str = choice(
        "drop", "What to do with a trajectory sampled by weights a resumed trainer abandoned (newer than the "
                "checkpoint it resumed from): drop (dead letter abandoned) or keep (train it); counted either way.",
        ABANDONED_ACTIONS)
    group_filters: str = text(
        "", "Drop complete groups without a learning signal before batches form (dead letter filtered:NAME, its "
            "room refilled): comma-separated all_equal_rewards[:tolerance], reward_std_below:THRESHOLD, "
            "min_members:N. Empty: none.")
    filter_reward_key: str | None = text(None, "The entry of a map reward the group filters compare (a number "
                                               "reward is itself).")
    starvation_share: float = share(
        0.9, "Share of a job's trajectories thrown away (filtered or stale) over the starvation window that raises "
             "the starvation alarm (a warning naming the cause and figures, a gauge, an alert).", above=True)
    starvation_window: float = seconds(60.0, "Seconds over which the starvation share is measured.")
    starvation_after: float = seconds(120.0, "Seconds a job's consumer may wait with credit while nothing of the job "
                                             "is queued before the starvation alarm names it idle.")
    sync: str = choice("normal", "normal: durable against a broker crash; full: fsync before every ack (power loss).",
                       ("normal", "full"))
    max_memory_bytes: int = size(
        2 << 30, "Memory budget; over it, trajectories are evicted to the store (those out on a lease last), and "
                 "producer frames wait (backpressure) only while eviction cannot make room.")
    max_disk_bytes: int = size(64 << 30, "Disk budget of the store; over it, new trajectories wait while consumers "
                                         "have something to take.")
    max_unsealed_bytes: int = size(
        16 << 30, "Trained data no checkpoint has sealed yet, apart from max_disk_bytes; past it the oldest trained "
                  "steps are reclaimed, loudly.", low=0)
    max_dead_letter_bytes: int = size(
        1 << 30, "Dead-lettered trajectories kept for inspection (and requeue), in stored bytes; past it the oldest "
                 "are deleted, their ids remembered, counted by reason.", low=0)
    archive: str | None = setting(
        None, DIRECTORY, "Directory of the run's archive: every trajectory the broker would delete (a commit, a "
                         "seal, the unsealed budget) is first written there as Parquet (needs the archive extra: "
                         "pyarrow). Unset: no archive.")
    archive_dead_letters: bool = flag(False, "Archive pruned dead letters too, with their reason.")
    archive_file_rows: int = count(1024, "Most trajectories per archive file.", "trajectories", high=1_000_000)
    archive_linger: float = seconds(30.0, "Seconds trajectories may wait for the archive before a file smaller than "
                                          "archive_file_rows is written (fewer, fuller files; a run's end writes at "
                                          "once).", above=False, high=86_400.0)
    archive_compression: str = choice("zstd", "Compression of the archive's Parquet files: zstd is the smallest, none "
                                              "costs the least CPU.", ("zstd", "lz4", "snappy", "none"))
    disk_reserve_bytes: int | None = size(
        None, "Free space kept on the data dir's file system for ends and consumer acks; below it, turns wait. "
              "Unset: 5% of the file system, at most 1 GiB.", low=0)
    max_message_bytes: int = size(DEFAULT_MAX_MESSAGE_BYTES, "Largest message accepted; larger ones are answered "
                                                             "too_large.")
    window: int = count(256, "Frames in flight each producer is told it may have, at most.", "frames")
    max_in_flight: int = count(1024, "Frames in flight across all producers: each of P active ones is granted "
                                     "max_in_flight / P (at most window).", "frames")
    read_max_frames: int = count(256, "Most producer frames (or consumer messages) read and committed together.",
                                 "frames", older="batch_max")
    read_max_bytes: int = size(8 << 20, "Bytes after which a read takes no more frames (large frames: the read's "
                                        "check, CRC and write then find them in cache); a read always takes one, "
                                        "so 0 makes every frame a read of its own.", low=0, older="batch_max_bytes")
    segment_bytes: int = size(64 << 20, "Size at which a payload segment file is closed and a new one begun.")
    high_water_mark: int = count(1000, "ZeroMQ send/receive queue bound; 0: no bound.", "messages", low=0)
    metrics_port: int = port(9464, "Prometheus /metrics port; 0 disables it.")
    metrics_host: str = text("127.0.0.1", "Address the metrics endpoint binds.")
    log_level: str = log_level()
    # CurveZMQ (docs/operations.md, Security): with a secret key every socket requires CURVE and allows the
    # client keys (*.key files) in its directory; a socket given no directory allows nobody.
    curve_secret_key: str | None = setting(
        None, FILE, "The broker's own CURVE key pair (a .key_secret file from `rollstream keys generate`); with it "
                    "every socket requires CURVE. SIGHUP reloads the key directories.")
    curve_producers: str | None = setting(None, FOLDER, "Directory of the producer keys (*.key) the producer socket "
                                                        "allows; none given: nobody.")
    curve_consumers: str | None = setting(None, FOLDER, "Directory of the consumer keys (*.key) the consumer socket "
                                                        "allows; none given: nobody.")
    curve_admin: str | None = setting(None, FOLDER, "Directory of the admin keys (*.key) the admin socket allows; "
                                                    "none given: nobody.")

    def curve_directories(self) -> dict[str, str]:
        """The sockets given a directory of allowed keys, by socket name."""
        return {socket: getattr(self, key) for socket, key in CURVE_DIRECTORIES.items() if getattr(self, key)}


def broker_problems(settings: BrokerSettings) -> list[Problem]:
    """What a start would refuse in settings each of whose values its
    declaration takes: group filters that do not parse, CURVE directories
    without a secret key, a secret key file that is not a key pair."""
    problems = []
    if settings.archive is not None and importlib.util.find_spec("pyarrow") is None:
        problems.append(Problem("archive", "", "pyarrow installed (pip install 'rollstream[archive]')",
                                "no pyarrow in this Python", "archive extra"))
    try:
        parse_filters(settings.group_filters)
    except InvalidInput as exc:
        problems.append(Problem("group_filters", "", "comma-separated name[:threshold] of "
                                f"{', '.join(FILTER_NAMES)}", str(exc), "filters"))
    if settings.curve_secret_key is None:
        problems += [Problem(key, "", "set only together with curve_secret_key (the broker's own .key_secret)",
                             f"{getattr(settings, key)!r} without it", "curve pairing")
                     for key in CURVE_DIRECTORIES.values() if getattr(settings, key)]
        return problems
    try:
        KeyPair.load(settings.curve_secret_key)
    except CurveError as exc:
        problems.append(Problem("curve_secret_key", "", "the broker's own .key_secret file (rollstream keys generate)",
                                str(exc), "key file"))
    return problems
