"""`rollstream demo --archive`: the demo's broker archives what it deletes,
the demo ends the trainer's run and waits for the archive, which then holds
exactly what the surviving lineage trained, checked against the ledgers
the end-to-end checker reads, every token of it as the trainer got it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ds = pytest.importorskip("pyarrow.dataset", reason="the archive needs the archive extra (pyarrow)")
pq = pytest.importorskip("pyarrow.parquet")

from rollstream.app.history import History  # noqa: E402
from rollstream.broker.export import export_archive  # noqa: E402
from rollstream.common.checker import delivered_digest, read_records, surviving_commits  # noqa: E402


def demo(*args: str) -> dict:
    """`rollstream demo --json --keep-data` with `args`: its summary (the last line), its exit checked."""
    done = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "demo", "--json", "--keep-data", *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def archived(root: Path) -> list[dict]:
    """Every row of the archive, as pyarrow's dataset API reads the Hive-partitioned files (hidden ones skipped)."""
    dataset = ds.dataset(root, format="parquet", partitioning="hive")
    assert not [f for f in dataset.files if Path(f).name.startswith(".")], "a reader must never see a hidden file"
    return dataset.to_table().to_pylist()


def taken_over(records: list[dict]) -> dict[str, list[tuple[str, int]]]:
    """Per lineage, the lineages resumed from it, directly or through
    others, with the lowest step resumed from on the way. A resume hands
    the broker back the batches of its checkpoint, which it then holds as
    trained by the resumed lineage: a batch trained at step s by lineage L
    and still unreclaimed may be archived as any lineage resumed from L at
    a step at or after s."""
    children: dict[str, list[tuple[str, int]]] = {}
    for record in records:
        if record["kind"] == "resumed" and record.get("parent"):
            children.setdefault(record["parent"], []).append((record["lineage"], record["from_step"]))
    out: dict[str, list[tuple[str, int]]] = {}

    def descend(lineage: str, through: float) -> list[tuple[str, int]]:
        found = []
        for child, step in children.get(lineage, ()):
            bound = min(through, step)
            found += [(child, int(bound)), *descend(child, bound)]
        return found

    for parent in children:
        out[parent] = descend(parent, float("inf"))
    return out


def matches_the_surviving_lineage(root: Path, kept: Path, summary: dict) -> list[dict]:
    """Check the archive at `root` against the ledgers the demo kept in
    `kept`: its rows are the trajectories the surviving lineage committed
    (`surviving_commits`, the checker's rule), each once, trained, under
    the trainer's run, at the step and batch position the ledger recorded,
    and under the lineage that trained it or one a resume handed it to
    (`taken_over`). The surviving commits."""
    records = read_records([kept / "ledgers"])
    surviving = surviving_commits(records)
    (run,) = {c["run"] for c in surviving}
    want = {c["id"]: c for c in surviving}
    assert len(want) == len(surviving) == summary["committed"], "the checker found each trained once"

    rows = archived(root)
    twice = sorted(tid for tid, n in Counter(r["trajectory_id"] for r in rows).items() if n > 1)
    assert not twice, f"rule 'each trajectory archived once' broken: expected none twice, got {twice}"
    trained = {r["trajectory_id"]: r for r in rows if r["outcome"] == "trained"}
    assert len(trained) == len(rows), f"a checkpointing trainer's run archives only trained rows, got " \
                                      f"{Counter(r['outcome'] for r in rows)}"
    assert sorted(trained) == sorted(want), (
        f"the archive must hold exactly the surviving lineage's trajectories: missing {sorted(set(want) - set(trained))}, "
        f"not trained there {sorted(set(trained) - set(want))}")
    resumed = taken_over(records)
    for tid, commit in want.items():
        row = trained[tid]
        assert (row["run"], row["step"], row["position"]) == (run, commit["step"], commit["position"]), \
            f"{tid}: expected run, step, position {(run, commit['step'], commit['position'])}, got " \
            f"{(row['run'], row['step'], row['position'])}"
        allowed = {commit["lineage"]} | {child for child, through in resumed.get(commit["lineage"], ())
                                         if through >= commit["step"]}
        assert row["lineage"] in allowed, f"{tid} trained at step {commit['step']}: expected lineage in " \
                                          f"{sorted(allowed)}, got {row['lineage']}"
    # Every token as the trainer got it: the archive exported with its records, each row's content digest the
    # one the trainer's ledger recorded at its commit.
    exported = export_archive(root, root.parent / "dataset.parquet")
    assert (exported.rows, exported.skipped) == (len(want), 0), exported
    for row in pq.read_table(root.parent / "dataset.parquet").to_pylist():
        assert delivered_digest(row) == want[row["trajectory_id"]]["digest"], row["trajectory_id"]
    shown = summary["archive"]
    assert (shown["dir"], shown["runs"], shown["rows"]) == (str(root), [run], len(want)), shown
    assert shown["reclaimed_at_end"] > 0, "the run's end must reclaim the steps no seal reclaimed"
    return surviving


