"""CurveZMQ: the key files, the socket options each end sets, and the
broker's decision on which client key may open which socket.

Keys are files in pyzmq's certificate format: `NAME.key` holds the public
key (handed to whoever must recognise NAME), `NAME.key_secret` the public
and the secret key (kept by NAME alone, mode 0600). A broker with a secret
key runs every socket as a CURVE server; each socket allows the client keys
found in its own directory (`*.key` files), and a socket given no directory
allows nobody. The broker asks `Gatekeeper` about every handshake through
ZeroMQ's authentication protocol (ZAP, RFC 27); the gatekeeper decides and
says what to log, without sockets or clocks. docs/operations.md, Security,
walks through a setup.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping

import click
import zmq
from zmq.auth import load_certificate
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from .clock import Clock
from .config import Problem
from .errors import InvalidInput

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's authentication handler (RFC 27)
KEY_BYTES = 32
REPEAT_LOG_EVERY = 60.0  # seconds: the same refusal is logged again (with how often it recurred) at most this often


class CurveError(InvalidInput):
    """A key file that cannot be used as it is (its path and the rule it breaks)."""

    code = "invalid_input"


# -- key files ----------------------------------------------------------------
def fingerprint(public_key: bytes) -> str:
    """A short, stable name for a public key (z85 text or raw bytes) for
    logs: `sha256:` and the first 16 hex digits of its raw bytes' SHA-256."""
    raw = z85.decode(public_key) if len(public_key) == 40 else public_key
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:16]


def _certificate(public_key: bytes, secret_key: bytes | None) -> str:
    kind = "Secret" if secret_key else "Public"
    lines = [f"#   ZeroMQ CURVE {kind} Certificate, written by `rollstream keys generate`",
             f"#   on {datetime.fromtimestamp(Clock.read().wall, timezone.utc).isoformat(timespec='seconds')}",
             "#   fingerprint " + fingerprint(public_key),
             "", "metadata", "curve", f'    public-key = "{public_key.decode()}"']
    if secret_key:
        lines.append(f'    secret-key = "{secret_key.decode()}"')
    return "\n".join(lines) + "\n"


