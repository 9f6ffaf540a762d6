"""The `rollstream` command: each role's subcommands, `keys` and `demo`.

A subcommand imports its role only when it is invoked, so `rollstream
broker` never imports torch (the consumer's) and `--help` stays fast.
Importing this module registers the app's `model` source with the producer
daemon (`rollstream.producer.sources`), so `rollstream producer --source
model` runs it.
"""
from __future__ import annotations

import click

from rollstream.producer.sources import SourceFactory, register_source

ROLE_COMMANDS = ("broker", "consume", "end-run", "export", "producer", "requeue", "salvage", "status")
# The app's commands loaded as the roles' are (`top` imports rich and zmq).
LAZY_APP_COMMANDS = ("history", "top")


def role_command(name: str) -> click.Command:
    """Role command `name` (one of `ROLE_COMMANDS`), its role imported now."""
    if name == "producer":
        from rollstream.producer.cli import producer

        return producer
    if name == "consume":
        from rollstream.consumer.cli import consume

        return consume
    from rollstream.broker.cli import broker, end_run, export, requeue, salvage, status

    return {"broker": broker, "status": status, "requeue": requeue, "salvage": salvage, "end-run": end_run,
            "export": export}[name]


def model_source() -> SourceFactory:
    """The `model` source (torch), loaded when a producer daemon runs it."""
    from .model_source import ModelSource

    return ModelSource


register_source("model", model_source)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *ROLE_COMMANDS, *LAZY_APP_COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in ROLE_COMMANDS:
            return role_command(name)
        if name == "top":
            from .top import top

            return top
        if name == "history":
            from .history import history

            return history
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "ROLLSTREAM"})
@click.version_option(package_name="rollstream")
def main() -> None:
    """rollstream: stream RL rollouts with their sampling supports from
    producers through a durable per-node broker to training consumers."""


@main.group()
def keys() -> None:
    """CurveZMQ key pairs for brokers and their clients (docs/operations.md, Security)."""


@keys.command("generate")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Directory to write the pair to (created if missing).")
@click.option("--name", required=True, help="The pair's name: NAME.key (public) and NAME.key_secret (secret, mode 0600).")
def generate_keys(out_dir: str, name: str) -> None:
    """Write a new CURVE key pair. Hand NAME.key to the other end (a client's
    into the broker's directory for its socket; the broker's to its
    clients as --curve-server-key); NAME.key_secret stays with NAME."""
    from rollstream.common.curve import CurveError, fingerprint, generate, load_public_key

    try:
        public_path, secret_path = generate(out_dir, name)
    except CurveError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {public_path} (public) and {secret_path} (secret, mode 0600); "
               f"fingerprint {fingerprint(load_public_key(public_path))}")


