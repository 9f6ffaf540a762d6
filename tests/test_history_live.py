"""The admin `history` request (docs/protocol.md §5): the broker's core on a
real store (its own `StoreIO`, no sockets) answers what it holds of a step
or a trajectory as the archive's rows, names what it let go of instead of
guessing, and refuses a malformed question naming the rule."""
from __future__ import annotations

import json

import numpy as np
import pytest
from broker_helpers import end_msg, turn_msg

from rollstream.broker.core import BrokerCore, Send, Sent, drive
from rollstream.broker.metrics import BrokerMetrics
from rollstream.broker.recovery import rebuild
from rollstream.broker.settings import BrokerSettings
from rollstream.broker.store import Store
from rollstream.broker.store_io import StoreIO
from rollstream.common.clock import Clock
from rollstream.common.codec import decode, encode
from rollstream.common.errors import ProtocolError
from rollstream.common.messages import (
    ADMIN_REPLIES,
    ADMIN_REQUESTS,
    BROKER_TO_CONSUMER,
    CONSUMER_TO_BROKER,
    PRODUCER_TO_BROKER,
)

P, C = b"producer", b"trainer"


class Node:
    """A broker core on a store in `directory`, every request performed by
    the broker's own `StoreIO`; what it sends is kept, decoded."""

    def __init__(self, directory):
        metrics = BrokerMetrics()
        self.store = Store(directory)
        self.io = StoreIO(self.store, directory, metrics)
        self.core = BrokerCore(BrokerSettings(data_dir=str(directory)), "b", metrics, disk_reserve=0)
        self.core.restore(rebuild(self.store.open(), self.store), 0, 1 << 40)

    def run(self, steps) -> list[Send]:
        sent: list[Send] = []

        def send(request: Send) -> Sent:
            sent.append(request)
            return Sent.TAKEN

        drive(steps, {**self.io.performers, Send: send})
        return sent

    def produce(self, messages, t: float) -> None:
        hello = decode(encode(PRODUCER_TO_BROKER, "hello", {"producer_id": "p0"}), PRODUCER_TO_BROKER)
        for _ in messages:
            self.core.frame_arrived(P, 100, t)
        self.run(self.core.producer_read([(P, BrokerCore.keyed(m), None) for m in [hello, *messages]], at(t)))

    def consume(self, messages: list[tuple[str, dict]], t: float) -> list:
        received = [(C, decode(encode(CONSUMER_TO_BROKER, kind, fields), CONSUMER_TO_BROKER), None)
                    for kind, fields in messages]
        sent = self.run(self.core.consumer_read(received, at(t))) + self.run(self.core.deliver(at(t)))
        return [decode(r.frames, BROKER_TO_CONSUMER) for r in sent]

    def history(self, **fields):
        """The admin reply to `history` with `fields`, decoded as the admin client decodes it."""
        request = decode(encode(ADMIN_REQUESTS, "history", {"seq": 7, **fields}), ADMIN_REQUESTS)
        [reply] = self.run(self.core.admin_request(b"op", [], request, None, at(9.0)))
        return decode(reply.frames, ADMIN_REPLIES)


def at(t: float) -> Clock:
    return Clock(t, 1000.0 + t)


@pytest.fixture
def node(tmp_path):
    """Three trajectories of producer p0: b and a trained at step 1 (positions
    0, 1) by run R, sampled at versions 0 and 1; c queued."""
    node = Node(tmp_path)
    node.produce([turn_msg("a", 0, weight_version="0", seq=1), end_msg("a", reward=1.0, seq=2),
                  turn_msg("b", 0, weight_version="0", seq=3), turn_msg("b", 1, weight_version="1", seq=4),
                  end_msg("b", reward={"acc": 0.5}, seq=5), turn_msg("c", 0, weight_version="2", seq=6),
                  end_msg("c", seq=7)], 1.0)
    node.consume([("hello", {"consumer_id": "t", "run": "R", "lineage": "L"})], 2.0)
    leases = {d["trajectory_id"]: d["lease"] for d in node.consume([("credit", {"n": 2, "unit": "trajectory"})], 2.0)
              if d.type == "deliver"}
    assert sorted(leases) == ["a", "b"]
    node.consume([("ack", {"leases": [leases["b"], leases["a"]], "trajectory_ids": ["b", "a"], "step": 1,
                           "positions": [0, 1]})], 3.0)
    yield node
    node.store.close()


