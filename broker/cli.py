"""`rollstream broker` and `rollstream status`."""
from __future__ import annotations

import gc
import json

import click

from rollstream.common.config import BYTES, SETTINGS_CONTEXT, config_option, settings_options
from rollstream.common.curve import curve_client_options

from .settings import BrokerSettings, broker_problems
from .staleness import ABANDONED_ACTIONS, DISPATCH_ORDERS

HELP = {
    "producer_endpoint": "Where producers connect (tcp://, ipc:// or inproc://).",
    "consumer_endpoint": "Where consumers connect.",
    "admin_endpoint": "Where `rollstream status` and other admin peers connect.",
    "endpoints_file": "Write the bound endpoints here as JSON once they accept peers (port 0 in an endpoint picks a free one).",
    "data_dir": "Directory of the durable store (created if missing).",
    "broker_id": "Name reported to peers; default host:data-dir.",
    "vocab_size": "Refuse token and support ids outside [0, vocab_size) (out_of_vocab).",
    "lease_timeout": "Seconds a consumer has to ack a delivery before it is redelivered.",
    "heartbeat_interval": "Seconds between consumer heartbeats; three missed ones drop the consumer.",
    "trajectory_ttl": "Seconds without a frame after which an open trajectory expires to dead letters.",
    "dedup_window": "Seconds delivered or expired trajectory ids are remembered.",
    "max_deliveries": "Deliveries before a trajectory is dead-lettered (max_deliveries).",
    "max_staleness": "Policy versions a trajectory's oldest turn may lag its trainer's when trained (a trainer may "
                     "lower it); older ones are dead-lettered stale, and new trajectories wait while the job holds "
                     "what its trainer can train within the bound. Unset: no bound.",
    "dispatch_order": "Which policy version is handed out first: oldest_first or freshest_first.",
    "abort_stale": "Give up an open trajectory as soon as its oldest turn is staler than max_staleness (dead letter "
                   "stale), so its producer, whose next frame is answered not applied with reason stale, stops "
                   "sampling it. Off: it runs on and is dropped stale when it ends.",
    "abandoned_lineage": "What to do with a trajectory sampled by weights a resumed trainer abandoned (newer than the "
                         "checkpoint it resumed from): drop (dead letter abandoned) or keep (train it); counted either "
                         "way.",
    "group_filters": "Drop complete groups without a learning signal before batches form (dead letter "
                     "filtered:NAME, its room refilled): comma-separated all_equal_rewards[:tolerance], "
                     "reward_std_below:THRESHOLD, min_members:N.",
    "filter_reward_key": "The entry of a map reward the group filters compare (a number reward is itself).",
    "starvation_share": "Share of a job's trajectories thrown away (filtered or stale) over the starvation window that "
                        "raises the starvation alarm (a warning naming the cause and figures, a gauge, an alert).",
    "starvation_window": "Seconds over which the starvation share is measured.",
    "starvation_after": "Seconds a job's consumer may wait with credit while nothing of the job becomes ready before "
                        "the starvation alarm names it idle.",
    "sync": "normal: durable against a broker crash; full: fsync before every ack (power loss).",
    "max_memory_bytes": "Memory budget; over it, trajectories are evicted to the store (those out on a lease last), and "
                        "producer frames wait (backpressure) only while eviction cannot make room.",
    "max_disk_bytes": "Disk budget of the store; over it, new trajectories wait while consumers have something to take.",
    "max_dead_letter_bytes": "Dead-lettered trajectories kept for inspection (and requeue), in stored bytes; past it "
                             "the oldest are deleted, their ids remembered, counted by reason.",
    "disk_reserve_bytes": "Free space kept on the data dir's file system for ends and consumer acks; below it, turns wait. "
                          "Default: 5% of the file system, at most 1 GiB.",
    "max_message_bytes": "Largest message accepted; larger ones are answered too_large.",
    "window": "Frames in flight each producer is told it may have, at most.",
    "max_in_flight": "Frames in flight across all producers: each of P active ones is granted max_in_flight / P "
                     "(at most window).",
    "batch_max": "Most frames read and committed together.",
    "batch_max_bytes": "Bytes after which a batch takes no more frames (large frames: the batch's check, CRC and write "
                       "then read it from cache).",
    "segment_bytes": "Size at which a payload segment file is closed and a new one begun.",
    "high_water_mark": "ZeroMQ send/receive queue bound, in messages.",
    "metrics_port": "Prometheus /metrics port; 0 disables it.",
    "metrics_host": "Address the metrics endpoint binds.",
    "log_level": "debug, info, warning or error.",
    "curve_secret_key": "The broker's own CURVE key pair (a .key_secret file from `rollstream keys generate`); with it "
                        "every socket requires CURVE. SIGHUP reloads the key directories.",
    "curve_producers": "Directory of the producer keys (*.key) the producer socket allows; none given: nobody.",
    "curve_consumers": "Directory of the consumer keys (*.key) the consumer socket allows; none given: nobody.",
    "curve_admin": "Directory of the admin keys (*.key) the admin socket allows; none given: nobody.",
}
TYPES = {
    "sync": click.Choice(["normal", "full"]),
    "max_staleness": click.IntRange(min=0),
    "dispatch_order": click.Choice(list(DISPATCH_ORDERS)),
    "abandoned_lineage": click.Choice(list(ABANDONED_ACTIONS)),
    "max_memory_bytes": BYTES,
    "max_disk_bytes": BYTES,
    "max_dead_letter_bytes": BYTES,
    "disk_reserve_bytes": BYTES,
    "max_message_bytes": BYTES,
    "segment_bytes": BYTES,
    "batch_max_bytes": BYTES,
    "log_level": click.Choice(["debug", "info", "warning", "error"]),
}