@keys.command("fingerprint")
@click.argument("key_files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
def show_fingerprints(key_files: tuple[str, ...]) -> None:
    """Print each key file's fingerprint, as the broker's log names keys."""
    from rollstream.common.curve import CurveError, fingerprint, load_public_key

    for path in key_files:
        try:
            click.echo(f"{fingerprint(load_public_key(path))}  {path}")
        except CurveError as exc:
            raise click.ClickException(str(exc)) from None


def _device_present(ctx: click.Context, param: click.Parameter, device: str) -> str:
    """Refuse a device torch cannot use before anything starts (torch is
    imported only when the device is not the CPU)."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.BadParameter(
                f"cuda needs a CUDA device torch can use: expected torch.cuda.is_available() to be True, "
                f"got False (torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return device


def _archive_extra(ctx: click.Context, param: click.Parameter, archive: str | None) -> str | None:
    """Refuse --archive before anything starts where pyarrow (the archive extra), which the broker writes it with,
    is missing."""
    import importlib.util

    if archive is not None and importlib.util.find_spec("pyarrow") is None:
        raise click.BadParameter("an archive needs the archive extra: expected pyarrow importable, got none; "
                                 "pip install 'rollstream[archive]'")
    return archive


@main.command()
@click.option("--producers", type=click.IntRange(min=1), default=2, show_default=True, help="Synthetic producer daemons.")
@click.option("--trajectories", type=click.IntRange(min=1), default=24, show_default=True,
              help="Trajectories per producer (whole groups).")
@click.option("--turns", type=click.IntRange(min=1), default=3, show_default=True, help="Turns per trajectory.")
@click.option("--group-size", type=click.IntRange(min=1), default=4, show_default=True, help="Samples per prompt (one group).")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True, help="Groups per training batch.")
@click.option("--abort-rate", type=click.FloatRange(0.0, 1.0), default=0.1, show_default=True,
              help="Chance a later turn aborts without supports (a replay gap).")
@click.option("--retry-rate", type=click.FloatRange(0.0, 1.0), default=0.1, show_default=True,
              help="Chance a trajectory outside a group (--group-size 1) "
              "is discarded (abort) after its first turn and produced again.")
@click.option("--dp-size", type=click.IntRange(min=1), default=2, show_default=True,
              help="Trainer ranks (DistributedConsumer over gloo).")
@click.option("--chaos", is_flag=True, help="SIGKILL and restart the broker (3 times), a producer and the trainer's "
              "source rank during the run; the checker must still find nothing wrong.")
@click.option("--timeout", type=click.FloatRange(min=0.0, min_open=True), default=180.0, show_default=True,
              help="Seconds to wait for the run to drain.")
@click.option("--keep-data", is_flag=True, help="Keep the broker's data dir, the ledgers and the daemons' log.")
@click.option("--train", is_flag=True, help="The model in the loop: model producers and a trainer that replays "
              "their sampling distribution and takes policy-gradient steps (docs/training.md); it takes "
              "--producers, --group-size, --batch-size, --turns, --keep-data, --chaos (the trainer crashes "
              "between a commit and its next checkpoint and resumes) and --timeout (for the archive only) of the "
              "options above, and --archive.")
@click.option("--steps", type=click.IntRange(min=1), default=60, show_default=True,
              help="--train: training steps (one batch each).")
@click.option("--max-staleness", type=click.IntRange(min=0), default=None,
              help="The broker's staleness bound, in policy versions (the trainer's steps) a trajectory's oldest turn "
                   "may lag the trainer (docs/consumer.md, Staleness); stale ones are dead-lettered and counted.")
@click.option("--filter", "group_filter", default=None,
              help="The broker's group filters, e.g. all_equal_rewards: groups without a learning signal are dropped "
                   "before batches form (with --train the run stops cleanly if its broker says it starves).")
@click.option("--late-reward-rate", default=0.2, show_default=True,
              type=click.FloatRange(0.0, 1.0), help="Chance a synthetic trajectory ends without its reward, which "
              "follows half a second later (a slow verifier).")
@click.option("--plot", "plot", default="rollstream-train.png", show_default=True,
              help="--train: the PNG plot's path (needs the `plot` extra), relative to the current directory, "
                   "replaced by each run; the table and the JSON line say where it went. '' for none.")
@click.option("--endpoints-file", type=click.Path(dir_okay=False), default=None,
              help="Have the demo's broker write its endpoints here (JSON), so `rollstream top --endpoints-file` in "
                   "another terminal watches it; removed when the demo ends.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              callback=_device_present, help="Where the trainer runs: each rank's step, and the source rank's batch "
              "validation (the ranks still speak gloo through host memory); with --train the trainer's model, batches, "
              "replay and steps. Producers sample on the CPU.")
@click.option("--archive", type=click.Path(file_okay=False, resolve_path=True), default=None,
              callback=_archive_extra, help="The broker archives every trajectory it deletes to Parquet files in "
              "this directory (docs/archive.md; needs the archive extra); once the trainer stops, its run is ended, "
              "so the archive holds all it trained, and the demo waits (within --timeout) until nothing waits for "
              "the archive. The summary says how many rows of the run it holds. Kept after the demo.")
@click.option("--replay", type=click.Path(exists=True, resolve_path=True), default=None, callback=_archive_extra,
              help="--train: train a fresh model again on the batches a run trained, from its archive (a directory "
              "--archive kept) or a dataset `rollstream export` wrote, offline, as trained (Consumer.from_archive; "
              "--steps: through that step), and print its weights' digest, which equals the run's "
              "(docs/training.md; needs the archive extra).")
@click.option("--json", "as_json", is_flag=True, help="Also print the summary's figures as one JSON line after the "
              "table, with the checker's counts and `ok` (with --train, also the rules the run `failed`).")
def demo(train: bool, steps: int, plot: str, as_json: bool, max_staleness: int | None, group_filter: str | None,
         device: str, archive: str | None, replay: str | None, **options) -> None:
    """Run the whole pipeline on loopback with embedded defaults: a broker,
    synthetic producers and a trainer of --dp-size ranks that validates,
    takes a mock step and commits every batch, with live progress, a
    summary and the end-to-end checker's verdict (exit status 1 when it
    finds anything). With --train, producers sample from a small torch
    model and the trainer learns from their rollouts; exit status 1 when
    the checker finds anything, a replayed log-prob misses the sampler's
    or the reward does not rise (docs/training.md)."""
    import json

    from .harness import ArchiveBehind

    if replay is not None:
        if not train:
            raise click.UsageError("--replay trains again: expected it with --train")
        summary = _retrain(replay, steps, device)
        if as_json:
            click.echo(json.dumps(summary))
        return
    try:
        summary = _run_demo(train, steps, plot, max_staleness, group_filter, device, archive, options)
    except ArchiveBehind as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(summary))
    if not summary["ok"]:
        raise SystemExit(1)


def _retrain(source: str, steps: int, device: str) -> dict:
    """`demo --train --replay`: the run's batches trained again offline; its summary, shown as a few lines."""
    from rollstream.common.errors import InvalidInput

    from .train_demo import retrain_from_archive

    try:
        summary = retrain_from_archive(source, steps=steps, device=device, progress=click.echo)
    except InvalidInput as exc:
        raise click.BadParameter(str(exc), param_hint="--replay") from None
    click.echo(f"trained again offline on {summary['steps']} steps of {source}: weights digest "
               f"{summary['weights_digest']}, replay max |diff| over the support "
               f"{summary['replay_max_abs_diff_support']}")
    return summary