def generate(out_dir: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write a new key pair as `out_dir/NAME.key` (public, mode 0644) and
    `out_dir/NAME.key_secret` (mode 0600 from its creation); neither may
    exist already. Returns both paths."""
    if not name or "/" in name or name.startswith("."):
        raise CurveError(f"a key name must be a plain file name (no '/', not starting with '.'), got {name!r}")
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"
    for path in (public_path, secret_path):
        if path.exists():
            raise CurveError(f"refusing to overwrite an existing key: {path} must not exist, and it does")
    public_key, secret_key = zmq.curve_keypair()
    for path, text, mode in ((secret_path, _certificate(public_key, secret_key), 0o600),
                             (public_path, _certificate(public_key, None), 0o644)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, mode)  # whatever the umask took away
    return public_path, secret_path


def _checked(path: Path, key: bytes | None, which: str) -> bytes:
    try:
        if key is not None and len(z85.decode(key)) == KEY_BYTES:
            return key
    except ValueError:
        pass
    raise CurveError(f"{path}: the {which} must be a 40-character Z85 CURVE key, got {key!r}")


def _load(path: str | os.PathLike) -> tuple[Path, bytes, bytes | None]:
    path = Path(path)
    try:
        public_key, secret_key = load_certificate(path)
    except OSError as exc:
        raise CurveError(f"{path}: a CURVE key file must be readable: {exc}") from None
    except ValueError:
        raise CurveError(f"{path}: a CURVE key file must hold a public-key line, and this one has none") from None
    return path, _checked(path, public_key, "public-key"), secret_key


def load_public_key(path: str | os.PathLike) -> bytes:
    """The public key of a `.key` (or `.key_secret`) file, as Z85 text."""
    return _load(path)[1]


@dataclass(frozen=True)
class KeyPair:
    public_key: bytes
    secret_key: bytes

    @classmethod
    def load(cls, path: str | os.PathLike) -> "KeyPair":
        """One's own `.key_secret` file."""
        checked, public_key, secret_key = _load(path)
        if secret_key is None:
            raise CurveError(f"{checked}: one's own key must be a {SECRET_SUFFIX} file with a secret-key line, "
                             f"got a public key only (give the {SECRET_SUFFIX} file of the pair)")
        return cls(public_key, _checked(checked, secret_key, "secret-key"))


def load_allowed(directory: str | os.PathLike) -> tuple[frozenset[bytes], list[str]]:
    """The public keys (Z85) of the `*.key` files in `directory`, and a line
    for each file that could not be read (it is left out, the rest count)."""
    keys: set[bytes] = set()
    problems = []
    for path in sorted(Path(directory).glob(f"*{PUBLIC_SUFFIX}")):
        try:
            keys.add(load_public_key(path))
        except CurveError as exc:
            problems.append(str(exc))
    return frozenset(keys), problems


@dataclass(frozen=True)
class KeyLayout:
    """Keys laid out as docs/operations.md (Security) describes: the
    broker's pair (`broker.key`, `broker.key_secret`), a pair per client,
    and per broker socket a directory holding the public key of the client
    it allows (`allowed`: `producers`, `consumers` or `admin`, the
    directories of --curve-producers, --curve-consumers and --curve-admin
    -> client name)."""

    root: Path
    allowed: Mapping[str, str]

    @classmethod
    def generate(cls, root: str | os.PathLike, allowed: Mapping[str, str], *,
                 others: tuple[str, ...] = ()) -> "KeyLayout":
        """New pairs for the broker, each client of `allowed` and `others`
        (clients no socket allows), and the directories of allowed keys."""
        layout = cls(Path(root), dict(allowed))
        for name in ("broker", *dict.fromkeys(allowed.values()), *others):
            generate(layout.root, name)
        for directory, name in layout.allowed.items():
            (layout.root / directory).mkdir()
            (layout.root / directory / f"{name}{PUBLIC_SUFFIX}").write_bytes(
                (layout.root / f"{name}{PUBLIC_SUFFIX}").read_bytes())
        return layout

    def client_keys(self, name: str) -> tuple[str, str]:
        """Client `name`'s `curve_secret_key` and `curve_server_key` files."""
        return str(self.root / f"{name}{SECRET_SUFFIX}"), str(self.root / f"broker{PUBLIC_SUFFIX}")

    def client_args(self, name: str) -> tuple[str, ...]:
        """The same as flags."""
        secret, server = self.client_keys(name)
        return ("--curve-secret-key", secret, "--curve-server-key", server)

    def broker_args(self) -> tuple[str, ...]:
        """The broker's flags: its own key and each socket's directory."""
        args = ["--curve-secret-key", str(self.root / f"broker{SECRET_SUFFIX}")]
        for directory in self.allowed:
            args += [f"--curve-{directory}", str(self.root / directory)]
        return tuple(args)


# -- sockets ------------------------------------------------------------------
def _unpaired(secret_key_file, server_key_file) -> tuple[str, str] | None:
    """(the setting given, the one missing) when only one of a client's two keys is."""
    if (secret_key_file is None) == (server_key_file is None):
        return None
    return (("curve_secret_key", "curve_server_key") if server_key_file is None
            else ("curve_server_key", "curve_secret_key"))


@dataclass(frozen=True)
class ClientCurve:
    """What a client socket needs: its own key pair and the broker's public key."""

    own: KeyPair
    server_key: bytes

    @classmethod
    def from_files(cls, secret_key_file: str | os.PathLike | None,
                   server_key_file: str | os.PathLike | None) -> "ClientCurve | None":
        """Both files, or neither (plain ZeroMQ: None)."""
        unpaired = _unpaired(secret_key_file, server_key_file)
        if unpaired is not None:
            given, missing = unpaired
            raise CurveError(f"CURVE needs both keys: {given} is given, so {missing} must be too, and it is not")
        if secret_key_file is None or server_key_file is None:
            return None
        return cls(KeyPair.load(secret_key_file), load_public_key(server_key_file))

    def apply(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.own.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.own.secret_key)


def apply_server(sock: zmq.Socket, own: KeyPair, domain: str) -> None:
    """Make `sock` a CURVE server whose handshakes are judged for `domain` (a socket name)."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, own.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, own.secret_key)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())


# libzmq's protocol-error values (`zmq.h`) that tell a client what went wrong.
_MECHANISM_MISMATCH = 0x11000002
_CRYPTOGRAPHIC = 0x11000001
HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def handshake_failure_reason(event: int, value: int) -> str | None:
    """A socket monitor's handshake failure as a short reason (a metric
    label), or None for any other event."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "key_not_allowed"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return {_MECHANISM_MISMATCH: "mechanism_mismatch", _CRYPTOGRAPHIC: "cryptographic"}.get(value, "protocol")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "no_detail"
    return None


