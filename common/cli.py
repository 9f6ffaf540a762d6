"""The `rollstream` command. Each component adds its subcommands here;
heavy imports happen inside the commands so `--help` stays fast."""
from __future__ import annotations

import importlib

import click


# Subcommands load their module only when invoked, so `rollstream broker`
# never imports torch (the consumer's) and `--help` stays fast.
COMMANDS = {
    "broker": "rollstream.broker.cli:broker",
    "status": "rollstream.broker.cli:status",
    "requeue": "rollstream.broker.cli:requeue",
    "producer": "rollstream.producer.cli:producer",
    "consume": "rollstream.consumer.cli:consume",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in COMMANDS:
            module, _, attr = COMMANDS[name].partition(":")
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "ROLLSTREAM"})
@click.version_option(package_name="rollstream")
def main() -> None:
    """rollstream: stream RL rollouts with their sampling supports from
    producers through a durable per-node broker to training consumers."""


@main.command()
@click.option("--trajectories", default=64, show_default=True, help="Trajectories to build.")
@click.option("--turns", default=4, show_default=True, help="Turns per trajectory.")
@click.option("--seed", default=0, show_default=True, help="Random seed of the synthetic rollouts.")
def demo(trajectories: int, turns: int, seed: int) -> None:
    """Run the pipeline on synthetic rollouts with embedded defaults."""
    from .demo import run_demo

    click.echo(run_demo(trajectories=trajectories, turns=turns, seed=seed))


if __name__ == "__main__":
    main()
