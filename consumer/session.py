"""The consumer's conduct toward its brokers (docs/protocol.md §4), sans-I/O.

`Sessions` decides, for every broker connection, when to say hello (again),
when to heartbeat, what a reply means (a welcome, a delivery, a settlement,
each refusal code), and what goes out next, driving the `Assembler` that
holds the deliveries. `ConsumerCore` composes it: the client's I/O thread
only decodes what arrived, hands it to the core with the time, and sends
what `due` returns, so the whole handshake is testable without sockets or
clocks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Mapping

from rollstream.common.errors import InvalidState, RemoteProtocolError
from rollstream.common.failures import internal_error, log_internal
from rollstream.common.jobs import DEFAULT_JOB

from .assembly import Assembler, Outgoing
from .position import TrainingPosition

log = logging.getLogger("rollstream.consumer")

DEFAULT_HEARTBEAT = 1.0  # seconds, until a broker's welcome says otherwise
# The least admission share a broker is published, as a part of an equal share: one whose producers are
# quiet now keeps room for them to start again.
MIN_SHARE = 0.25
HEADER_CHECKED_AFTER = frozenset({"malformed", "version", "schema"})  # refusals raised before the header was checked


class SessionState(StrEnum):
    NEW = "new"  # must say hello
    HELLO_SENT = "hello_sent"  # waiting for the welcome
    WELCOMED = "welcomed"  # deliveries count, heartbeats go out


@dataclass
class BrokerSession:
    """One broker connection: where its handshake stands and when to speak next."""

    state: SessionState = SessionState.NEW
    hello_at: float = 0.0
    heartbeat_interval: float = DEFAULT_HEARTBEAT
    next_heartbeat: float = 0.0
    published: dict | None = None  # the policy this session was last sent (again after every welcome)
    bound: int | None = None  # the staleness bound its broker said is in force for the job
    demand: int | None = None  # what its broker last said the job holds there plus the opens it made wait


class Sessions:
    """Every broker connection of one consumer (by broker index).

    Two threads reach it, only through `ConsumerCore` and under its shell's
    lock (who calls what):
    - the I/O thread calls `received`, `undecodable`, `failed_inside` and
      `due`. Affects: each `BrokerSession` (handshake state, hello and
      heartbeat times, the policy it heard, its bound and demand), `welcomed_sessions`,
      and through them the `Assembler` and the `TrainingPosition`.
    - the trainer's thread calls `publish` (`ConsumerCore.publish`) and
      reads `stale_below` (`ConsumerCore.take`). Affects: `policy` and
      `shares`, which the I/O thread's next `due` sends.
    """

    def __init__(self, assembler: Assembler, endpoints: list[str], *, consumer_id: str, hello_timeout: float,
                 position: TrainingPosition | None = None, job: str = DEFAULT_JOB):
        self.assembler = assembler
        self.job = job  # named in every hello: brokers hand this consumer its job's trajectories only
        self.endpoints = endpoints
        self.consumer_id = consumer_id
        self.hello_timeout = hello_timeout
        self.position = position  # a checkpointing consumer's: its hello names the run, its welcome resumes and seals
        self.sessions = [BrokerSession() for _ in endpoints]
        self.welcomed_sessions = 0  # sessions WELCOMED now (the I/O loop reads handshake monitors while any is not)
        self._welcomed: list[int] = []  # brokers welcomed since the last `due`
        self.policy: dict | None = None  # what `publish` last set: sent to every broker once it is welcomed
        self.shares = [1.0 / len(endpoints)] * len(endpoints)  # with it, each broker's part of the capacity
        self.max_staleness: int | None = None  # the trainer's own bound (lowers its brokers')

    def publish(self, version: int, per_step: int | None = None) -> None:
        """The trainer's policy version now (and trajectories per step):
        sent to every broker with the trainer's own bound, each told its
        share of the admission capacity (`shares`)."""
        self.shares = self._shares()
        policy: dict = {"version": version}
        if self.max_staleness is not None:
            policy["max_staleness"] = self.max_staleness
        if per_step is not None:
            policy["per_step"] = per_step
        self.policy = policy
        self._with_ancestry()

    def _shares(self) -> list[float]:
        """Each broker's part of the job's admission capacity: in proportion
        to its demand (what it holds plus the new trajectories it made wait,
        from its last echo), none under `MIN_SHARE` of an equal share, so a
        busy node is not held to an idle one's room; equal until every
        broker has said."""
        n = len(self.sessions)
        demands = [session.demand for session in self.sessions]
        total = sum(d or 0 for d in demands)
        if None in demands or not total:
            return [1.0 / n] * n
        raw = [max(MIN_SHARE / n, (d or 0) / total) for d in demands]
        return [r / sum(raw) for r in raw]

    def _policy_for(self, broker: int) -> dict | None:
        return None if self.policy is None else {**self.policy, "share": self.shares[broker]}

    def _with_ancestry(self) -> None:
        """The published policy names this trainer's run's branches, once a resume started one."""
        position = self.position
        if self.policy is not None and position is not None and position.ancestry.branches:
            self.policy = {**self.policy, "branches": position.ancestry.to_wire()}

    @property
    def version(self) -> int | None:
        """The policy version the trainer last published."""
        return None if self.policy is None else self.policy["version"]

    def bound(self) -> int | None:
        """The staleness bound in force: the trainer's own, lowered by any its brokers named."""
        bounds = [b for b in (self.max_staleness, *(s.bound for s in self.sessions)) if b is not None]
        return min(bounds, default=None)

    def stale_below(self) -> int | None:
        """Versions below this are too old to train now (None: nothing is)."""
        bound, version = self.bound(), self.version
        return None if bound is None or version is None else version - bound

    def received(self, broker: int, message, now: float) -> None:
        """A decoded message from `broker`."""
        session, assembler, endpoint = self.sessions[broker], self.assembler, self.endpoints[broker]
        kind = message.type
        if kind == "welcome":
            if self.job != DEFAULT_JOB and message.get("job") != self.job:
                raise InvalidState(f"rule 'a broker keeps jobs apart' not met: broker {message['broker_id']} at "
                                   f"{endpoint} did not echo job {self.job!r} in its welcome (got {message.get('job')!r}); "
                                   "a broker of this version does")
            self.welcomed_sessions += session.state != SessionState.WELCOMED
            session.state = SessionState.WELCOMED
            session.published = None  # a new session (perhaps a new broker): it hears the policy again
            session.heartbeat_interval = message["heartbeat_interval"]
            session.next_heartbeat = now + session.heartbeat_interval / 2
            assembler.welcomed(broker, message["lease_timeout"],
                               message.get("queued", 0) if message.get("queued_counts") else None)
            self._welcomed.append(broker)
            if self.position is not None and "max_unsealed_bytes" in message.fields:
                self.position.budget(broker, message["max_unsealed_bytes"])
            log.info("connected to broker", extra={"endpoint": endpoint, "broker_id": message["broker_id"]})
        elif kind == "deliver":
            if session.state == SessionState.WELCOMED:  # anything else belongs to a session the broker has dropped
                assembler.delivered(broker, message.fields, message.arrays, now)
        elif kind in ("acked", "nacked"):
            assembler.settled(broker, message["leases"])
        elif kind == "queued":
            assembler.credit.told(broker, message["n"])
        elif kind == "revoked":
            assembler.credit.revoked(broker, message["queued"])
        elif kind == "policy":
            session.bound = message.get("max_staleness")
            if "held" in message.fields:
                session.demand = message["held"] + message.get("waiting", 0)
        elif kind == "resumed" and self.position is not None:
            if self.position.resumed(broker, message["replay"], message.get("epoch", 0)):
                self._with_ancestry()
        elif kind == "sealed" and self.position is not None:
            self.position.sealed(broker, message["step"])
        elif message["code"] in ("checkpoint_gone", "not_checkpointed") and self.position is not None:
            log.error("broker refused to resume", extra={"endpoint": endpoint, "code": message["code"],
                                                         "reason": message["message"]})
            self.position.refused(message["code"], message["message"])
        elif message["code"] == "unknown_consumer":
            if session.state == SessionState.WELCOMED:
                log.warning("broker forgot this consumer; saying hello again", extra={"endpoint": endpoint})
                assembler.lost(broker)
                session.state = SessionState.NEW
                self.welcomed_sessions -= 1
        elif message["code"] == "stale_lease":
            assembler.settled(broker, message.get("leases", ()), stale=True)
        elif message["code"] == "unavailable":
            assembler.unavailable(broker, message.get("leases", ()), now)
            session.published = None  # the refused message may have been the policy: it is sent again
        else:
            log.warning("broker refused a message", extra={"endpoint": endpoint, "code": message["code"],
                                                           "reason": message["message"]})
            assembler.settled(broker, message.get("leases", ()))

    def undecodable(self, broker: int, header: Mapping[str, Any], error: RemoteProtocolError) -> None:
        """A message from `broker` that did not decode (`header`: what of its
        header could be read). A delivery's lease goes back to the broker,
        requeued when only its bytes were damaged on the way (a CRC)."""
        endpoint = self.endpoints[broker]
        if error.code == "internal":  # its decoding raised what no rule foresaw (logged where it was caught)
            self.assembler.stats.internal_errors += 1
        lease = header.get("lease")
        if header.get("type") == "deliver" and isinstance(lease, str) and self.sessions[broker].state == SessionState.WELCOMED:
            log.warning("undecodable delivery", extra={"endpoint": endpoint, "code": error.code, "reason": error.message})
            credit_fields = {"lease": lease}
            if error.code not in HEADER_CHECKED_AFTER:  # its header passed the schema check
                credit_fields.update({k: header[k] for k in ("group_id", "group_size", "group_left") if k in header})
            self.assembler.undecodable(broker, credit_fields, f"{error.code}: {error.message}",
                                       requeue=error.code == "crc_mismatch")
        else:
            log.warning("unreadable message from broker", extra={"endpoint": endpoint, "code": error.code,
                                                                 "reason": error.message})

    def failed_inside(self, broker: int, message_type: str | None, fields: Mapping[str, Any], frames,
                      exc: Exception) -> None:
        """Handling a message from `broker` raised `exc`, which no rule
        foresaw: counted, logged once, and a delivery this client did not
        take in is refused (`nack`, dead-lettered at the broker under an
        `internal` reason, revivable there), so its lease is not left to run
        out; the loop goes on with the next message."""
        self.assembler.stats.internal_errors += 1
        log_internal(log, exc, self.endpoints[broker], message_type, frames)
        lease, tid = fields.get("lease"), fields.get("trajectory_id")
        if (message_type == "deliver" and isinstance(lease, str) and isinstance(tid, str) and not self.assembler.holds(tid)
                and self.sessions[broker].state == SessionState.WELCOMED):
            error = internal_error(exc, message_type, frames)
            self.assembler.undecodable(broker, {**fields, "lease": lease}, f"{error.code}: {error.message}", requeue=False)

    def due(self, now: float, *, closing: bool) -> list[Outgoing]:
        """Everything to send now, as (broker, type, fields): hellos (again
        after `hello_timeout` without a welcome), credit, settlements, and a
        heartbeat to a broker that has heard nothing else for half its
        interval (any message counts as one). While closing: no hello, no
        credit, and deliveries still arriving on old credit go straight back."""
        assembler = self.assembler
        out: list[Outgoing] = []
        for broker, session in enumerate(self.sessions):
            retry_hello = session.state == SessionState.HELLO_SENT and now - session.hello_at > self.hello_timeout
            if (session.state == SessionState.NEW or retry_hello) and not closing:
                hello = {"consumer_id": self.consumer_id, "packed_arrays": True, "split_arrays": True,
                         "queued_counts": True}
                if self.job != DEFAULT_JOB:
                    hello["job"] = self.job
                if self.position is not None:
                    hello.update(self.position.hello_fields())
                out.append(Outgoing(broker, "hello", hello))
                session.state, session.hello_at = SessionState.HELLO_SENT, now
            policy = self._policy_for(broker)
            if (session.state == SessionState.WELCOMED and policy is not None and session.published != policy
                    and (self.position is None or self.position.answered(broker))):  # its epoch known first
                out.append(Outgoing(broker, "policy", policy))
                session.published = policy
        assembler.expire(now)
        if closing:
            assembler.release()
        else:
            # After a resume, new data waits until a broker has answered it and heard this lineage's policy.
            position = self.position
            withheld = () if position is None else [b for b in range(len(self.sessions)) if not position.answered(b)]
            for broker, n in assembler.credit_grants(withheld).items():
                out.append(Outgoing(broker, "credit", {"n": n, "unit": assembler.unit}))
        out += assembler.take_outbox()
        if self.position is not None:  # after the acks resent to a new session: the resume then knows of them
            out += [Outgoing(broker, kind, fields) for broker in self._welcomed
                    for kind, fields in self.position.on_welcome(broker)]
        self._welcomed.clear()
        spoken = {broker for broker, _, _ in out}
        for broker, session in enumerate(self.sessions):
            if session.state != SessionState.WELCOMED:
                continue
            if broker not in spoken and now >= session.next_heartbeat:
                out.append(Outgoing(broker, "heartbeat", {}))
            if broker in spoken or now >= session.next_heartbeat:
                session.next_heartbeat = now + session.heartbeat_interval / 2
        return out
