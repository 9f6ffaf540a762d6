"""`rollstream producer`: the long-running producer daemon."""
from __future__ import annotations

import click

from rollstream.common.config import SETTINGS_CONTEXT, config_option, settings_options

from .settings import ProducerSettings


@click.command(context_settings=SETTINGS_CONTEXT)
@config_option(ProducerSettings, "producer")
@settings_options(ProducerSettings)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
def producer(log_format: str, **values) -> None:
    """Run a producer daemon: generate or replay rollouts and stream their
    turns to the node's broker, resending until every frame is acked."""
    import asyncio

    from rollstream.common.config import ConfigError, located, settings_from
    from rollstream.common.logs import setup_logging

    from .daemon import run, violations
    from .replay import ReplayError
    from .source import SourceSettingsError
    from .spool import SpoolError

    settings = settings_from(ProducerSettings, values, violations)
    setup_logging(settings.log_level, log_format)
    try:
        asyncio.run(run(settings))
    except ConfigError as exc:  # what only a start finds: a metrics port another process holds, say
        raise ConfigError(located(exc.problems)) from None
    except SourceSettingsError as exc:
        raise click.BadParameter(str(exc)) from None
    except (ReplayError, SpoolError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
