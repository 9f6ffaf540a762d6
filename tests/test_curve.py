"""CurveZMQ (docs/operations.md, Security): key files, the gatekeeper's
decisions without sockets, and a real broker process that lets allowed keys
in and keeps everyone else out of each socket, reloading keys on SIGHUP."""
import hashlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth
from broker_process import BrokerProcess
from consumer_helpers import VOCAB, make_rollout
from waiting import wait_for
from zmq.utils import z85

from rollstream.common.admin import AdminClient, AdminError
from rollstream.common.curve import (
    ClientCurve,
    CurveError,
    Gatekeeper,
    HandshakeReport,
    KeyLayout,
    KeyPair,
    ZapRequest,
    fingerprint,
    generate,
    load_allowed,
    load_public_key,
)
from rollstream.consumer import Consumer
from rollstream.producer import Producer, Refused

NAMES = ("broker", "producer", "consumer", "admin", "stranger")


def cli(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollstream.app.cli", *args], capture_output=True, text=True,
                          timeout=60, check=check)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """A key pair per name, written by the CLI, and one directory per broker socket holding its client's key."""
    root = tmp_path_factory.mktemp("keys")
    for name in NAMES:
        cli("keys", "generate", "--out", str(root), "--name", name, check=True)
    for directory, name in (("producers", "producer"), ("consumers", "consumer"), ("admin", "admin")):
        (root / directory).mkdir()
        shutil.copy(root / f"{name}.key", root / directory)
    return root


# -- key files ------------------------------------------------------------------
def test_generate_writes_a_valid_pair_in_pyzmqs_format(tmp_path):
    public_path, secret_path = generate(tmp_path, "node-1")
    assert (public_path.name, secret_path.name) == ("node-1.key", "node-1.key_secret")
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(public_path.stat().st_mode) == 0o644
    public, none = zmq.auth.load_certificate(public_path)  # pyzmq's own reader
    same_public, secret = zmq.auth.load_certificate(secret_path)
    assert none is None and same_public == public
    assert zmq.curve_public(secret) == public  # libzmq derives the same public key from the secret one


def test_generate_refuses_to_overwrite_and_odd_names(tmp_path):
    generate(tmp_path, "a")
    with pytest.raises(CurveError, match="refusing to overwrite an existing key"):
        generate(tmp_path, "a")
    for name in ("", "../x", ".hidden"):
        with pytest.raises(CurveError, match="plain file name"):
            generate(tmp_path, name)


def test_generate_keeps_the_secret_file_private_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        _, secret_path = generate(tmp_path, "a")
    finally:
        os.umask(old)
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600


def test_own_key_must_be_a_secret_file_and_files_must_hold_keys(keys, tmp_path):
    with pytest.raises(CurveError, match="key_secret file with a secret-key line"):
        KeyPair.load(keys / "producer.key")
    (tmp_path / "junk.key").write_text("metadata\ncurve\n")
    with pytest.raises(CurveError, match="must hold a public-key line"):
        KeyPair.load(tmp_path / "junk.key")
    (tmp_path / "short.key").write_text('curve\n    public-key = "abc"\n')
    with pytest.raises(CurveError, match="40-character Z85"):
        KeyPair.load(tmp_path / "short.key")
    with pytest.raises(CurveError, match="must be readable"):
        KeyPair.load(tmp_path / "absent.key_secret")


def test_client_keys_come_in_pairs(keys):
    assert ClientCurve.from_files(None, None) is None
    with pytest.raises(CurveError, match="curve_secret_key is given, so curve_server_key must be too"):
        ClientCurve.from_files(keys / "producer.key_secret", None)
    with pytest.raises(CurveError, match="curve_server_key is given, so curve_secret_key must be too"):
        ClientCurve.from_files(None, keys / "broker.key")
    curve = ClientCurve.from_files(keys / "producer.key_secret", keys / "broker.key")
    assert curve.server_key == zmq.auth.load_certificate(keys / "broker.key")[0]


def test_fingerprint_is_the_sha256_of_the_raw_key(keys):
    public, _ = zmq.auth.load_certificate(keys / "broker.key")
    expected = "sha256:" + hashlib.sha256(z85.decode(public)).hexdigest()[:16]
    assert fingerprint(public) == fingerprint(z85.decode(public)) == expected
    shown = cli("keys", "fingerprint", str(keys / "broker.key"), check=True).stdout
    assert shown.split() == [expected, str(keys / "broker.key")]


