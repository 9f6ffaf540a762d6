"""`rollstream consume`: pull validated batches from brokers and print one
JSON line per batch, to inspect a deployment or drain it by hand."""
from __future__ import annotations

import json

import click

from rollstream.common.config import SETTINGS_CONTEXT, settings_options

from .settings import ConsumeSettings


@click.command(context_settings=SETTINGS_CONTEXT)
@settings_options(ConsumeSettings)
def consume(**values):
    """Pull validated batches and print, per batch, its trajectory ids and metrics as one JSON line."""
    from rollstream.common.config import settings_from
    from rollstream.common.curve import CurveError
    from rollstream.common.errors import InvalidInput
    from rollstream.common.logs import setup_logging

    from .client import Consumer
    from .settings import consume_problems

    settings = settings_from(ConsumeSettings, values, consume_problems)
    setup_logging(settings.log_level)
    batch_size = 8 if settings.batch_size is None and settings.batch_tokens is None else settings.batch_size
    try:
        consumer = Consumer(list(settings.endpoint), batch_size=batch_size, batch_tokens=settings.batch_tokens,
                            unit=settings.unit, vocab_size=settings.vocab_size, on_invalid=settings.on_invalid,
                            reward_key=settings.reward_key, device=settings.device,
                            curve_secret_key=settings.curve_secret_key, curve_server_key=settings.curve_server_key,
                            checkpointed=False, job=settings.job)  # an inspector has no checkpoint: what it acks is deleted
    except (CurveError, InvalidInput) as exc:
        raise click.ClickException(str(exc)) from None
    with consumer:
        count = 0
        while not settings.batches or count < settings.batches:
            try:
                batch = consumer.next_batch(settings.timeout)
            except TimeoutError as exc:
                raise click.ClickException(str(exc)) from None
            (consumer.commit if settings.commit else consumer.release)(batch)
            count += 1
            click.echo(json.dumps({"seq": batch.seq, "trajectory_ids": list(batch.trajectory_ids), **batch.metrics()}))
