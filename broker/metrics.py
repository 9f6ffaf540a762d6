"""The broker's Prometheus metrics, and what it counts and logs of its
decisions (the core's effects and outcomes, the gauges of its status)."""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping

from rollstream.common.metrics import Metrics

from .engine import DeadLetter, DropTrajectory, Effect, MarkGap

log = logging.getLogger("rollstream.broker")
# Dead-letter reasons counted as exits of their own; of them, those that throw data away on purpose (logged at info).
EXITS = ("expired", "unreadable", "stale", "reward_expired", "abandoned")
ON_PURPOSE = ("stale", "abandoned")


class BrokerMetrics(Metrics):
    """Caller: the broker's thread (the core, the service, its `StoreIO`
    and `CurveGuard`): every update (`inc`, `Counter.add`,
    `Histogram.observe`, `count_outcomes`, `count_effects`, `show`) and
    `totals`, for `status`. Affects: the counters, histograms and gauges.
    Caller: the /metrics server's thread, `collect` at each scrape (and
    the gauges' own, which lock). Affects: nothing."""

    def __init__(self):
        super().__init__("rollstream_broker")
        self.frames = self.counter("frames", "Producer frames by message type and outcome", ("type", "outcome"))
        self.nacks = self.counter("nacks", "Refused messages by endpoint and reply code", ("endpoint", "code"))
        self.internal_errors = self.counter("internal_errors", "Messages whose handling failed inside the broker (a "
                                            "bug: refused as `internal`, logged with their digest), by endpoint",
                                            ("endpoint",))
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
        self.bytes = self.gauge("bytes", "Bytes held, in memory and on disk (unsealed: of it, trained and not "
                                "yet sealed)", ("where",))
        self.oldest_unsealed = self.gauge("oldest_unsealed_step", "The earliest step of a trained trajectory not "
                                          "yet sealed (-1: none)")
        self.backpressure = self.gauge("backpressure",
                                       "1 while producer frames are not all taken (memory budget: none read; disk: some wait)")
        self.unavailable = self.gauge("store_unavailable", "1 while the store cannot persist")
        self.starving = self.gauge("starving", "1 while a job starves: nearly all of it thrown away (filtered, stale) "
                                   "or its consumer waiting with nothing queued (idle)", ("job", "cause"))
        self.filtered = self.counter("filtered", "Trajectories dead-lettered by a group filter, by filter", ("filter",))
        self.staleness = self.histogram(
            "staleness", "Policy versions between a delivered trajectory's oldest turn and its trainer's",
            (0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
        )
        self.abandoned = self.counter("abandoned", "Trajectories sampled by weights of a lineage a resumed trainer "
                                      "abandoned, by what was done with them (abandoned_lineage)", ("action",))
        self.dead_pruned = self.counter("dead_letters_pruned", "Dead letters deleted, oldest first, to keep them "
                                        "within max_dead_letter_bytes, by reason", ("reason",))
        self.resumed = self.counter("resumed", "Trajectories handed back to a restarted producer (listed), and what it "
                                    "did with them: continued, restarted (from turn 0) or aborted", ("action",))
        self.admission_waits = self.counter("admission_waits", "Turns opening a trajectory told to wait by the "
                                            "staleness capacity (resent by their producer)")
        self.commit_seconds = self.histogram(
            "commit_seconds", "Time to make one batch durable",
            (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.received_bytes = self.counter("received_bytes", "Bytes of producer frames read")
        self.archive_rows = self.counter("archive_rows", "Trajectories written to the archive (durable, then deleted)")
        self.archive_bytes = self.counter("archive_bytes", "Bytes of archive files written")
        self.archive_failures = self.counter("archive_failures", "Archive files that could not be written (their "
                                                                 "rows are kept and written again)")
        self.archive_waiting = self.gauge("archive_waiting", "Trajectories kept in the store until the archive holds "
                                                             "them")
        self.trajectories_acked = self.counter("trajectories_acked", "Trajectories consumers acked (trained, or "
                                               "delivered and forgotten), once durable")
        self.ack_seconds = self.histogram(
            "ack_seconds", "Time from reading a batch of producer frames to sending its acks (decode, check, merge, "
            "commit), once per batch", (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )

    def resumed_counts(self) -> dict[str, int]:
        """`resumed` by action, for `status` (empty until a producer was handed any back)."""
        return {action: int(value) for (action,), value in sorted(self.resumed.values.items())}

    def count_outcomes(self, acked: Iterable[tuple[str, Mapping]]) -> None:
        """Frames by type and outcome (`acked`: each acked message's type and
        ack fields), once their batch is durable; one counter update per
        kind of outcome, not per frame."""
        outcomes = Counter([(kind, "duplicate" if "duplicate" in ack and ack["duplicate"] else
                             "applied" if ack["applied"] else ack.get("reason", "not_applied")) for kind, ack in acked])
        for (kind, outcome), count in outcomes.items():
            self.inc(self.frames, count, type=kind, outcome=outcome)

    def count_effects(self, effects: Iterable[Effect]) -> None:
        """The exits, replay gaps and dead letters among durable effects,
        counted and logged (turns are counted by `count_outcomes`)."""
        for effect in effects:
            match effect:
                case MarkGap():
                    self.inc(self.gaps, field=effect.gap.field)
                    log.info("replay gap", extra={"trajectory_id": effect.trajectory_id, "turn": effect.gap.turn,
                                                  "field": effect.gap.field})
                case DropTrajectory():
                    self.inc(self.exits, exit="aborted")
                    log.info("trajectory aborted", extra={"trajectory_id": effect.trajectory_id})
                case DeadLetter():
                    filtered = effect.reason.startswith("filtered:")
                    exit_label = ("filtered" if filtered else effect.reason
                                  if effect.reason in EXITS else "dead")
                    self.inc(self.exits, exit=exit_label)
                    if filtered:
                        self.inc(self.filtered, filter=effect.reason.partition(":")[2])
                    elif effect.reason == "abandoned":
                        self.inc(self.abandoned, action="dropped")
                    (log.info if filtered or effect.reason in ON_PURPOSE else log.warning)(  # expected ones: info
                        "trajectory dead-lettered", extra={"trajectory_id": effect.trajectory_id, "reason": effect.reason})
                case _:
                    pass

    def show(self, status: Mapping) -> None:
        """The gauges of a `status`: trajectories by state, bytes held."""
        for state in ("open", "scoring", "awaiting_group", "queued", "leased", "dead", "unsealed"):
            self.depth.labels(state=state).set(status[state])
        self.bytes.labels(where="memory").set(status["bytes_in_memory"])
        self.bytes.labels(where="disk").set(status["bytes_on_disk"])
        self.bytes.labels(where="unsealed").set(status["unsealed_bytes"])
        self.oldest_unsealed.set(status.get("oldest_unsealed_step", -1))