def test_allowed_keys_skip_unreadable_files(keys, tmp_path):
    shutil.copy(keys / "producer.key", tmp_path)
    (tmp_path / "broken.key").write_text("not a certificate\n")
    (tmp_path / "notes.txt").write_text("ignored: not a .key file\n")
    allowed, problems = load_allowed(tmp_path)
    assert allowed == {zmq.auth.load_certificate(keys / "producer.key")[0]}
    assert len(problems) == 1 and "broken.key" in problems[0]


# -- the gatekeeper ---------------------------------------------------------------
def zap_frames(domain: str, key: bytes, mechanism: bytes = b"CURVE") -> list[bytes]:
    """A request as libzmq sends it (RFC 27) and a ROUTER reads it."""
    frames = [b"\x00peer", b"", b"1.0", b"7", domain.encode(), b"10.0.0.5", b"", mechanism]
    return frames + [z85.decode(key)] if mechanism == b"CURVE" else frames


def test_gatekeeper_allows_a_socket_only_its_own_keys(keys):
    producer = zmq.auth.load_certificate(keys / "producer.key")[0]
    stranger = zmq.auth.load_certificate(keys / "stranger.key")[0]
    gate = Gatekeeper({"producer": frozenset({producer}), "admin": frozenset()})
    allowed = gate.decide(ZapRequest.parse(zap_frames("producer", producer)), now=0.0)
    assert (allowed.allowed, allowed.status, allowed.reason) == (True, "200", "allowed")
    cases = {("producer", stranger): "key_not_allowed", ("admin", producer): "key_not_allowed",
             ("consumer", producer): "no_keys"}
    for (socket, key), reason in cases.items():
        verdict = gate.decide(ZapRequest.parse(zap_frames(socket, key)), now=0.0)
        assert (verdict.allowed, verdict.status, verdict.reason, verdict.socket) == (False, "400", reason, socket)
        assert verdict.fingerprint == fingerprint(key)
    plain = gate.decide(ZapRequest.parse(zap_frames("producer", b"", mechanism=b"NULL")), now=0.0)
    assert (plain.allowed, plain.reason) == (False, "not_curve")


def test_zap_reply_echoes_the_envelope_and_request_id(keys):
    key = zmq.auth.load_certificate(keys / "producer.key")[0]
    request = ZapRequest.parse(zap_frames("producer", key))
    assert (request.domain, request.address, request.mechanism) == ("producer", "10.0.0.5", "CURVE")
    assert request.reply("400", "key_not_allowed") == [b"\x00peer", b"", b"1.0", b"7", b"400", b"key_not_allowed", b"", b""]
    with pytest.raises(ValueError, match="empty delimiter"):
        ZapRequest.parse([b"1.0", b"7"])


def test_repeated_refusals_are_logged_once_a_minute_with_a_count(keys):
    key = zmq.auth.load_certificate(keys / "stranger.key")[0]
    gate = Gatekeeper({"producer": frozenset()}, repeat_log_every=60.0)
    request = ZapRequest.parse(zap_frames("producer", key))
    first, second, third = (gate.decide(request, now) for now in (0.0, 1.0, 2.0))
    assert (first.log, second.log, third.log) == (True, False, False)
    later = gate.decide(request, now=61.0)
    assert (later.log, later.repeats) == (True, 2)
    other = gate.refused("producer", "mechanism_mismatch", "-", now=61.5)  # another kind is logged on its own
    assert other.log


