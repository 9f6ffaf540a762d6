"""Prometheus helpers shared by the daemons: a private registry per daemon
(so several can live in one process, as in tests) whose counters are also
readable as a plain dict for the admin `status` reply."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    """A registry plus a flat view of every counter's value."""

    def __init__(self, namespace: str):
        self.registry = CollectorRegistry()
        self.namespace = namespace
        self.totals: dict[str, float] = {}
        self._names: dict[int, str] = {}
        self._children: dict[tuple, object] = {}
        self._keys: dict[tuple, str] = {}

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        counter = Counter(name, doc, labels, namespace=self.namespace, registry=self.registry)
        self._names[id(counter)] = name
        return counter

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, labels, namespace=self.namespace, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, namespace=self.namespace, registry=self.registry, buckets=buckets)

    def inc(self, counter: Counter, amount: float = 1, **labels: str) -> None:
        slot = (id(counter), *labels.values())
        child = self._children.get(slot)
        if child is None:  # first use of these labels: resolve them once
            child = counter.labels(**labels) if labels else counter
            self._children[slot] = child
            self._keys[slot] = self._names[id(counter)] + "".join(f".{value}" for value in labels.values())
        child.inc(amount)
        key = self._keys[slot]
        self.totals[key] = self.totals.get(key, 0) + amount

    def serve(self, host: str, port: int):
        """Expose /metrics on `host:port`; port 0 disables it."""
        if not port:
            return None
        try:
            return start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise RuntimeError(f"cannot serve metrics on {host}:{port} ({exc.strerror}); "
                               "choose another --metrics-port, or 0 to disable it") from None
