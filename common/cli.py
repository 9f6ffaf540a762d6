"""The `rollstream` command. Each component adds its subcommands here;
heavy imports happen inside the commands so `--help` stays fast."""
from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "ROLLSTREAM"})
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


def _register() -> None:
    from rollstream.broker.cli import broker, requeue, status

    for command in (broker, status, requeue):
        main.add_command(command)


_register()

if __name__ == "__main__":
    main()