def describe_client_failure(reason: str, endpoint: str, curve: ClientCurve | None) -> str:
    """What a client tells its user when its handshake with `endpoint` failed."""
    if reason == "key_not_allowed":
        assert curve is not None
        return (f"the broker at {endpoint} refused this client's CURVE key {fingerprint(curve.own.public_key)}: "
                f"its .key file must be in the directory the broker allows on this socket (then SIGHUP the broker)")
    if reason == "mechanism_mismatch" or curve is None:
        side = "this client" if curve is not None else "the broker"
        return (f"the handshake with {endpoint} failed: CURVE is on at one end only (only {side} uses it); "
                f"give both --curve-secret-key and --curve-server-key, or neither, as the broker does")
    return (f"the CURVE handshake with {endpoint} failed: --curve-server-key must be the broker's public key "
            f"(its .key file), and the one given, {fingerprint(curve.server_key)}, does not open it")


def client_key_problems(secret_key_file: str | None, server_key_file: str | None) -> list[Problem]:
    """A client daemon's CURVE settings as `--check-config` reports them."""
    unpaired = _unpaired(secret_key_file, server_key_file)
    if unpaired is not None:
        given, missing = unpaired
        return [Problem(missing, "", f"given together with {given} (CURVE needs both)", "not given", "curve pairing")]
    if secret_key_file is None or server_key_file is None:
        return []
    problems = []
    try:
        KeyPair.load(secret_key_file)
    except CurveError as exc:
        problems.append(Problem("curve_secret_key", "", "this client's own .key_secret file", str(exc), "key file"))
    try:
        load_public_key(server_key_file)
    except CurveError as exc:
        problems.append(Problem("curve_server_key", "", "the broker's public .key file", str(exc), "key file"))
    return problems


def curve_client_options(fn):
    """`--curve-secret-key` and `--curve-server-key` for a client command."""
    fn = click.option("--curve-server-key", type=click.Path(exists=True, dir_okay=False), default=None,
                      help="The broker's public key (its .key file); with --curve-secret-key: connect over CURVE.")(fn)
    return click.option("--curve-secret-key", type=click.Path(exists=True, dir_okay=False), default=None,
                        help="This client's own key pair (a .key_secret file from `rollstream keys generate`).")(fn)


# -- the broker's decision ----------------------------------------------------
@dataclass(frozen=True)
class ZapRequest:
    """One authentication request from libzmq (RFC 27), as a ROUTER reads it."""

    envelope: list[bytes]  # the routing frames up to and including the empty delimiter
    request_id: bytes
    domain: str
    address: str
    mechanism: str
    client_key: bytes  # raw 32 bytes for CURVE, else empty

    @classmethod
    def parse(cls, frames: list[bytes]) -> "ZapRequest":
        try:
            split = frames.index(b"") + 1
        except ValueError:
            raise InvalidInput("a ZAP request must have an empty delimiter frame, and this one has none") from None
        body = frames[split:]
        if len(body) < 6 or body[0] != b"1.0":
            raise InvalidInput(f"a ZAP request must be version 1.0 with at least 6 frames, got {body[:1]} of {len(body)}")
        key = body[6] if body[5] == b"CURVE" and len(body) > 6 else b""
        return cls(frames[:split], body[1], body[2].decode(errors="replace"), body[3].decode(errors="replace"),
                   body[5].decode(errors="replace"), key)

    def reply(self, status: str, text: str, user_id: str = "") -> list[bytes]:
        return [*self.envelope, b"1.0", self.request_id, status.encode(), text.encode(), user_id.encode(), b""]


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    socket: str
    reason: str  # "allowed", "key_not_allowed", "no_keys" (the socket allows nobody), "not_curve" or "revoked"
    fingerprint: str
    log: bool  # whether to log this refusal now (the first of its kind, or the first after REPEAT_LOG_EVERY)
    repeats: int  # refusals of this kind not logged since the last that was

    @property
    def status(self) -> str:
        return "200" if self.allowed else "400"

    @property
    def since_last(self) -> str:
        """What a log line adds about the refusals not logged before it."""
        return f" ({self.repeats} more since the last report)" if self.repeats else ""