def test_a_client_reports_a_failure_once_until_a_success(keys):
    curve = ClientCurve.from_files(keys / "producer.key_secret", keys / "broker.key")
    report = HandshakeReport("tcp://10.0.0.1:5555", curve)
    first = report.note(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
    assert first is not None and "refused this client's CURVE key" in first and fingerprint(curve.own.public_key) in first
    assert report.note(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400) is None
    assert report.note(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0) is None and report.failure is None
    assert report.note(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400) == first


# -- configuration ----------------------------------------------------------------
def test_a_socket_whose_directory_is_missing_allows_nobody(keys, tmp_path):
    """Given no directory, or one gone by a reload, a socket is left out of what the gatekeeper allows."""
    from rollstream.broker.curve import CurveGuard
    from rollstream.broker.metrics import BrokerMetrics
    from rollstream.broker.settings import BrokerSettings

    producers = tmp_path / "producers"
    shutil.copytree(keys / "producers", producers)
    settings = BrokerSettings(curve_secret_key=str(keys / "broker.key_secret"), curve_producers=str(producers))
    context = zmq.Context()
    guard = CurveGuard(settings, context, BrokerMetrics())
    try:
        producer = zmq.auth.load_certificate(keys / "producer.key")[0]
        assert guard.gatekeeper.allowed == {"producer": frozenset({producer})}
        shutil.rmtree(producers)
        guard.reload()
        assert guard.gatekeeper.allowed == {}
    finally:
        guard.close()
        context.term()


@pytest.mark.slow
def test_a_key_layout_is_what_the_broker_and_its_clients_accept(tmp_path):
    layout = KeyLayout.generate(tmp_path, {"producers": "producer", "admin": "admin"}, others=("stranger",))
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "admin", "admin.key", "admin.key_secret", "broker.key", "broker.key_secret", "producer.key",
        "producer.key_secret", "producers", "stranger.key", "stranger.key_secret"]
    allowed, _ = load_allowed(tmp_path / "producers")
    assert allowed == {zmq.auth.load_certificate(tmp_path / "producer.key")[0]}
    broker = cli("broker", "--check-config", *layout.broker_args())
    assert broker.returncode == 0 and "--curve-producers" in layout.broker_args(), broker.stderr
    producer = cli("producer", "--check-config", *layout.client_args("producer"))
    assert producer.returncode == 0, producer.stderr
    assert ClientCurve.from_files(*layout.client_keys("stranger")).server_key == load_public_key(tmp_path / "broker.key")


@pytest.mark.slow
def test_check_config_reports_every_curve_mistake(keys, tmp_path):
    without_secret = cli("broker", "--check-config", "--curve-producers", str(keys / "producers"))
    assert without_secret.returncode == 2
    assert "curve_producers must be set only together with curve_secret_key" in without_secret.stderr
    bad = cli("broker", "--check-config", "--curve-secret-key", str(keys / "broker.key"),
              "--curve-consumers", str(tmp_path / "absent"))
    assert bad.returncode == 2
    assert "curve_secret_key must be the broker's own .key_secret file" in bad.stderr
    assert "curve_consumers must be an existing directory" in bad.stderr
    good = cli("broker", "--check-config", "--curve-secret-key", str(keys / "broker.key_secret"),
               "--curve-producers", str(keys / "producers"))
    assert good.returncode == 0, good.stderr
    from_env = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "broker", "--check-config"],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "ROLLSTREAM_BROKER_CURVE_SECRET_KEY": str(keys / "broker.key_secret"),
                                   "ROLLSTREAM_BROKER_CURVE_ADMIN": str(tmp_path / "absent")})
    assert from_env.returncode == 2
    assert "curve_admin must be an existing directory" in from_env.stderr
    assert "(environment ROLLSTREAM_BROKER_CURVE_ADMIN)" in from_env.stderr
    half = cli("producer", "--check-config", "--curve-secret-key", str(keys / "producer.key_secret"))
    assert half.returncode == 2 and "curve_server_key must be given together with curve_secret_key" in half.stderr
    whole = cli("producer", "--check-config", "--curve-secret-key", str(keys / "producer.key_secret"),
                "--curve-server-key", str(keys / "broker.key"))
    assert whole.returncode == 0, whole.stderr


# -- a real broker ------------------------------------------------------------------
@pytest.fixture
def broker(keys):
    directory = Path(tempfile.mkdtemp(prefix="rscurve", dir="/tmp"))
    flags = {"curve_secret_key": keys / "broker.key_secret", "curve_producers": directory / "producers",
             "curve_consumers": directory / "consumers", "curve_admin": keys / "admin",
             "endpoints_file": directory / "ep.json", "vocab_size": VOCAB}
    for allowed in ("producers", "consumers"):  # this broker's own: tests add and remove keys
        shutil.copytree(keys / allowed, directory / allowed)
    process = BrokerProcess(directory, **flags)
    for kind in ("producer", "consumer", "admin"):  # over TCP: every byte crosses the CURVE handshake's checks
        setattr(process, kind, "tcp://127.0.0.1:0")
    process.admin_keys = (keys / "admin.key_secret", keys / "broker.key")
    yield process.start()
    process.__exit__(None, None, None)
    shutil.rmtree(directory, ignore_errors=True)


def client_keys(keys: Path, name: str, server: str = "broker") -> dict:
    return {"curve_secret_key": keys / f"{name}.key_secret", "curve_server_key": keys / f"{server}.key"}


def refusals(broker) -> dict:
    return {key: value for key, value in broker.status()["counters"].items() if key.startswith("curve_refused")}