def test_a_step_is_answered_with_the_archive_s_rows_of_what_the_broker_holds_trained_there(node):
    reply = node.history(step=1)
    assert (reply.type, reply["seq"], reply["held"], reply["steps"]) == ("history", 7, 3, [1, 1])
    rows = sorted(reply["rows"], key=lambda row: row["position"])
    assert [(r["trajectory_id"], r["job"], r["run"], r["lineage"], r["epoch"], r["step"], r["position"], r["producer"],
             r["outcome"], r["reward"], r["reward_json"], r["deliveries"]) for r in rows] == [
        ("b", "default", "R", "L", 0, 1, 0, "p0", "trained", None, '{"acc":0.5}', 1),
        ("a", "default", "R", "L", 0, 1, 1, "p0", "trained", 1.0, "1.0", 1)]
    assert [[span["version"] for spans in r["weight_version_spans"] for span in spans] for r in rows] == [["0", "1"], ["0"]]
    assert (rows[0]["turns"], rows[0]["status"], rows[0]["first_turn_at"], rows[0]["committed_at"]) == (2, "completed",
                                                                                                          1001.0, 1003.0)
    assert node.history(step=1, run="R")["rows"] and not node.history(step=1, run="S")["rows"]
    assert not node.history(step=1, job="eval")["rows"]
    nothing = node.history(step=5)
    assert (nothing["rows"], nothing["steps"], "reclaimed" in nothing.fields) == ([], [1, 1], False)


def test_a_trajectory_is_answered_as_it_stands_and_one_let_go_of_is_named_not_guessed(node):
    [queued] = node.history(trajectory_id="c")["rows"]
    assert (queued["outcome"], queued["first_delivered_at"], queued["step"]) == ("queued", None, None)
    node.consume([("seal", {"step": 1, "keep": 1})], 4.0)  # reclaims step 1: a and b are let go of
    gone = node.history(trajectory_id="a")
    assert (gone["rows"], gone["let_go"]) == ([], [{"job": "default", "trajectory_id": "a"}])
    step = node.history(step=1)
    assert (step["rows"], "steps" in step.fields, step["reclaimed"]) == ([], False,
                                                                          [{"job": "default", "run": "R", "through": 1}])
    unknown = node.history(trajectory_id="zz")
    assert (unknown["rows"], "let_go" in unknown.fields, unknown["held"]) == ([], False, 1)


@pytest.mark.parametrize("fields, rule", [
    ({}, "expected exactly one of step and trajectory_id, got neither"),
    ({"step": 1, "trajectory_id": "a"}, "expected exactly one of step and trajectory_id, got ['step', 'trajectory_id']"),
    ({"trajectory_id": "a", "run": "R"}, "run names the run that trained a step: expected it with step, got it with "
                                         "trajectory_id"),
    ({"step": -1}, "history.step must be a non-negative integer below 2**63, got int -1"),
])
def test_a_malformed_history_request_is_refused_naming_the_rule_the_expected_and_the_actual(node, fields, rule):
    """As the service hands it in: the decoder's refusal, which the core answers `nack schema`."""
    try:
        decode(encode(ADMIN_REQUESTS, "history", {"seq": 3, **fields}, checked=False), ADMIN_REQUESTS)
    except ProtocolError as error:
        refusal = error
    else:
        raise AssertionError(f"{fields} was not refused")
    [reply] = node.run(node.core.admin_request(b"op", [], None, refusal, at(9.0)))
    nack = decode(reply.frames, ADMIN_REPLIES)
    assert (nack.type, nack["code"], nack["seq"]) == ("nack", "schema", 3)
    assert rule in nack["message"], nack["message"]