@dataclass
class Gatekeeper:
    """Which client keys each socket allows (`allowed`: socket name ->
    Z85 keys; a socket not in it allows nobody) and how often a refusal of
    the same key on the same socket is logged."""

    allowed: Mapping[str, frozenset[bytes]] = field(default_factory=dict)
    repeat_log_every: float = REPEAT_LOG_EVERY
    _logged: dict[tuple[str, str, str], tuple[float, int]] = field(default_factory=dict)  # -> last logged, repeats since
    _fingerprints: dict[str, frozenset[str]] = field(default_factory=dict)  # `allowed` by fingerprint, per socket

    def __post_init__(self) -> None:
        self.replace(self.allowed)

    def replace(self, allowed: Mapping[str, frozenset[bytes]]) -> None:
        """The keys each socket allows from now on (a reload)."""
        self.allowed = dict(allowed)
        self._fingerprints = {socket: frozenset(map(fingerprint, keys)) for socket, keys in self.allowed.items()}

    def allows_fingerprint(self, socket: str, name: str) -> bool:
        """Whether the key named `name` (its fingerprint: a connection's ZAP user id) is allowed on `socket` now."""
        return name in self._fingerprints.get(socket, ())

    def decide(self, request: ZapRequest, now: float) -> Verdict:
        socket, key = request.domain, request.client_key
        name = fingerprint(key) if len(key) == KEY_BYTES else "-"
        if request.mechanism != "CURVE":
            reason = "not_curve"
        elif socket not in self.allowed:
            reason = "no_keys"
        elif z85.encode(key) in self.allowed[socket]:
            return Verdict(True, socket, "allowed", name, False, 0)
        else:
            reason = "key_not_allowed"
        return self.refused(socket, reason, name, now)

    def refused(self, socket: str, reason: str, name: str, now: float) -> Verdict:
        """A refusal to count; logged the first time and then at most once
        every `repeat_log_every` seconds per socket, reason and key."""
        last, repeats = self._logged.get((socket, reason, name), (None, 0))
        if last is not None and now - last < self.repeat_log_every:
            self._logged[socket, reason, name] = (last, repeats + 1)
            return Verdict(False, socket, reason, name, False, repeats + 1)
        self._logged[socket, reason, name] = (now, 0)
        return Verdict(False, socket, reason, name, True, repeats)


@dataclass
class HandshakeReport:
    """What a client tells its user about its handshakes with `endpoint`: a
    failure once, not at every retry, and nothing after a success."""

    endpoint: str
    curve: ClientCurve | None
    failure: str | None = None  # the latest handshake's failure; None after a success

    def note(self, event: int, value: int) -> str | None:
        """A monitor event; a failure's description when it is news."""
        reason = handshake_failure_reason(event, value)
        if reason is None:
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.failure = None
            return None
        described = describe_client_failure(reason, self.endpoint, self.curve)
        if described == self.failure:
            return None
        self.failure = described
        return described


class HandshakeWatch:
    """A client socket's own monitor, feeding a `HandshakeReport`, so that a
    refused key is reported as such instead of as silence. Made before the
    socket connects (see `dealer(secure=)`); `close` before the socket."""

    def __init__(self, sock: zmq.Socket, endpoint: str, curve: ClientCurve | None):
        self.sock = sock
        self.report = HandshakeReport(endpoint, curve)
        self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILURES | zmq.EVENT_HANDSHAKE_SUCCEEDED)

    @property
    def failure(self) -> str | None:
        return self.report.failure

    def read(self) -> str | None:
        """Take the pending events; the description of a failure that is news."""
        news = None
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            news = self.report.note(event["event"], event["value"]) or news
        return news

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
