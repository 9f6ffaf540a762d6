"""The producer daemon's sources by name: what `--source NAME` runs.

The producer ships `synthetic`, `sglang`, `vllm` and `replay`. A layer above the
producer adds its own with `register_source` before the daemon's command
runs: the `rollstream` command (`rollstream.app.cli`) adds `model`, which
samples from the app layer's small torch LM. The producer itself never
imports such a source, so it stays free of what the source needs (torch).

A source is registered as a loader, called only when a daemon runs that
source, so registering one imports nothing and `--help` stays fast.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from rollstream.common.errors import NotFound

if TYPE_CHECKING:
    import asyncio

    from .client import AsyncProducer
    from .settings import ProducerSettings


class Source(Protocol):
    """An episode source: built from the daemon's settings and producer id,
    then run until its jobs run out or `stopping` is set."""

    async def run(self, producer: AsyncProducer, stopping: asyncio.Event) -> None: ...


SourceFactory = Callable[["ProducerSettings", str], Source]
SourceLoader = Callable[[], SourceFactory]


def _synthetic() -> SourceFactory:
    from .synthetic import SyntheticSource

    return SyntheticSource


def _sglang() -> SourceFactory:
    from .sglang import SGLangSource

    return SGLangSource


def _vllm() -> SourceFactory:
    from .vllm import VLLMSource

    return VLLMSource


def _replay() -> SourceFactory:
    from .replay import ReplaySource

    return ReplaySource


_LOADERS: dict[str, SourceLoader] = {"synthetic": _synthetic, "sglang": _sglang, "vllm": _vllm, "replay": _replay}


def register_source(name: str, load: SourceLoader) -> None:
    """Make `--source name` run what `load()` returns: a factory taking the
    settings and the producer id. `load` is called when a daemon runs the
    source, not now. Registering a name again replaces its loader."""
    _LOADERS[name] = load


def source_names() -> tuple[str, ...]:
    """The registered sources, in registration order."""
    return tuple(_LOADERS)


def source_factory(name: str) -> SourceFactory:
    """The factory of source `name`, loaded now."""
    try:
        load = _LOADERS[name]
    except KeyError:
        raise NotFound(f"no producer source is registered as {name!r}: expected one of {sorted(_LOADERS)} "
                       "(the `rollstream` command registers `model`)") from None
    return load()
