"""The broker's Prometheus metrics."""
from __future__ import annotations

from rollstream.common.metrics import Metrics


class BrokerMetrics(Metrics):
    def __init__(self):
        super().__init__("rollstream_broker")
        self.frames = self.counter("frames", "Producer frames by message type and outcome", ("type", "outcome"))
        self.nacks = self.counter("nacks", "Refused messages by endpoint and reply code", ("endpoint", "code"))
        self.exits = self.counter("trajectories", "Trajectories leaving the broker, by exit", ("exit",))
        self.gaps = self.counter("replay_gaps", "Replay gaps by the field that went missing", ("field",))
        self.redeliveries = self.counter("redeliveries", "Trajectories delivered again after a lost lease")
        self.evictions = self.counter("evictions", "Trajectories moved out of memory by the memory budget, by state",
                                      ("state",))
        self.reloads = self.counter("reloads", "Evicted trajectories read back from the store")
        self.curve_refused = self.counter("curve_refused", "CURVE handshakes (and messages of revoked keys) refused, "
                                          "by socket and reason (key_not_allowed, no_keys, mechanism_mismatch, "
                                          "cryptographic, revoked, ...)",
                                          ("socket", "reason"))
        self.depth = self.gauge("queue_depth", "Trajectories by state", ("state",))
        self.bytes = self.gauge("bytes", "Bytes held, in memory and on disk", ("where",))
        self.backpressure = self.gauge("backpressure",
                                       "1 while producer frames are not all taken (memory budget: none read; disk: some wait)")
        self.unavailable = self.gauge("store_unavailable", "1 while the store cannot persist")
        self.commit_seconds = self.histogram(
            "commit_seconds", "Time to make one batch durable",
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
