"""`rollstream broker` and `rollstream status`."""
from __future__ import annotations

import gc
import json
from pathlib import Path

import click

from rollstream.common.config import SETTINGS_CONTEXT, config_option, settings_options
from rollstream.common.curve import curve_client_options

from .settings import BrokerSettings, broker_problems


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
@settings_options(BrokerSettings)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
def broker(log_format: str, **values) -> None:
    """Run the per-node broker: merge producer turns into durable
    trajectories and lease them to consumers."""
    import zmq

    from rollstream.common.config import ConfigError, located, settings_from
    from rollstream.common.dirlock import DirectoryHeld
    from rollstream.common.logs import setup_logging

    from .service import BrokerService
    from .store import StoreCorrupted

    settings = settings_from(BrokerSettings, values, broker_problems)
    setup_logging(settings.log_level, log_format)
    keep_freed_memory()
    try:
        service = BrokerService(settings)
        service.start()
    except ConfigError as exc:  # what only a start finds: a port another process holds, say
        raise ConfigError(located(exc.problems)) from None
    except (DirectoryHeld, StoreCorrupted, RuntimeError, zmq.ZMQError) as exc:
        raise click.ClickException(f"refusing to start: {exc}") from None
    tune_garbage_collector()
    service.install_signal_handlers()
    service.run()


@click.command()
@click.option("--admin", "endpoint", default="tcp://127.0.0.1:5557", show_default=True, help="The broker's admin endpoint.")
@click.option("--endpoints-file", type=click.Path(dir_okay=False),
              help="Read the admin endpoint from the file a broker's --endpoints-file names (instead of --admin).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--dead-letters", type=click.IntRange(min=0), default=20, show_default=True, help="How many dead letters to list.")
@click.option("--timeout", type=click.FloatRange(min=0.0, min_open=True), default=5.0, show_default=True,
              help="Seconds to wait for the broker.")
