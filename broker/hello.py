"""What a broker answers a `hello` with, and what each connection's hello
negotiated (docs/protocol.md §3, §4), sans-I/O.

A producer may ask for batched acknowledgements, say it sends frame
batches, say it reads a job's branch as `branch` and ask whether the
broker hands back its open trajectories (`lists_open`);
a consumer says which `deliver` layouts it reads and whether it wants
queued counts. Each choice holds for its
connection until the next hello. The service asks `welcome_producer` /
`welcome_consumer` for the welcome's fields, and consults what was
negotiated when it answers or delivers.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

# Hello flags a consumer may set, each echoed in its welcome (§4): the `deliver` layouts it reads, and whether it
# wants to be told how many trajectories wait queued here.
CONSUMER_OPTIONS = ("packed_arrays", "split_arrays", "queued_counts")


class Hellos:
    """The broker's side of every connection's handshake."""

    def __init__(self, broker_id: str, *, max_message_bytes: int, lease_timeout: float, heartbeat_interval: float):
        self.broker_id = broker_id
        self.max_message_bytes = max_message_bytes
        self.lease_timeout = lease_timeout
        self.heartbeat_interval = heartbeat_interval
        self.batch_acks: set[bytes] = set()  # producer connections that asked for one `acks` per commit
        self.reads_branch: set[bytes] = set()  # producer connections told a job's branch as `branch` (else `lineage`)
        self.options: dict[bytes, frozenset[str]] = {}  # consumer connection -> the `CONSUMER_OPTIONS` its hello set

    def welcome_producer(self, identity: bytes, hello: Mapping[str, Any], window: int) -> dict[str, Any]:
        """The welcome's fields for a producer's hello, granting `window`
        frames in flight: batched acks when asked for, word that this
        broker reads frame batches when the producer sends them, and that it
        names a job's branch `branch` when the producer reads that name."""
        fields: dict[str, Any] = {"broker_id": self.broker_id, "max_message_bytes": self.max_message_bytes,
                                  "window": window}
        if "seq" in hello:
            fields["seq"] = hello["seq"]
        if hello.get("batch_acks"):
            self.batch_acks.add(identity)
            fields["batch_acks"] = True
        else:
            self.batch_acks.discard(identity)
        if hello.get("batch_frames"):
            fields["batch_frames"] = True
        if hello.get("reads_branch"):
            self.reads_branch.add(identity)
            fields["reads_branch"] = True
        else:
            self.reads_branch.discard(identity)
        if "job" in hello:  # echoed: this broker keeps jobs apart (the job travels on each frame)
            fields["job"] = hello["job"]
        if hello.get("lists_open"):  # echoed: this broker hands a producer back its open trajectories
            fields["lists_open"] = True
        return fields

    def forget_producer(self, identity: bytes) -> None:
        self.batch_acks.discard(identity)
        self.reads_branch.discard(identity)

    def branch_field(self, identity: bytes) -> str:
        """The name producer connection `identity` reads a job's branch
        under: `branch`, or `lineage` for one whose hello did not ask."""
        return "branch" if identity in self.reads_branch else "lineage"

    def welcome_consumer(self, identity: bytes, hello: Mapping[str, Any], live: Collection[bytes]) -> dict[str, Any]:
        """The welcome's fields for a consumer's hello, with the options it
        set echoed; connections no longer `live` are forgotten."""
        for gone in self.options.keys() - set(live):
            del self.options[gone]
        options = frozenset(name for name in CONSUMER_OPTIONS if hello.get(name))
        self.options[identity] = options
        fields: dict[str, Any] = {"broker_id": self.broker_id, "lease_timeout": self.lease_timeout,
                                  "heartbeat_interval": self.heartbeat_interval, **dict.fromkeys(options, True)}
        if "seq" in hello:
            fields["seq"] = hello["seq"]
        if "job" in hello:  # echoed: this broker hands the connection its job's trajectories only
            fields["job"] = hello["job"]
        return fields

    def options_of(self, identity: bytes) -> frozenset[str]:
        """The `CONSUMER_OPTIONS` consumer connection `identity` set."""
        return self.options.get(identity, frozenset())
