"""The producer daemon: one source feeding one `AsyncProducer` until the
source is done or SIGTERM/SIGINT arrives, then a clean shutdown that waits
for in-flight acks up to `shutdown_timeout` (the rest stays in the spool)."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket

from rollstream.common.config import Problem
from rollstream.common.curve import client_key_problems
from rollstream.common.errors import InvalidInput
from rollstream.common.jobs import JOB_PATTERN, is_job

from .client import AsyncProducer
from .settings import ProducerSettings
from .sources import source_factory, source_names

log = logging.getLogger("rollstream.producer")


def violations(settings: ProducerSettings) -> list[Problem]:
    """Settings no source can run with: one problem per rule broken, naming
    the rule and the value (`rollstream producer` adds where it came from)."""
    rules = [
        ("source", settings.source in source_names(), f"one of the registered sources {sorted(source_names())}"),
        ("turns", settings.turns >= 1, ">= 1"),
        ("group_size", settings.group_size >= 1, ">= 1"),
        ("concurrency", settings.concurrency >= 1, ">= 1"),
        ("trajectories", settings.trajectories >= 0, ">= 0 (0: no limit)"),
        ("rate", settings.rate >= 0, ">= 0 (0: unpaced)"),
        ("abort_rate", 0 <= settings.abort_rate <= 1, "in [0, 1]"),
        ("retry_rate", 0 <= settings.retry_rate <= 1, "in [0, 1]"),
        ("vocab_size", settings.vocab_size >= 3, ">= 3"),
        ("prompt_tokens", settings.prompt_tokens >= 1, ">= 1"),
        ("response_tokens", settings.response_tokens >= 1, ">= 1"),
        ("tool_tokens", settings.tool_tokens >= 0, ">= 0"),
        ("tool_seconds", settings.tool_seconds >= 0, ">= 0"),
        ("shutdown_timeout", settings.shutdown_timeout >= 0, ">= 0"),
        ("job", is_job(settings.job), f"a job name matching {JOB_PATTERN}"),
    ]
    problems = [Problem(name, "", expected, repr(getattr(settings, name))) for name, ok, expected in rules if not ok]
    return problems + client_key_problems(settings.curve_secret_key, settings.curve_server_key)


def check(settings: ProducerSettings) -> None:
    """Refuse settings no source can run with, naming every rule broken."""
    problems = violations(settings)
    if problems:
        raise InvalidInput("; ".join(map(str, problems)))


async def run(settings: ProducerSettings) -> int:
    """Run until the source is done or a stop signal; returns the number of
    frames left unsettled at exit."""
    check(settings)
    producer_id = settings.producer_id or f"{socket.gethostname()}-{settings.source}"
    source = source_factory(settings.source)(settings, producer_id)
    producer = AsyncProducer(
        settings.broker_endpoint, producer_id, window=settings.window, reply_timeout=settings.reply_timeout,
        retry_delay=settings.retry_delay, heartbeat_interval=settings.heartbeat_interval,
        heartbeat_timeout=settings.heartbeat_timeout, spool_dir=settings.spool_dir,
        spool_bytes=settings.spool_bytes, spool_fsync=settings.spool_fsync, vocab_size=settings.vocab_size,
        crc=settings.crc, check_content=settings.check_content, ledger=settings.ledger,
        curve_secret_key=settings.curve_secret_key, curve_server_key=settings.curve_server_key, job=settings.job,
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    server = producer.metrics.serve(settings.metrics_host, settings.metrics_port)
    await producer.start()
    log.info("producer daemon running", extra={"producer_id": producer_id, "source": settings.source,
                                               "broker": settings.broker_endpoint})
    work = asyncio.create_task(source.run(producer, stopping))
    stop = asyncio.create_task(stopping.wait())
    try:
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            log.info("stopping: finishing open trajectories", extra={"timeout": settings.shutdown_timeout})
            try:
                await asyncio.wait_for(work, settings.shutdown_timeout)
            except TimeoutError:
                log.warning("source did not stop in time; cancelled", extra={"timeout": settings.shutdown_timeout})
        failure = work.exception() if work.done() and not work.cancelled() else None
        if failure is not None:
            raise failure
    finally:
        stop.cancel()
        left = await producer.close(settings.shutdown_timeout)
        if server is not None:
            server[0].shutdown()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(signum)
    return left