def send(broker, keys, name: str, rollout, *, server: str = "broker", patience: float = 20.0):
    """One rollout through a library producer with `name`'s key; its receipts, or None when none came."""
    with Producer(broker.producer, f"p-{name}", reply_timeout=60.0, **client_keys(keys, name, server)) as producer:
        futures = producer.send_trajectory(rollout.trajectory_id, rollout.prompt, rollout.turns, rollout.reward,
                                           sample_index=rollout.sample_index)
        try:
            return [f.result(timeout=patience) for f in futures]
        except TimeoutError:
            return None
        finally:
            producer.close(timeout=0.5)


def rollout(tid: str, seed: int = 0):
    """One turn and its end: two frames, which a producer may send before any welcome (a refused one never gets it)."""
    return make_rollout(np.random.default_rng(seed), tid, turns=1, sample_index=0, mask=True)


def test_allowed_producer_and_consumer_work_end_to_end(broker, keys):
    sent = rollout("allowed-0")
    receipts = send(broker, keys, "producer", sent)
    assert receipts is not None and all(r.applied for r in receipts)
    expected = sent.merged()
    with Consumer(broker.consumer, batch_size=1, vocab_size=VOCAB, **client_keys(keys, "consumer")) as consumer:
        batch = consumer.next_batch(timeout=20)
        got = batch.sample(0)
        assert batch.trajectory_ids == ("allowed-0",)
        assert got["tokens"].tolist() == [*expected.prompt_tokens.tolist(), *expected.tokens.tolist()]
        consumer.commit(batch)
    wait_for(lambda: broker.status()["queued"] == 0 and broker.status()["leased"] == 0, what="the commit")
    assert refusals(broker) == {}


@pytest.mark.slow
def test_unknown_key_is_refused_logged_by_fingerprint_and_counted(broker, keys, caplog):
    with caplog.at_level(logging.ERROR, logger="rollstream.producer"):
        assert send(broker, keys, "stranger", rollout("stranger-0"), patience=3.0) is None
    assert any("refused this client's CURVE key" in r.getMessage() for r in caplog.records)
    status = broker.status()
    assert (status["open"], status["queued"]) == (0, 0), "nothing of a refused producer may enter"
    assert refusals(broker).get("curve_refused.producer.key_not_allowed", 0) >= 1
    stranger = fingerprint(zmq.auth.load_certificate(keys / "stranger.key")[0])
    assert f"key {stranger} is not in its directory" in broker.log()


@pytest.mark.slow
def test_a_consumer_key_not_allowed_gets_no_deliveries(broker, keys):
    assert send(broker, keys, "producer", rollout("held-0")) is not None
    with Consumer(broker.consumer, batch_size=1, vocab_size=VOCAB, **client_keys(keys, "producer")) as consumer:
        with pytest.raises(TimeoutError, match="refused this client's CURVE key"):
            consumer.wait_welcomed(timeout=2)
        with pytest.raises(TimeoutError):
            consumer.next_batch(timeout=1)
    status = broker.status()
    assert (status["queued"], status["leased"], status["consumers"]) == (1, 0, 0)
    assert refusals(broker).get("curve_refused.consumer.key_not_allowed", 0) >= 1


@pytest.mark.slow
def test_no_curve_and_a_wrong_server_key_are_refused(broker, keys):
    plain = zmq.Context.instance().socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(broker.producer)
    plain.send(b"\x81\xa4type\xa5hello")
    assert not plain.poll(1500), "a client without CURVE must get nothing back"
    plain.close()
    assert send(broker, keys, "producer", rollout("wrong-server-0"), server="stranger", patience=2.0) is None
    counted = refusals(broker)
    assert sum(v for k, v in counted.items() if k.startswith("curve_refused.producer.")) >= 2, counted
    assert broker.status()["open"] == 0


def test_a_producer_key_does_not_open_the_admin_socket(broker, keys):
    with AdminClient(broker.admin, timeout=5.0, **client_keys(keys, "producer")) as admin:
        with pytest.raises(AdminError, match="refused this client's CURVE key") as refused:
            admin.status()
    assert refused.value.code == "handshake_refused" and not refused.value.retriable
    shown = cli("status", "--admin", broker.admin, "--curve-secret-key", str(keys / "producer.key_secret"),
                "--curve-server-key", str(keys / "broker.key"))
    assert shown.returncode == 1 and "refused this client's CURVE key" in shown.stderr
    unkeyed = cli("status", "--admin", broker.admin, "--timeout", "3")
    assert unkeyed.returncode == 1 and "CURVE is on at one end only" in unkeyed.stderr
    allowed = cli("status", "--admin", broker.admin, "--json", *(f"--{k.replace('_', '-')}={v}"
                                                                  for k, v in client_keys(keys, "admin").items()))
    assert allowed.returncode == 0, allowed.stderr
    assert refusals(broker).get("curve_refused.admin.key_not_allowed", 0) >= 2