@pytest.mark.slow
def test_a_train_chaos_demo_archives_exactly_what_the_surviving_lineage_trained_each_once(tmp_path):
    """`rollstream demo --train --chaos --archive DIR`, as short as still
    crashes the trainer (it crashes after step 12, between its checkpoints
    of steps 10 and 15, and resumes from 10): the archive holds what the
    surviving lineage trained (the resumed lineage's commits, then its
    parent's through step 10), each once; the abandoned lineage's steps 11
    and 12 appear only as the resumed lineage trained them again."""
    root = tmp_path / "archive"
    summary = demo("--train", "--chaos", "--steps", "12", "--producers", "1", "--group-size", "2", "--batch-size", "2",
                   "--plot", "", "--archive", str(root))
    kept = Path(summary["data_kept_in"])
    try:
        assert summary["ok"], summary["failed"]
        assert summary["resumed_from_step"] == 10 and summary["replayed"] > 0, "the chaos must have struck"
        surviving = matches_the_surviving_lineage(root, kept, summary)
        steps = Counter(commit["step"] for commit in surviving)
        assert sorted(steps) == list(range(1, 13)) and set(steps.values()) == {4}, \
            f"12 steps of 2 groups of 2 in the surviving lineage, got {dict(steps)}"
    finally:
        shutil.rmtree(kept, ignore_errors=True)


@pytest.mark.slow
def test_a_chaos_demo_whose_broker_is_killed_three_times_archives_what_the_surviving_lineage_trained(tmp_path):
    """`rollstream demo --chaos --archive DIR`: the broker is SIGKILLed and
    restarted three times (each time with --archive), a producer and the
    trainer twice; the archive still holds what the surviving lineage
    trained, each once."""
    root = tmp_path / "archive"
    summary = demo("--chaos", "--archive", str(root))
    kept = Path(summary["data_kept_in"])
    try:
        assert summary["ok"] and summary["drained"], summary
        assert {"broker-0", "broker-1", "broker-2"} <= set(summary["faults"]), summary["faults"]
        matches_the_surviving_lineage(root, kept, summary)
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_an_archive_path_that_is_a_file_or_no_pyarrow_is_refused_before_anything_starts(tmp_path, monkeypatch):
    import importlib.util

    from click.testing import CliRunner

    import rollstream.app.demo as demo_module
    from rollstream.app.cli import main

    started = []
    monkeypatch.setattr(demo_module, "run_demo", lambda **options: started.append(options))
    a_file = tmp_path / "archive"
    a_file.write_text("a file where the archive's directory should be")
    refused = CliRunner().invoke(main, ["demo", "--archive", str(a_file)])
    assert refused.exit_code == 2 and "is a file" in refused.output, refused.output
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    refused = CliRunner().invoke(main, ["demo", "--archive", str(tmp_path / "new")])
    assert refused.exit_code == 2 and "expected pyarrow importable" in refused.output, refused.output
    assert not started


def test_an_archive_that_does_not_catch_up_in_time_is_an_error_naming_what_waits(monkeypatch):
    from click.testing import CliRunner

    import rollstream.app.demo as demo_module
    from rollstream.app.cli import main
    from rollstream.app.harness import ArchiveBehind

    def behind(**options):
        assert options["archive"].endswith("/archive")
        raise ArchiveBehind("the archive must hold what runs ['r'] trained within 1 s of their end (4 reclaimed): "
                            "expected 0 waiting and 0 files being written, got {'waiting': 4}")

    monkeypatch.setattr(demo_module, "run_demo", behind)
    result = CliRunner().invoke(main, ["demo", "--archive", "archive"])
    assert result.exit_code == 1 and "Error: the archive must hold what runs ['r'] trained" in result.output, \
        result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_a_train_demo_trained_again_from_its_archive_reaches_the_same_weights(tmp_path):
    """`rollstream demo --train --archive DIR`, then `rollstream history
    --archive DIR --step N`, which lists what the trainer's ledger says step
    N trained, in batch order, and `rollstream demo --train --replay DIR`: a
    fresh model trained offline on the archived batches, step by step as
    the run trained them, ends with the run's weights, bit for bit (CPU,
    one thread); through fewer steps, with others."""
    root = tmp_path / "archive"
    live = demo("--train", "--steps", "8", "--producers", "1", "--group-size", "2", "--batch-size", "2", "--plot", "",
                "--archive", str(root))
    try:
        assert live["ok"], live["failed"]
        commits = [r for r in read_records([Path(live["data_kept_in"]) / "ledgers"]) if r["kind"] == "committed"]
    finally:
        shutil.rmtree(live["data_kept_in"], ignore_errors=True)
    # `rollstream history` over the archive agrees with the trainer's ledger, step by step, in batch order.
    history = History(root)
    for step in range(1, 9):
        ledger = [r["id"] for r in sorted((r for r in commits if r["step"] == step), key=lambda r: r["position"])]
        assert [row["trajectory_id"] for row in history.step(step)] == ledger and len(ledger) == 4, step
    again = demo("--train", "--replay", str(root), "--steps", "8")
    assert (again["steps"], again["weights_digest"]) == (8, live["weights_digest"])
    assert again["replay_max_abs_diff_support"] == live["replay_max_abs_diff_support"]
    fewer = demo("--train", "--replay", str(root), "--steps", "5")
    assert fewer["steps"] == 5 and fewer["weights_digest"] != live["weights_digest"]
