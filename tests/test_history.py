"""`rollstream history` (app/history.py): a step's trajectories in batch
order and a trajectory's story, from an archive and from a data directory,
and clear errors for what neither holds."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("pyarrow", reason="history reads the archive's Parquet files (the archive extra)")

from broker_helpers import end_msg, turn_msg  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from test_archive import archive_all, opened, produce  # noqa: E402

from rollstream.app.cli import main  # noqa: E402
from rollstream.app.history import History  # noqa: E402
from rollstream.broker.engine import TrainedAt  # noqa: E402
from rollstream.common.errors import InvalidInput  # noqa: E402


def a_run(tmp_path, *, archive: bool = True, copies: bool = True):
    """Three trajectories of producer p0 trained by run R: b and a at step
    1 (positions 0, 1), c at step 2, sampled at versions 0 and 1; d of
    producer p1 trained at step 1 by another run S. With `archive`, all of
    it is archived (the runs ended; without `copies`, a queued trajectory
    keeps their segment in the store's use, so the archive lacks their
    records); the data directory stays either way."""
    store, engine = opened(tmp_path / "data")
    produce(engine, store, [turn_msg("a", 0, [5], [[5, 6]], weight_version="0"), end_msg("a", reward=1.0),
                            turn_msg("b", 0, [7], weight_version="0"),
                            turn_msg("b", 1, [8], weight_version="1"), end_msg("b", reward=0.0),
                            turn_msg("c", 0, [9], weight_version="1"), end_msg("c", reward=0.5)], wall=100.0)
    produce(engine, store, [turn_msg("d", 0, [3], weight_version="0"), end_msg("d")], producer="p1", wall=101.0)
    if not copies:
        produce(engine, store, [turn_msg("e", 0), end_msg("e")], wall=101.0)
    for tid, at in (("b", TrainedAt("R", "L", 1, 0, 0)), ("a", TrainedAt("R", "L", 1, 1, 0)),
                    ("c", TrainedAt("R", "L", 2, 0, 0)), ("d", TrainedAt("S", "M", 1, 0, 0))):
        engine.sent(tid, 102.0)
        store.commit(engine.trained(tid, at, 103.0))
    if archive:
        store.commit(engine.end_run("R", 104.0) + engine.end_run("S", 104.0))
        archive_all(tmp_path / "archive", store, copies=copies)
    store.close()


def test_a_step_answers_its_trajectories_in_batch_order_with_producer_versions_staleness_and_reward(tmp_path):
    a_run(tmp_path)
    history = History(tmp_path / "archive")
    rows = history.step(1, run="R")
    assert [(r["position"], r["trajectory_id"], r["producer"], r["weight_versions"], r["staleness"], r["reward"])
            for r in rows] == [(0, "b", "p0", ["0", "1"], 1, 0.0), (1, "a", "p0", ["0"], 1, 1.0)]
    assert [r["trajectory_id"] for r in history.step(2)] == ["c"], "one run trained step 2: no --run needed"
    with pytest.raises(InvalidInput, match=r"step 1 was trained by more than one run .* expected --job/--run"):
        history.step(1)
    with pytest.raises(InvalidInput, match=r"no trajectory trained at step 7 of run 'R' in .*: expected a step it "
                                           r"holds, it holds steps 1 to 2"):
        history.step(7, run="R")


def test_a_trajectory_s_story_runs_from_its_first_turn_to_the_step_that_trained_it(tmp_path):
    a_run(tmp_path)
    told = History(tmp_path / "archive").trajectory("b")
    assert [e["event"] for e in told["events"]] == ["first turn arrived", "turn arrived", "ended", "first delivered",
                                                    "trained", "archived"]
    assert told["events"][1]["turn"] == 1, "an archive keeps each turn's arrival"
    trained = told["events"][4]
    assert (trained["run"], trained["lineage"], trained["step"], trained["position"]) == ("R", "L", 1, 0)
    assert told["events"][0]["producer"] == "p0" and told["events"][2]["reward"] == 0.0
    assert told["not_recorded"], "what the archive does not hold is said"
    with pytest.raises(InvalidInput, match=r"trajectory 'zz' is not in .*: expected one the archive holds"):
        History(tmp_path / "archive").trajectory("zz")


def test_the_command_answers_from_an_archive_and_from_a_data_directory_alike(tmp_path):
    a_run(tmp_path / "archived")
    a_run(tmp_path / "held", archive=False)
    runner = CliRunner()
    answers = []
    for source in (["--archive", str(tmp_path / "archived" / "archive")], ["--data-dir", str(tmp_path / "held" / "data")]):
        result = runner.invoke(main, ["history", *source, "--step", "1", "--run", "R", "--json"])
        assert result.exit_code == 0, result.output
        answers.append([(r["trajectory_id"], r["position"], r["staleness"]) for r in json.loads(result.output)])
    assert answers[0] == answers[1] == [("b", 0, 1), ("a", 1, 1)]
    result = runner.invoke(main, ["history", "--data-dir", str(tmp_path / "held" / "data"), "--trajectory", "c",
                                  "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["outcome"] == "trained", result.output
    told = json.loads(result.output)["events"]
    assert told[-1]["event"] == "held until a seal after its step reclaims it", "a data directory's row is held, not archived"


def test_the_command_refuses_a_question_it_cannot_answer_with_the_rule(tmp_path):
    a_run(tmp_path)
    runner = CliRunner()
    archive = ["--archive", str(tmp_path / "archive")]
    neither = runner.invoke(main, ["history", *archive])
    assert neither.exit_code == 2 and "expected exactly one of --step and --trajectory" in neither.output
    both = runner.invoke(main, ["history", *archive, "--data-dir", str(tmp_path / "data"), "--step", "1"])
    assert both.exit_code == 2 and ("expected exactly one of --archive, --data-dir, --admin and --endpoints-file, got "
                                    "--archive and --data-dir") in both.output
    unknown = runner.invoke(main, ["history", *archive, "--step", "9", "--run", "R"])
    assert unknown.exit_code == 1 and "it holds steps 1 to 2" in unknown.output, unknown.output


def test_an_archive_and_the_dataset_exported_from_it_answer_alike_and_missing_records_are_said(tmp_path):
    from rollstream.broker.export import export_archive

    a_run(tmp_path / "whole")
    export_archive(tmp_path / "whole" / "archive", tmp_path / "dataset.parquet")
    answers = [[(r["trajectory_id"], r["weight_versions"], r["staleness"]) for r in History(source).step(1, run="R")]
               for source in (tmp_path / "whole" / "archive", tmp_path / "dataset.parquet")]
    assert answers[0] == answers[1] == [("b", ["0", "1"], 1), ("a", ["0"], 1)]
    a_run(tmp_path / "lacking", copies=False)
    rows = History(tmp_path / "lacking" / "archive").step(1, run="R")
    assert [(r["trajectory_id"], r["weight_versions"], r["staleness"]) for r in rows] == [("b", [], None),
                                                                                          ("a", [], None)]
    assert all("not in the archive yet" in r["lacking"] for r in rows), "what the archive lacks is said, not guessed"