@click.option("--wait", "wait_seconds", type=click.FloatRange(min=0.0), default=None,
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
    for key in ("open", "scoring", "awaiting_group", "queued", "leased", "dead", "producers", "consumers",
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
    archive = report.get("archive")
    if archive is not None:
        click.echo(f"  {'archive':<20} {archive['waiting']} waiting, {archive['writing']} file(s) being written, "
                   f"{archive['lacking']} segment(s) it lacks"
                   + ("" if archive.get("failing") is None else f", FAILING: {archive['failing']}"))
    for job, causes in report.get("starving", {}).items():
        click.echo(f"  {'STARVING ' + job:<20} {', '.join(causes)} (see the broker's log for the figures)")
    for job, queued in report.get("queued_by_job", {}).items():
        if set(report["queued_by_job"]) != {"default"}:  # jobs shown once there is more than the default one
            click.echo(f"  {'queued in ' + job:<20} {queued}")
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
@click.option("--timeout", type=click.FloatRange(min=0.0, min_open=True), default=5.0, show_default=True,
              help="Seconds to wait for the broker.")
@click.option("--job", default=None, help="The job the dead letters belong to (as `status` lists them; "
              "default: the default job).")
@curve_client_options
@click.argument("trajectory_ids", nargs=-1, required=True)
def requeue(endpoint: str, timeout: float, job: str | None, curve_secret_key: str | None, curve_server_key: str | None,
            trajectory_ids: tuple[str, ...]) -> None:
    """Move dead letters back to the delivery queue."""
    from rollstream.common.admin import AdminClient, AdminError
    from rollstream.common.curve import CurveError

    try:
        with AdminClient(endpoint, timeout=timeout, curve_secret_key=curve_secret_key,
                         curve_server_key=curve_server_key) as admin:
            done = admin.requeue(list(trajectory_ids), job)
    except (AdminError, CurveError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"requeued {len(done)} of {len(trajectory_ids)}: {' '.join(done)}")


def _job_name(ctx: click.Context, param: click.Parameter, job: str | None) -> str | None:
    from rollstream.common.jobs import JOB_PATTERN, is_job

    if job is not None and not is_job(job):
        raise click.BadParameter(f"a job name must match {JOB_PATTERN} (letters, digits, '.', '_', '-'; at most 64), "
                                 f"got {job!r}")
    return job


@click.command("end-run")
@click.option("--admin", "endpoint", default="tcp://127.0.0.1:5557", show_default=True, help="The broker's admin endpoint.")
@click.option("--timeout", type=click.FloatRange(min=0.0, min_open=True), default=5.0, show_default=True,
              help="Seconds to wait for the broker.")
@click.option("--job", default=None, callback=_job_name, help="The run's job (default: the default job).")
@curve_client_options
@click.argument("run")
def end_run(endpoint: str, timeout: float, job: str | None, curve_secret_key: str | None, curve_server_key: str | None,
            run: str) -> None:
    """Tell the broker that trainer run RUN is over: it reclaims everything
    the run trained, the last steps no seal reclaimed included (archived
    first, with --archive). A resume of the run is refused afterwards."""
    from rollstream.common.admin import AdminClient, AdminError
    from rollstream.common.curve import CurveError

    try:
        with AdminClient(endpoint, timeout=timeout, curve_secret_key=curve_secret_key,
                         curve_server_key=curve_server_key) as admin:
            reclaimed = admin.end_run(run, job=job)
    except (AdminError, CurveError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"run {run} ended: {reclaimed} trained trajectories reclaimed")


@click.command()
@click.option("--data-dir", default=BrokerSettings.data_dir, show_default=True, type=click.Path(file_okay=False, exists=True),
              help="Data directory of a stopped broker.")
def salvage(data_dir: str) -> None:
    """Keep what a damaged store holds intact and drop the rest: every
    trajectory whose end row or turn records fail their checks is removed
    (each one is listed), a torn segment tail is cut, and the broker can
    start again. It refuses while a broker holds DATA_DIR."""
    from rollstream.common.dirlock import DirectoryHeld

    from .store import Store, StoreCorrupted

    try:
        store = Store(data_dir)
    except DirectoryHeld as exc:
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


def _steps_range(ctx: click.Context, param: click.Parameter, text: str | None) -> tuple[int, int] | None:
    """`A..B` (or `N`) as the inclusive range of trained steps it names."""
    if text is None:
        return None
    first, dots, last = text.partition("..")
    try:
        low, high = int(first), int(last if dots else first)
    except ValueError:
        low, high = -1, -1
    if low < 0 or high < low:
        raise click.BadParameter(f"a step range is A..B, integers with 0 <= A <= B (or one step N): expected e.g. "
                                 f"'10..20', got {text!r}")
    return low, high


def _wall_time(ctx: click.Context, param: click.Parameter, text: str | None) -> float | None:
    """An ISO-8601 time (UTC unless it names its zone) or epoch seconds, as epoch seconds."""
    if text is None:
        return None
    import datetime
    import math

    try:
        seconds = float(text)
    except ValueError:
        try:
            moment = datetime.datetime.fromisoformat(text)
        except ValueError:
            raise click.BadParameter(f"a time is ISO-8601 (e.g. 2025-01-31T12:00:00+00:00) or epoch seconds: "
                                     f"expected one of them, got {text!r}") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=datetime.timezone.utc)
        return moment.timestamp()
    if not math.isfinite(seconds):
        raise click.BadParameter(f"epoch seconds must be a finite number, got {text!r}")
    return seconds


@click.command()
@click.option("--data-dir", default=BrokerSettings.data_dir, show_default=True,
              type=click.Path(file_okay=False), help="Data directory of a broker, stopped or running.")
@click.option("--archive", default=None, type=click.Path(file_okay=False, exists=True),
              help="Read a broker's archive (`rollstream broker --archive DIR`) instead of a data directory.")
@click.option("--out", required=True, type=click.Path(),
              help="Where to write: a Parquet file, or with --format miles a new (or empty) directory.")
@click.option("--format", "fmt", type=click.Choice(["parquet", "miles"]), default="parquet", show_default=True,
              help="parquet: one row per trajectory with every token (docs/archive.md); miles: one session "
                   "payload per trajectory, which `rollstream producer --source replay` reads back.")
@click.option("--job", default=None, callback=_job_name, help="Only this job's trajectories.")
@click.option("--steps", default=None, callback=_steps_range,
              help="Only trajectories trained at a step in A..B (inclusive).")
@click.option("--trained", is_flag=True, help="Trajectories a checkpointing trainer trained.")
@click.option("--queued", is_flag=True, help="Ended trajectories waiting for delivery.")
@click.option("--dead-letters", is_flag=True, help="Dead letters that still hold their data.")
@click.option("--since", default=None, callback=_wall_time,
              help="Only trajectories whose last turn arrived at or after this time (ISO-8601, UTC unless it names "
                   "its zone, or epoch seconds).")
def export(data_dir: str, archive: str | None, out: str, fmt: str, job: str | None, steps: tuple[int, int] | None,
           trained: bool, queued: bool, dead_letters: bool, since: float | None) -> None:
    """Write the trajectories a broker's data directory holds (or its
    archive, with --archive) to Parquet with every token, or to miles
    payloads, without stopping or holding up its broker: one consistent
    snapshot, each trajectory whole. The state filters add up; with none,
    every trajectory with data is written, open ones too."""
    import sys

    try:
        from .export import Selection, export_archive
        from .export import export as run_export
    except ImportError as exc:
        raise click.ClickException(f"export needs pyarrow, the archive extra: pip install 'rollstream[archive]' "
                                   f"({exc})") from None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from rollstream.common.errors import InvalidInput

    from .store import StoreCorrupted

    if archive is None and not Path(data_dir).is_dir():
        raise click.BadParameter(f"expected a broker's data directory at {data_dir}, found "
                                 f"{'nothing' if not Path(data_dir).exists() else 'a file'}", param_hint="--data-dir")
    selection = Selection(job=job, steps=steps, trained=trained, queued=queued, dead_letters=dead_letters, since=since)
    bar = Progress(TextColumn("exporting"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=Console(stderr=True), disable=not sys.stderr.isatty(), transient=True)
    task = bar.add_task("export", total=None)
    try:
        with bar:
            exported = (run_export if archive is None else export_archive)(
                data_dir if archive is None else archive, out, selection, fmt=fmt,
                progress=lambda done, total: bar.update(task, completed=done, total=total))
    except InvalidInput as exc:
        raise click.BadParameter(str(exc)) from None
    except StoreCorrupted as exc:
        raise click.ClickException(f"cannot export {archive or data_dir}: {exc}") from None
    if archive is not None:
        click.echo(f"exported {exported.rows} trajectories ({exported.nbytes} bytes) to {out}; skipped "
                   f"{exported.skipped} whose records the archive lacks yet (their segments are still in the broker's "
                   "use: `rollstream end-run` copies them)")
        return
    click.echo(f"exported {exported.rows} trajectories ({exported.nbytes} bytes) to {out}; skipped {exported.skipped} "
               "deleted by the running broker meanwhile")