def _run_demo(train: bool, steps: int, plot: str, max_staleness: int | None, group_filter: str | None, device: str,
              archive: str | None, options: dict) -> dict:
    """The demo's run, shown as it goes and then as a table; its summary."""
    if train:
        from .train_demo import run_train_demo
        from .train_demo import summary_table as train_summary_table

        summary = run_train_demo(steps=steps, producers=options["producers"], group_size=options["group_size"],
                                 batch_groups=options["batch_size"], turns=options["turns"],
                                 plot=plot or None, keep_data=options["keep_data"], chaos=options["chaos"],
                                 max_staleness=max_staleness, group_filter=group_filter,
                                 endpoints_file=options["endpoints_file"], device=device, progress=click.echo,
                                 **({} if archive is None else {"archive": archive, "timeout": options["timeout"]}))
        click.echo(train_summary_table(summary))
    else:
        summary = _synthetic_demo(max_staleness=max_staleness, group_filter=group_filter, device=device,
                                  **({} if archive is None else {"archive": archive}), **options)
    return summary


def _synthetic_demo(**options) -> dict:
    """The synthetic demo's run, shown live and then as a table; its summary."""
    from rich.console import Console

    from .demo import live_progress, run_demo, summary_table

    if options["trajectories"] % options["group_size"]:
        raise click.BadParameter(f"must be a multiple of --group-size {options['group_size']} (whole groups), "
                                 f"got {options['trajectories']}", param_hint="--trajectories")
    console = Console()
    bars, show = live_progress(console, options["producers"] * options["trajectories"])
    with bars:
        summary = run_demo(show=show, **options)
    console.print(summary_table(summary))
    return summary


if __name__ == "__main__":
    main()
