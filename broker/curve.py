"""The broker's CURVE I/O shell: it makes each socket a CURVE server, answers
libzmq's authentication requests with the `Gatekeeper`'s verdicts, counts
and logs refused handshakes (those with a key by its fingerprint, those
without one from the sockets' monitors), and reloads the key directories on
SIGHUP. A connection is named by its key's fingerprint (ZAP's user id, on
every message it sends), so a key removed at a reload stops counting at
once, for connections it already has too. Everything it decides is in
`rollstream.common.curve`."""
from __future__ import annotations

import logging
from pathlib import Path

import zmq
from zmq.utils.monitor import parse_monitor_message

from rollstream.common.curve import (
    HANDSHAKE_FAILURES,
    ZAP_ENDPOINT,
    Gatekeeper,
    KeyPair,
    ZapRequest,
    apply_server,
    fingerprint,
    handshake_failure_reason,
    load_allowed,
)
from rollstream.common.errors import InvalidInput, InvalidState

from .metrics import BrokerMetrics
from .settings import CURVE_DIRECTORIES, BrokerSettings

log = logging.getLogger("rollstream.broker")

# Failures the gatekeeper did not decide (no key reached it); its own refusals come back as auth failures.
_UNJUDGED_FAILURES = HANDSHAKE_FAILURES & ~zmq.EVENT_HANDSHAKE_FAILED_AUTH
_LIKELY_CAUSES = {"mechanism_mismatch": "a client without CURVE keys",
                  "no_detail": "likely a client without CURVE keys (or one that hung up mid-handshake)",
                  "cryptographic": "a client whose --curve-server-key is not this broker's public key"}


class CurveGuard:
    def __init__(self, settings: BrokerSettings, context: zmq.Context, metrics: BrokerMetrics):
        assert settings.curve_secret_key is not None, "a CurveGuard is made only when CURVE is on"
        self.settings, self.metrics = settings, metrics
        self.own = KeyPair.load(settings.curve_secret_key)
        self.gatekeeper = Gatekeeper()
        # Per socket: connection identity -> its key's fingerprint, as its latest message said (`recv_routed`).
        self.users: dict[str, dict[bytes, str]] = {name: {} for name in CURVE_DIRECTORIES}
        self.reload()
        # Bound before any socket, so that no handshake ever goes unjudged.
        self.zap = context.socket(zmq.ROUTER)
        self.zap.setsockopt(zmq.LINGER, 0)
        try:
            self.zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self.zap.close()
            raise InvalidState(f"another authentication handler holds this ZeroMQ context's {ZAP_ENDPOINT}: "
                               f"a CURVE broker needs a context of its own ({exc})") from None
        self.monitors: dict[zmq.Socket, tuple[str, zmq.Socket]] = {}  # monitor -> the watched socket's name, the socket

    def secure(self, name: str, sock: zmq.Socket) -> None:
        """Before `sock` binds: a CURVE server judged as socket `name`, watched for failed handshakes."""
        apply_server(sock, self.own, name)
        self.monitors[sock.get_monitor_socket(_UNJUDGED_FAILURES)] = (name, sock)

    @property
    def sockets(self) -> list[zmq.Socket]:
        """What the poll loop must watch for this shell."""
        return [self.zap, *self.monitors]

    def reload(self) -> None:
        """Read every socket's directory of allowed keys again (SIGHUP)."""
        allowed = {}
        for name, directory in self.settings.curve_directories().items():
            if not Path(directory).is_dir():
                log.error(f"CURVE key directory {directory} of the {name} socket is missing: it allows nobody",
                          extra={"socket": name, "directory": directory})
                continue
            keys, problems = load_allowed(directory)
            for problem in problems:
                log.warning(f"CURVE key file left out: {problem}", extra={"socket": name})
            allowed[name] = keys
        for name in CURVE_DIRECTORIES:
            found = allowed.get(name, frozenset())
            log.info(f"CURVE: the {name} socket allows {len(found)} client keys",
                     extra={"socket": name, "keys": sorted(fingerprint(key) for key in found)})
        self.gatekeeper.replace(allowed)

    def revoked(self, name: str, identity: bytes, now: float) -> bool:
        """Whether the connection's key is no longer allowed on socket `name`
        (removed since it connected); its message is then dropped, counted
        and logged like a refused handshake."""
        user = self.users[name].get(identity, "-")
        if self.gatekeeper.allows_fingerprint(name, user):
            return False
        self.metrics.curve_refused.add(1, name, "revoked")
        verdict = self.gatekeeper.refused(name, "revoked", user, now)
        if verdict.log:
            log.warning(f"dropped a message on the {name} socket from a connection whose key {user} was removed "
                        f"since it connected{verdict.since_last}",
                        extra={"socket": name, "reason": "revoked", "fingerprint": user, "repeats": verdict.repeats})
        return True

    def revoked_identities(self, name: str, identities) -> list[bytes]:
        """Those of `identities` whose key socket `name` no longer allows."""
        users = self.users[name]
        return [identity for identity in identities
                if identity in users and not self.gatekeeper.allows_fingerprint(name, users[identity])]

    def forget(self, name: str, keep) -> None:
        """Drop what is known of connections of socket `name` not in `keep`
        (each message records its connection again)."""
        users = self.users[name]
        for identity in [identity for identity in users if identity not in keep]:
            del users[identity]

    def serve(self, ready: set, now: float) -> None:
        """Answer the authentication requests and read the monitors among `ready` sockets."""
        if self.zap in ready:
            self._answer(now)
        for monitor, (name, _) in self.monitors.items():
            if monitor in ready:
                self._read_monitor(monitor, name, now)

    def _answer(self, now: float) -> None:
        while True:
            try:
                frames = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                request = ZapRequest.parse(frames)
            except InvalidInput as exc:  # only libzmq writes here: a bug, not a peer
                log.error(f"unreadable authentication request: {exc}")
                continue
            verdict = self.gatekeeper.decide(request, now)
            self.zap.send_multipart(request.reply(verdict.status, verdict.reason, verdict.fingerprint))
            if verdict.allowed:
                continue
            self.metrics.curve_refused.add(1, verdict.socket, verdict.reason)
            if verdict.log:
                why = {"key_not_allowed": "is not in its directory", "no_keys": "cannot be: the socket allows nobody"}
                log.warning(f"refused a CURVE handshake on the {verdict.socket} socket from {request.address}: "
                            f"key {verdict.fingerprint} {why.get(verdict.reason, verdict.reason)}{verdict.since_last}",
                            extra={"socket": verdict.socket, "reason": verdict.reason, "fingerprint": verdict.fingerprint,
                                   "address": request.address, "repeats": verdict.repeats})

    def _read_monitor(self, monitor: zmq.Socket, name: str, now: float) -> None:
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            reason = handshake_failure_reason(event["event"], event["value"])
            if reason is None:
                continue
            self.metrics.curve_refused.add(1, name, reason)
            verdict = self.gatekeeper.refused(name, reason, "-", now)
            if verdict.log:
                log.warning(f"a connection to the {name} socket failed its CURVE handshake: {reason}, "
                            f"{_LIKELY_CAUSES.get(reason, 'a protocol error')}{verdict.since_last}",
                            extra={"socket": name, "reason": reason, "repeats": verdict.repeats})

    def close(self) -> None:
        """Before the watched sockets close (their monitors must stop first)."""
        for monitor, (_, sock) in self.monitors.items():
            sock.disable_monitor()
            monitor.close(0)
        self.monitors.clear()
        self.zap.close(0)