@pytest.mark.slow
def test_a_key_added_to_a_directory_works_after_sighup(broker, keys):
    assert send(broker, keys, "stranger", rollout("late-0"), patience=2.0) is None
    shutil.copy(keys / "stranger.key", broker.directory / "producers")
    broker.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "the producer socket allows 2 client keys" in broker.log(), what="the reload")
    receipts = send(broker, keys, "stranger", rollout("late-1", seed=1))
    assert receipts is not None and all(r.applied for r in receipts)
    assert broker.status()["queued"] == 1


@pytest.mark.slow
def test_a_key_removed_at_sighup_cuts_off_its_open_connections(broker, keys):
    """Keys are judged at the handshake; a removed key's connections already open must stop counting too."""
    def send_now(producer, tid: str, seed: int) -> list:
        sent = rollout(tid, seed)
        return producer.send_trajectory(sent.trajectory_id, sent.prompt, sent.turns, sent.reward, sample_index=0)

    def reload(directory: str, name: str, socket: str) -> None:
        (broker.directory / directory / f"{name}.key").unlink()
        broker.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: f"the {socket} socket allows 0 client keys" in broker.log(), what=f"the reload of {directory}")

    with Producer(broker.producer, "p-revoked", reply_timeout=60.0, **client_keys(keys, "producer")) as producer, \
            Consumer(broker.consumer, batch_size=1, vocab_size=VOCAB, **client_keys(keys, "consumer")) as consumer:
        assert all(f.result(timeout=20).applied for f in send_now(producer, "before-0", 0))
        batch = consumer.next_batch(timeout=20)
        assert batch.trajectory_ids == ("before-0",)
        consumer.commit(batch)
        consumer.flush(timeout=20)
        reload("consumers", "consumer", "consumer")
        assert all(f.result(timeout=20).applied for f in send_now(producer, "after-consumer-revoked-1", 1))
        with pytest.raises(TimeoutError):
            consumer.next_batch(timeout=3)  # the consumer's connection is open, and gets nothing
        reload("producers", "producer", "producer")
        with pytest.raises(TimeoutError):
            send_now(producer, "after-producer-revoked-2", 2)[0].result(timeout=3)  # nor is the producer's frame taken
        producer.close(timeout=0.5)
    status = broker.status()
    assert (status["consumers"], status["queued"], status["leased"], status["open"]) == (0, 1, 0, 0), status
    counted = refusals(broker)
    assert counted.get("curve_refused.consumer.revoked", 0) >= 1 and counted.get("curve_refused.producer.revoked", 0) >= 1
    assert "was removed since it connected" in broker.log()


def test_open_trajectories_are_handed_back_over_the_key_that_opened_them_alone(broker, keys):
    """Under CURVE a producer id does not open another key's trajectories: a
    connection with another allowed key naming the same producer id is
    listed none of them, and cannot read one."""
    import asyncio

    from rollstream.producer import AsyncProducer

    shutil.copy(keys / "stranger.key", Path(broker.flags["curve_producers"]))
    broker.proc.send_signal(signal.SIGHUP)  # the stranger's key is allowed too from now on

    async def run(name: str, open_one: bool):
        async with AsyncProducer(broker.producer, "p-same", reply_timeout=60.0, **client_keys(keys, name)) as producer:
            if open_one:
                traj = producer.trajectory("k1", np.array([1, 2], np.int32))
                await (await traj.turn([5], [-0.5], supports=[[5]]))
            listed = await producer.open_trajectories(timeout=30)
            try:
                await producer.read_prefix("k1", timeout=30)
                read = True
            except Refused as refused:
                read = refused.code
            return [r.trajectory_id for r in listed], read

    assert asyncio.run(run("producer", open_one=True)) == (["k1"], True)
    wait_for(lambda: "the producer socket allows 2 client keys" in broker.log(), timeout=60, what="the reload")
    assert asyncio.run(run("stranger", open_one=False)) == ([], "unknown_trajectory")
    assert asyncio.run(run("producer", open_one=False)) == (["k1"], True)