def keep_freed_memory(mmap_threshold: int = 64 << 20) -> bool:
    """Ask glibc's malloc to serve blocks up to `mmap_threshold` from its
    heap and to keep freed memory there. The broker allocates and frees
    batch-sized (~1 MB) arrays many times a second; by default each is a
    fresh mmap whose pages fault in one by one, a large share of the
    content check (docs/performance.md). False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, mmap_threshold)) and bool(mallopt(m_trim_threshold, 2 * mmap_threshold))


def tune_garbage_collector(young_threshold: int = 10_000) -> None:
    """Move everything alive after start-up (modules, recovered state) out
    of the cyclic collector's reach, and collect the young generation less
    often. The broker allocates several containers per frame, nearly all
    freed by reference counting, so the default thresholds ran full
    collections over every start-up object a few times a second, a
    measurable share of the main thread (docs/performance.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, *gc.get_threshold()[1:])


@click.command(context_settings=SETTINGS_CONTEXT)
@config_option(BrokerSettings, "broker")
@settings_options(BrokerSettings, HELP, TYPES)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
def broker(log_format: str, **values) -> None:
    """Run the per-node broker: merge producer turns into durable
    trajectories and lease them to consumers."""
    import zmq

    from rollstream.common.config import settings_from
    from rollstream.common.logs import setup_logging

    from .service import BrokerService
    from .store import DataDirectoryHeld, StoreCorrupted

    settings = settings_from(BrokerSettings, values, broker_problems)
    setup_logging(settings.log_level, log_format)
    keep_freed_memory()
    try:
        service = BrokerService(settings)
        service.start()
    except (DataDirectoryHeld, StoreCorrupted, RuntimeError, zmq.ZMQError) as exc:
        raise click.ClickException(f"refusing to start: {exc}") from None
    tune_garbage_collector()
    service.install_signal_handlers()
    service.run()


@click.command()
@click.option("--admin", "endpoint", default="tcp://127.0.0.1:5557", show_default=True, help="The broker's admin endpoint.")
@click.option("--endpoints-file", type=click.Path(dir_okay=False),
              help="Read the admin endpoint from the file a broker's --endpoints-file names (instead of --admin).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--dead-letters", default=20, show_default=True, help="How many dead letters to list.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds to wait for the broker.")
@click.option("--wait", "wait_seconds", type=float, default=None,
              help="Keep trying for up to this many seconds until the broker answers (readiness for scripts).")
