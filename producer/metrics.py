"""The producer's Prometheus metrics (one private registry per producer)."""
from __future__ import annotations

from rollstream.common.metrics import Metrics


class ProducerMetrics(Metrics):
    def __init__(self):
        super().__init__("rollstream_producer")
        self.sent = self.counter("frames_sent", "Frames transmitted for the first time, by message type", ("type",))
        self.resends = self.counter("resends", "Frames transmitted again (reconnect, reply timeout, transient refusal)")
        self.acked = self.counter("frames_acked", "Frames the broker acked durably, by outcome", ("outcome",))
        self.nacked = self.counter("frames_nacked", "Frames the broker refused, by reply code", ("code",))
        self.ignored = self.counter("replies_ignored", "Replies that were undecodable or answered no frame of ours")
        self.internal_errors = self.counter("internal_errors", "Replies whose handling failed inside the producer "
                                            "(a bug: dropped, logged with their digest; their frames go again)")
        self.reconnects = self.counter("reconnects", "Connections to the broker re-established")
        self.in_flight = self.gauge("in_flight", "Frames transmitted and not yet settled")
        self.held = self.gauge("window_frames", "Frames held in memory until settled")
        self.spool_bytes = self.gauge("spool_bytes", "Bytes of the disk spool")
        self.backlog = self.gauge("spool_backlog", "Spooled frames waiting for room in the window")
        self.broker_up = self.gauge("broker_up", "1 while the broker answers within the heartbeat timeout")
        self.ack_latency = self.histogram(
            "ack_latency_seconds", "From accepting a frame to the broker's durable reply",
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0),
        )
        self.trajectories = self.counter("trajectories", "Trajectories a source finished, by how", ("outcome",))
        self.resumed = self.counter("resumed", "Trajectories a restarted daemon found open at its broker, by what it did "
                                    "with them (on_restart): continued, restarted (from turn 0) or aborted", ("action",))
        self.support_overflows = self.counter(
            "support_overflows", "Engine calls refused because a sampled token's support outgrew the engine's cap, by "
            "what the source did: narrowed (asked again with half the top-k) or gave_up (the trajectory aborted)",
            ("action",))
        self.given_up = self.counter(
            "given_up", "Trajectories of halting handles given up because the broker refused one of their turns or "
            "their end (aborted, `given_up` in the ledger), by the refusal's code", ("code",))
        self.tokens = self.counter("tokens", "Response tokens submitted, sampled or forced", ("kind",))