def test_the_same_ids_in_two_jobs_are_both_answered_and_a_job_picks_one(node):
    eval_c = [turn_msg("c", 0, weight_version="3", seq=8, job="eval"), end_msg("c", seq=9, job="eval")]
    node.produce(eval_c, 4.0)
    both = node.history(trajectory_id="c")["rows"]
    assert sorted((row["trajectory_id"], row["job"]) for row in both) == [("c", "default"), ("c", "eval")]
    [one] = node.history(trajectory_id="c", job="eval")["rows"]
    assert (one["trajectory_id"], one["job"], one["first_turn_at"]) == ("c", "eval", 1004.0)


@pytest.mark.slow
def test_a_live_broker_answers_as_its_data_directory_and_then_its_archive_do_and_names_what_it_let_go_of(tmp_path):
    """A producer, a checkpointing trainer sealing every step (two
    checkpoints kept) on `rollstream broker --archive`: over the admin
    socket, step 3 (still held) is answered with the rows the data
    directory gives and, once `end-run` archived it, the archive gives;
    steps 1 and 2, reclaimed by the seals, are said to be let go of."""
    pytest.importorskip("pyarrow", reason="the archive and the data directory are read with pyarrow")
    import shutil
    import tempfile
    from pathlib import Path

    from broker_process import BrokerProcess
    from click.testing import CliRunner
    from consumer_helpers import Rollout, send_rollouts, train_sealing
    from waiting import wait_for

    from rollstream.app.cli import main
    from rollstream.app.history import History, LiveHistory, of_data_dir
    from rollstream.common.admin import AdminClient
    from rollstream.common.errors import InvalidInput
    from rollstream.common.trajectory import Turn

    def rollout(i: int) -> Rollout:
        turns = [Turn.build(np.arange(1, 3 + i), np.full(2 + i, -0.5), supports=[[t] for t in range(1, 3 + i)],
                            weight_version=str(k + i % 2)) for k in range(2)]
        return Rollout(f"r{i}", np.arange(3, dtype=np.int32), turns, reward=i / 4)

    archive = tmp_path / "archive"
    broker = BrokerProcess(Path(tempfile.mkdtemp(prefix="rsh", dir="/tmp")), archive=str(archive),
                           archive_linger=0, heartbeat_interval=0.2).start()
    try:
        send_rollouts(broker.producer, [rollout(i) for i in range(6)])
        run, at = train_sealing(broker.consumer, 3, 2, keep_checkpoints=2)
        trained = {tid: step for tid, (step, _) in at.items()}
        live = LiveHistory(broker.admin)
        first, last = (next(tid for tid, step in trained.items() if step == s) for s in (1, 3))

        def let_go(question) -> str | None:
            try:
                question()
            except InvalidInput as exc:
                return str(exc) if "let go of" in str(exc) else None
            return None

        # The seal of step 3 reclaims through step 2: the broker remembers only their ids.
        said = wait_for(lambda: let_go(lambda: live.trajectory(first)), what="the seals to reclaim steps 1 and 2")
        assert "with --archive DIR its row is in the archive" in said, said
        said = let_go(lambda: live.step(1))
        assert said is not None and f"it let go of what run {run!r} trained through step 2" in said, said
        step = live.step(3)
        assert [row["trajectory_id"] for row in step] == [tid for tid, s in trained.items() if s == 3]
        assert all(row["staleness"] == 3 - int(row["weight_versions"][0]) and row["producer"] for row in step), step
        with tempfile.TemporaryDirectory(dir=tmp_path) as work:
            assert of_data_dir(broker.data_dir, work, steps=(3, 3)).step(3) == step
            held = of_data_dir(broker.data_dir, work).trajectory(last)
        told = live.trajectory(last)
        assert told["outcome"] == held["outcome"] == "trained"
        assert told["events"][:-1] == held["events"][:-1], "the story the store holds, told alike"
        assert told["events"][-1]["event"] == "held until a seal after its step reclaims it"

        answered = CliRunner().invoke(main, ["history", "--admin", broker.admin, "--step", "3", "--json"])
        assert answered.exit_code == 0, answered.output
        assert [row["trajectory_id"] for row in json.loads(answered.output)] == [row["trajectory_id"] for row in step]
        refused = CliRunner().invoke(main, ["history", "--admin", broker.admin, "--trajectory", first])
        assert refused.exit_code == 1 and "let go of it" in refused.output, refused.output

        with AdminClient(broker.admin) as admin:
            assert admin.end_run(run) == 2

        def archived_whole() -> bool:  # every row written (the counter: the status's archive may predate the end)
            status = broker.status()
            archive_state = status.get("archive") or {}
            return (status["counters"].get("archive_rows", 0) == len(trained)
                    and (archive_state.get("waiting"), archive_state.get("writing"), archive_state.get("lacking")) == (0, 0, 0))

        wait_for(archived_whole, timeout=60, what="the archive to hold the whole run")
        archived = History(archive)
        assert archived.step(3) == step, "the archive answers step 3 as the live broker did"
        story = archived.trajectory(last)
        events = [e for e in story["events"] if e["event"] != "turn arrived"]  # the archive keeps each turn's too
        assert events[:-1] == told["events"][:-1] and events[-1]["event"] == "archived"
    finally:
        broker.__exit__(None, None, None)
        shutil.rmtree(broker.directory, ignore_errors=True)


