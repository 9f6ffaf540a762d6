"""The producer daemon: one source feeding one `AsyncProducer` until the
source is done or SIGTERM/SIGINT arrives, then a clean shutdown that waits
for in-flight acks up to `shutdown_timeout` (the rest stays in the spool)."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket

from rollstream.common.config import Problem, check_settings
from rollstream.common.curve import client_key_problems

from .client import AsyncProducer
from .settings import ProducerSettings
from .sources import source_factory

log = logging.getLogger("rollstream.producer")


def violations(settings: ProducerSettings) -> list[Problem]:
    """What a start would refuse in settings each of whose values its
    declaration takes (`ProducerSettings`): CURVE key files that are not
    a pair, or one given without the other."""
    return client_key_problems(settings.curve_secret_key, settings.curve_server_key)


def check(settings: ProducerSettings) -> None:
    """Refuse settings no source can run with, naming every rule broken."""
    check_settings(settings, violations)


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
