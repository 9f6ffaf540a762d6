"""Prometheus helpers shared by the daemons and clients: a private registry
per owner (so several can live in one process, as in tests).

Counters and histograms are plain numbers that the hot paths add to (a dict
entry, a list slot), and Prometheus reads them when it scrapes: a producer
or broker counts several things per frame, and a prometheus-client metric
takes a lock and a call per update. `totals` is the flat view of every
counter for the admin `status` reply. Gauges, set a few times a second, are
prometheus-client's own.
"""
from __future__ import annotations

import bisect
import errno
from typing import Iterator

from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from .config import ConfigError, bind_problem


class Counter:
    """A counter with labels: a value per tuple of label values."""

    __slots__ = ("name", "doc", "labels", "values")

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]):
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[tuple, float] = {}

    def add(self, amount: float, *label_values: str) -> None:
        """Count `amount` under these label values, in declared order (the
        hot paths' call; `Metrics.inc` takes them by name)."""
        values = self.values
        values[label_values] = values.get(label_values, 0) + amount


class Histogram:
    """Observations counted into fixed buckets (upper bounds, ascending)."""

    __slots__ = ("name", "doc", "bounds", "counts", "sum")

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]):
        self.name, self.doc, self.bounds = name, doc, tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


class Metrics:
    """A registry of counters, histograms and gauges under one namespace."""

    def __init__(self, namespace: str):
        self.registry = CollectorRegistry()
        self.namespace = namespace
        self._counters: list[Counter] = []
        self._histograms: list[Histogram] = []
        self.registry.register(self)

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        counter = Counter(name, doc, labels)
        self._counters.append(counter)
        return counter

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, labels, namespace=self.namespace, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        histogram = Histogram(name, doc, buckets)
        self._histograms.append(histogram)
        return histogram

    @staticmethod
    def inc(counter: Counter, amount: float = 1, **labels: str) -> None:
        counter.add(amount, *labels.values())

    @property
    def totals(self) -> dict[str, float]:
        """Every counter's value as `name.label...` (labels in declared order)."""
        return {counter.name + "".join(f".{value}" for value in key): amount
                for counter in self._counters for key, amount in counter.values.items()}

    def collect(self) -> Iterator:
        """Prometheus's view, read at scrape time (the registry calls this).

        Caller: the /metrics server's thread (`serve`), while the owner
        updates the counters and histograms. Affects: nothing; each
        counter's dict and each histogram's counts are copied in one call,
        whole under the GIL, so a scrape sees an update or not, never half
        of one (a histogram's sum may hold one observation its counts do not
        yet)."""
        for counter in self._counters:
            family = CounterMetricFamily(f"{self.namespace}_{counter.name}", counter.doc, labels=counter.labels)
            for key, amount in list(counter.values.items()):
                family.add_metric(list(key), amount)
            yield family
        for histogram in self._histograms:
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, histogram.bounds), "+Inf"), list(histogram.counts)):
                cumulative += count
                buckets.append((bound, cumulative))
            yield HistogramMetricFamily(f"{self.namespace}_{histogram.name}", histogram.doc, buckets=buckets,
                                        sum_value=histogram.sum)

    def serve(self, host: str, port: int):
        """Expose /metrics on `host:port`; port 0 disables it. A port
        another process holds, or an address this host lacks, is a
        `ConfigError` naming the setting to change."""
        if not port:
            return None
        try:
            return start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            key = "metrics_port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "metrics_host"
            raise ConfigError([bind_problem(key, f"{host}:{port}", exc)]) from None
