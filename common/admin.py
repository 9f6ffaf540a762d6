"""The client of a broker's admin endpoint (the `status` and `requeue`
commands, the demo and scripts use it) and the endpoints file a broker
writes once it is listening: shared by the broker and its clients, so it
lives here."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import zmq

from .clock import Clock
from .codec import decode, encode
from .curve import ClientCurve, HandshakeWatch
from .errors import InvalidType, RollstreamError
from .messages import ADMIN_REPLIES, ADMIN_REQUESTS
from .sockets import dealer


class AdminError(RollstreamError, RuntimeError):
    """An admin call that failed: no answer (`no_answer`), the broker's
    refusal (its reply code), or an endpoints file that cannot be used
    (`invalid_input`)."""


class AdminClient:
    """Admin calls to one broker; with `curve_secret_key` (this client's
    .key_secret) and `curve_server_key` (the broker's .key) over CURVE. A
    refused handshake fails the call at once (`handshake_refused`)."""

    def __init__(self, endpoint: str, *, timeout: float = 5.0, context: zmq.Context | None = None,
                 curve_secret_key: str | os.PathLike | None = None, curve_server_key: str | os.PathLike | None = None):
        self.endpoint = endpoint
        self.timeout_ms = int(timeout * 1000)
        self._curve = ClientCurve.from_files(curve_secret_key, curve_server_key)
        self._watch: HandshakeWatch | None = None
        self._poller = zmq.Poller()  # replies, and the handshake's failures
        self._sock = dealer(context or zmq.Context.instance(), endpoint, linger_ms=0, secure=self._secure)
        self._seq = 0

    def _secure(self, sock: zmq.Socket) -> None:
        if self._curve is not None:
            self._curve.apply(sock)
        self._watch = HandshakeWatch(sock, self.endpoint, self._curve)
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._watch.monitor, zmq.POLLIN)

    def _call(self, mtype: str, fields: dict | None = None):
        self._seq += 1
        assert self._watch is not None
        deadline = Clock.monotonic() + self.timeout_ms / 1000
        self._send(encode(ADMIN_REQUESTS, mtype, {**(fields or {}), "seq": self._seq}), deadline)
        while True:
            events = dict(self._poller.poll(max(0, int((deadline - Clock.monotonic()) * 1000))))
            failure = self._watch.read()
            if failure is not None:
                raise AdminError(failure, code="handshake_refused")
            if not events.get(self._sock):
                if Clock.monotonic() < deadline:
                    continue
                if self._watch.failure is not None:  # reported to an earlier call, and still so
                    raise AdminError(self._watch.failure, code="handshake_refused")
                raise AdminError(f"no answer from the broker at {self.endpoint} within {self.timeout_ms / 1000:.1f} s",
                                 code="no_answer")
            reply = decode(self._sock.recv_multipart(), ADMIN_REPLIES)
            if reply.get("seq") != self._seq:
                continue  # a late answer to an earlier call
            if reply.type == "nack":
                raise AdminError(f"{reply['code']}: {reply['message']}", code=reply["code"])
            return reply

    def _send(self, frames: list, deadline: float) -> None:
        """Send without blocking: a DEALER with no connection to queue on
        (its handshake failed before the send, or it is not up yet) would
        block for good; the handshake's failure or the deadline ends the wait."""
        assert self._watch is not None
        while True:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            failure = self._watch.read() or self._watch.failure
            if failure is not None:
                raise AdminError(failure, code="handshake_refused")
            if Clock.monotonic() >= deadline:
                raise AdminError(f"no connection to the broker at {self.endpoint} within {self.timeout_ms / 1000:.1f} s",
                                 code="no_answer")
            self._poller.poll(50)

    def status(self) -> dict:
        return dict(self._call("status").fields)

    def dead_letters(self, limit: int = 100, pruned: bool = False) -> list[dict]:
        """The oldest `limit` dead letters; with `pruned`, also those whose
        data `max_dead_letter_bytes` pruned (marked `pruned`), first."""
        return self._call("dead_letters", {"limit": limit, "pruned": pruned})["items"]

    def requeue(self, trajectory_ids: list[str], job: str | None = None) -> list[str]:
        """Revive dead letters of `job` (the default job when None); the ids revived."""
        fields: dict = {"trajectory_ids": trajectory_ids}
        if job is not None:
            fields["job"] = job
        return self._call("requeue", fields)["trajectory_ids"]

    def end_run(self, run: str, *, job: str | None = None) -> int:
        """Tell the broker that trainer run `run` (of `job`; None: the
        default job) is over: it reclaims (and archives, with an archive)
        all the run trained; how many."""
        return self._call("end_run", {"run": run, **({} if job is None else {"job": job})})["reclaimed"]

    def history(self, *, step: int | None = None, trajectory_id: str | None = None, job: str | None = None,
                run: str | None = None) -> dict:
        """What the broker holds of `step` (trained there) or of one
        trajectory: the `history` reply's fields (`rows` with the archive's
        column names, and what it let go of; docs/protocol.md §5)."""
        asked = {"step": step, "trajectory_id": trajectory_id, "job": job, "run": run}
        return dict(self._call("history", {name: value for name, value in asked.items() if value is not None}).fields)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        self._sock.close(0)

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


ENDPOINT_NAMES = ("producer", "consumer", "admin")


def write_endpoints_file(path: str, endpoints: dict[str, str]) -> None:
    """The bound endpoints as one JSON object, renamed into place, so a
    reader sees the whole file or none."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(endpoints, sort_keys=True) + "\n")
    os.replace(partial, target)


def read_endpoints_file(path: str) -> dict[str, str]:
    """What `write_endpoints_file` wrote; `AdminError` naming the file and
    the rule when it is absent or not such an object."""
    try:
        endpoints = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AdminError(f"endpoints file {path} does not exist (yet): is the broker started with --endpoints-file?",
                         code="no_answer") from None
    except (OSError, ValueError) as exc:
        raise AdminError(f"endpoints file {path} is not readable JSON: {exc}", code="invalid_input") from None
    if not (isinstance(endpoints, dict) and all(isinstance(endpoints.get(name), str) for name in ENDPOINT_NAMES)):
        raise AdminError(f"endpoints file {path} must be a JSON object with string {list(ENDPOINT_NAMES)}, "
                         f"got {str(endpoints)[:120]}", code="invalid_input")
    return endpoints


def ask_status(endpoint: str | None, *, endpoints_file: str | None = None, timeout: float = 5.0,
               wait: float | None = None, dead_letters: int = 0, curve_secret_key: str | os.PathLike | None = None,
               curve_server_key: str | os.PathLike | None = None) -> tuple[dict, str]:
    """The broker's status (with up to `dead_letters` dead letters) and the
    admin endpoint that answered: `endpoint`, or the one `endpoints_file`
    names when it is given. With `wait`, tries again (re-reading the
    endpoints file, which a starting broker writes once it listens) until
    that many seconds have passed; then the last error is raised. The
    CURVE keys are `AdminClient`'s."""
    deadline = None if wait is None else Clock.monotonic() + wait
    while True:
        try:
            if endpoints_file is not None:
                endpoint = read_endpoints_file(endpoints_file)["admin"]
            elif endpoint is None:
                raise InvalidType("ask_status needs an endpoint or an endpoints_file, and got neither")
            patience = timeout if deadline is None else max(0.05, min(timeout, deadline - Clock.monotonic()))
            with AdminClient(endpoint, timeout=patience, curve_secret_key=curve_secret_key,
                             curve_server_key=curve_server_key) as admin:
                report = admin.status()
                report["dead_letters"] = admin.dead_letters(dead_letters) if dead_letters else []
            return report, endpoint
        except AdminError as exc:
            if deadline is None or exc.code == "handshake_refused":  # a refused key stays refused
                raise
            now = Clock.monotonic()
            if now >= deadline:
                raise AdminError(f"the broker did not answer within --wait {wait} s; last: {exc}", code="no_answer") from None
            time.sleep(min(0.1, max(0.0, deadline - now)))