def test_the_command_reads_one_source_and_names_an_endpoints_file_it_cannot_use(tmp_path):
    from click.testing import CliRunner

    from rollstream.app.cli import main

    runner = CliRunner()
    both = runner.invoke(main, ["history", "--admin", "ipc:///nowhere", "--data-dir", str(tmp_path), "--step", "1"])
    assert both.exit_code == 2 and ("expected exactly one of --archive, --data-dir, --admin and --endpoints-file, got "
                                    "--data-dir and --admin") in both.output, both.output
    missing = runner.invoke(main, ["history", "--endpoints-file", str(tmp_path / "endpoints.json"), "--step", "1"])
    assert missing.exit_code == 1 and f"endpoints file {tmp_path / 'endpoints.json'} does not exist" in missing.output


def test_a_run_of_another_job_ends_by_its_own_name_with_its_job(tmp_path):
    """`end_run {run, job}`: a run of job `eval` keeps the name its trainer
    gave it; without its job the request names the default job's run R,
    which trained nothing here."""
    node = Node(tmp_path)
    try:
        node.produce([turn_msg("a", 0, seq=1, job="eval"), end_msg("a", seq=2, job="eval")], 1.0)
        node.consume([("hello", {"consumer_id": "t", "run": "R", "lineage": "L", "job": "eval"})], 2.0)
        [delivery] = [d for d in node.consume([("credit", {"n": 1, "unit": "trajectory"})], 2.0) if d.type == "deliver"]
        node.consume([("ack", {"leases": [delivery["lease"]], "trajectory_ids": ["a"], "step": 1, "positions": [0]})],
                     3.0)

        def end_run(**fields) -> int:
            request = decode(encode(ADMIN_REQUESTS, "end_run", {"seq": 5, **fields}), ADMIN_REQUESTS)
            [reply] = node.run(node.core.admin_request(b"op", [], request, None, at(4.0)))
            answer = decode(reply.frames, ADMIN_REPLIES)
            assert (answer.type, answer["run"]) == ("run_ended", "R"), answer
            return answer["reclaimed"]

        assert end_run(run="R") == 0, "the default job's run R trained nothing"
        assert end_run(run="R", job="eval") == 1
        [rows] = [node.history(trajectory_id="a", job="eval")["let_go"]]
        assert rows == [{"job": "eval", "trajectory_id": "a"}]
    finally:
        node.store.close()
