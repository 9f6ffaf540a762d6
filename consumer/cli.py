"""`rollstream consume`: pull validated batches from brokers and print one
JSON line per batch, to inspect a deployment or drain it by hand."""
from __future__ import annotations

import json

import click

from rollstream.common.contract import CreditUnit
from rollstream.common.curve import curve_client_options

from .assembly import POLICIES


@click.command()
@click.option("--endpoint", "endpoints", multiple=True, required=True, help="A broker's consumer endpoint (repeatable).")
@click.option("--batch-size", type=int, default=None,
              help="Units (trajectories or groups) per batch: 8 by default; with --batch-tokens alone, that "
                   "budget's unit cap (at most 256).")
@click.option("--batch-tokens", type=int, default=None,
              help="Close a batch before the unit that would take it past this many prompt + response tokens.")
@click.option("--unit", type=click.Choice([str(unit) for unit in CreditUnit]), default=str(CreditUnit.TRAJECTORY),
              show_default=True, help="What a batch counts.")
@click.option("--batches", default=0, show_default=True, help="Stop after this many batches; 0 runs until interrupted.")
@click.option("--vocab-size", type=int, default=None, help="Refuse token and support ids outside [0, vocab_size).")
@click.option("--on-invalid", type=click.Choice(POLICIES), default="raise", show_default=True,
              help="raise: stop on an invalid batch; quarantine: dead-letter invalid trajectories and go on.")
@click.option("--reward-key", default=None, help="Key of a map reward to use as the scalar reward.")
@click.option("--commit/--release", default=True, show_default=True,
              help="Ack each batch, or give it back for redelivery (inspect without consuming).")
@click.option("--device", default=None, help="torch device for the batches (default: cuda if present, else cpu).")
@click.option("--timeout", type=float, default=None, help="Seconds to wait for a batch before giving up.")
@click.option("--log-level", default="warning", show_default=True, help="debug, info, warning or error.")
@click.option("--job", default="default", show_default=True, help="The job whose trajectories to read.")
@curve_client_options
def consume(endpoints, batch_size, batch_tokens, unit, batches, vocab_size, on_invalid, reward_key, commit, device, timeout,
            log_level, job, curve_secret_key, curve_server_key):
    """Pull validated batches and print, per batch, its trajectory ids and metrics as one JSON line."""
    from rollstream.common.curve import CurveError
    from rollstream.common.errors import InvalidInput
    from rollstream.common.logs import setup_logging

    from .client import Consumer

    setup_logging(log_level)
    if batch_size is None and batch_tokens is None:
        batch_size = 8
    try:
        consumer = Consumer(list(endpoints), batch_size=batch_size, batch_tokens=batch_tokens, unit=unit,
                            vocab_size=vocab_size, on_invalid=on_invalid, reward_key=reward_key, device=device,
                            curve_secret_key=curve_secret_key, curve_server_key=curve_server_key,
                            checkpointed=False, job=job)  # an inspector has no checkpoint: what it acks is deleted
    except (CurveError, InvalidInput) as exc:
        raise click.ClickException(str(exc)) from None
    with consumer:
        count = 0
        while not batches or count < batches:
            try:
                batch = consumer.next_batch(timeout)
            except TimeoutError as exc:
                raise click.ClickException(str(exc)) from None
            (consumer.commit if commit else consumer.release)(batch)
            count += 1
            click.echo(json.dumps({"seq": batch.seq, "trajectory_ids": list(batch.trajectory_ids), **batch.metrics()}))