@curve_client_options
def status(endpoint: str, endpoints_file: str | None, as_json: bool, dead_letters: int, timeout: float,
           wait_seconds: float | None, curve_secret_key: str | None, curve_server_key: str | None) -> None:
    """Show a broker's queues, peers, budgets, counters and dead letters."""
    from rollstream.common.admin import AdminError, ask_status
    from rollstream.common.curve import CurveError

    try:
        report, endpoint = ask_status(endpoint, endpoints_file=endpoints_file, timeout=timeout, wait=wait_seconds,
                                      dead_letters=dead_letters, curve_secret_key=curve_secret_key,
                                      curve_server_key=curve_server_key)
    except (AdminError, CurveError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report, indent=None, sort_keys=True))
        return
    click.echo(f"broker at {endpoint}")
    for key in ("open", "scoring", "awaiting_group", "ready", "leased", "dead", "producers", "consumers",
                "bytes_in_memory", "bytes_on_disk", "unsealed", "unsealed_bytes", "oldest_unsealed_step"):
        if key in report:
            click.echo(f"  {key:<20} {report[key]}")
    for job, policy in report.get("policies", {}).items():
        spread = policy.get("staleness")
        click.echo(f"  {'policy of ' + job:<20} version {policy['version']}, max_staleness {policy.get('max_staleness')}, "
                   f"untrained {policy['untrained']} of capacity {policy.get('capacity')}"
                   + ("" if spread is None else f", queued staleness {spread[0]}-{spread[1]}")
                   + ("" if "epoch" not in policy else
                      f", lineage epoch {policy['epoch']} (resumed from step {policy['resumed_from']})"))
    for job, causes in report.get("starving", {}).items():
        click.echo(f"  {'STARVING ' + job:<20} {', '.join(causes)} (see the broker's log for the figures)")
    for job, ready in report.get("ready_by_job", {}).items():
        if set(report["ready_by_job"]) != {"default"}:  # jobs shown once there is more than the default one
            click.echo(f"  {'ready in ' + job:<20} {ready}")
    for name, bound in report.get("endpoints", {}).items():
        click.echo(f"  {name + ' endpoint':<20} {bound}")
    click.echo("  counters:")
    for key, value in report["counters"].items():
        click.echo(f"    {key:<40} {value}")
    if report["dead_letters"]:
        click.echo("  dead letters:")
        for item in report["dead_letters"]:
            job = "" if item.get("job", "default") == "default" else f"  job {item['job']}"
            click.echo(f"    {item['trajectory_id']}{job}  {item['reason']}  at {item['at']:.3f}")


@click.command()
@click.option("--admin", "endpoint", default="tcp://127.0.0.1:5557", show_default=True, help="The broker's admin endpoint.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds to wait for the broker.")
@click.option("--job", default=None, help="The job the dead letters belong to (as `status` lists them; "
              "default: the default job).")
@curve_client_options
@click.argument("trajectory_ids", nargs=-1, required=True)
def requeue(endpoint: str, timeout: float, job: str | None, curve_secret_key: str | None, curve_server_key: str | None,
            trajectory_ids: tuple[str, ...]) -> None:
    """Move dead letters back to the ready queue."""
    from rollstream.common.admin import AdminClient, AdminError
    from rollstream.common.curve import CurveError

    try:
        with AdminClient(endpoint, timeout=timeout, curve_secret_key=curve_secret_key,
                         curve_server_key=curve_server_key) as admin:
            done = admin.requeue(list(trajectory_ids), job)
    except (AdminError, CurveError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"requeued {len(done)} of {len(trajectory_ids)}: {' '.join(done)}")


@click.command()
@click.option("--data-dir", default=BrokerSettings.data_dir, show_default=True, type=click.Path(file_okay=False, exists=True),
              help="Data directory of a stopped broker.")
def salvage(data_dir: str) -> None:
    """Keep what a damaged store holds intact and drop the rest: every
    trajectory whose end row or turn records fail their checks is removed
    (each one is listed), a torn segment tail is cut, and the broker can
    start again. It refuses while a broker holds DATA_DIR."""
    from .store import DataDirectoryHeld, Store, StoreCorrupted

    try:
        store = Store(data_dir)
    except DataDirectoryHeld as exc:
        raise click.ClickException(f"cannot salvage {data_dir}: {exc}") from None
    try:
        dropped = store.salvage()
        kept = store.open().trajectories
    except StoreCorrupted as exc:
        raise click.ClickException(f"cannot salvage {data_dir}: {exc}") from None
    finally:
        store.close()
    for line in dropped:
        click.echo(line)
    click.echo(f"salvaged {data_dir}: kept {len(kept)} trajectories, dropped {len(dropped)}")
