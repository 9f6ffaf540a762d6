"""What happened to a run's data, from its archive, a broker's data
directory or a live broker (docs/archive.md): the trajectories a step
trained, in batch order, and one trajectory's story.

The answers come from the archive's rows: over an archive, pyarrow's
dataset API reads only the columns asked and prunes files and row groups by
its partition keys and statistics, and what the rows' records hold (the
weight versions, the turns) is read back for the rows an answer shows only;
over an exported dataset, from its columns; over a data directory, the rows
the question needs are exported first (`rollstream export`'s snapshot, read
only, a running broker never held up); over a live broker, from the rows
its admin `history` request answers with the archive's column names, so
each source's answers read alike. What the rows do not hold, or what the
broker let go of, is said, never guessed.
"""
from __future__ import annotations

import datetime
import json
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import click

from rollstream.common.curve import curve_client_options
from rollstream.common.errors import ExtraMissing, InvalidInput
from rollstream.common.jobs import DEFAULT_JOB
from rollstream.common.versions import oldest_version

# The columns a step's answer shows, and a trajectory's (every one but the arrays).
STEP_COLUMNS = ("trajectory_id", "job", "run", "lineage", "epoch", "step", "position", "group_id", "sample_index",
                "producer", "weight_version_spans", "reward", "reward_json")
STORY_COLUMNS = ("trajectory_id", "job", "run", "lineage", "epoch", "step", "position", "group_id", "group_size",
                 "sample_index", "producer", "outcome", "dead_reason", "status", "turns", "response_length",
                 "gap_turn", "gap_field", "reward", "reward_json", "weight_version_spans", "first_turn_at", "ended_at",
                 "first_delivered_at", "committed_at", "dead_at", "deliveries")


def _dataset(root: Path):
    import pyarrow.dataset as ds

    return ds.dataset(root, format="parquet", partitioning="hive")


LACKING = "its records are not in the archive yet (their segment is still in the broker's use; `rollstream end-run` copies it)"


class History:
    """Questions to the rows of one archive (a directory of the broker's
    archive files) or of a dataset `rollstream export` wrote."""

    def __init__(self, root: str | Path, *, where: str | None = None, held: bool = False):
        try:
            from rollstream.broker.archive import ArchiveReader, is_archive
        except ImportError:
            raise ExtraMissing("pyarrow", "archive", "history over an archive or a data directory") from None

        self.root = Path(root)
        self.where = where or str(self.root)  # what the answers name as their source
        self.held = held  # the rows are what a broker holds now (a data directory's), not what it let go of
        if not self.root.exists():
            raise InvalidInput(f"an archive is a directory of Parquet files or one file: expected one at {self.root}, "
                               "found nothing")
        self._data = _dataset(self.root)
        self._archive = ArchiveReader(self.root) if self.root.is_dir() and is_archive(self.root) else None

    def _rows(self, condition, columns: tuple[str, ...], *, arrivals: bool = False) -> list[dict]:
        """The rows `condition` picks, with `columns`: from a dataset's
        columns, or from an archive's, what it merges read back from the
        rows' records (None where the archive lacks them, said in `lacking`)
        and, with `arrivals`, each stored turn's arrival (`turn_arrivals`)."""
        from rollstream.broker.archive import MERGED_COLUMNS, dataset_table, stored_of

        if self._archive is None:
            return self._data.to_table(columns=list(columns), filter=condition).to_pylist()
        merged = [name for name in columns if name in MERGED_COLUMNS]
        facts = [name for name in columns if name not in MERGED_COLUMNS]
        if not merged:
            return self._data.to_table(columns=facts, filter=condition).to_pylist()
        answers, loaded = [], []
        for row in self._data.to_table(filter=condition).to_pylist():  # the few rows an answer shows, whole
            stored = stored_of(row)
            trajectory = self._archive.load(stored, row["store_id"])
            answer = {name: row[name] for name in facts}
            if arrivals:
                answer["turn_arrivals"] = [{"turn": r["turn"], "at": r["at"]} for r in row["records"]]
            if trajectory is None:
                answer.update(dict.fromkeys(merged), lacking=LACKING)
            else:
                loaded.append((answer, stored, trajectory))
            answers.append(answer)
        if loaded:  # what the records hold, merged, in one table
            built = dataset_table([(stored, trajectory) for _, stored, trajectory in loaded]).select(merged).to_pydict()
            for i, (answer, _, _) in enumerate(loaded):
                answer.update({name: values[i] for name, values in built.items()})
        return answers

    def step(self, step: int, *, job: str | None = None, run: str | None = None) -> list[dict]:
        """The trajectories trained at `step`, in batch order: each with its
        producer, the weight versions that sampled it, how many versions
        behind the step its oldest weights were, and its reward. Raises
        `InvalidInput` naming the steps there are when none was trained at
        `step`."""
        import pyarrow.dataset as ds

        if type(step) is not int or step < 0:
            raise InvalidInput(f"a step is an integer >= 0, got {step!r}")
        condition = _trained(job, run) & (ds.field("step") == step)
        rows = self._rows(condition, STEP_COLUMNS)
        if not rows:
            raise InvalidInput(f"no trajectory trained at step {step}{_scope(job, run)} in {self.where}: expected a "
                               f"step it holds, {self._steps_held(job, run)}")
        return _batch_order(rows, step, self.where)

    def trajectory(self, trajectory_id: str, *, job: str | None = None) -> dict:
        """One trajectory's story, from its arrival to its leaving the
        broker. Raises `InvalidInput` when the archive does not hold it."""
        import pyarrow.dataset as ds

        condition = ds.field("trajectory_id") == trajectory_id
        if job is not None:
            condition &= ds.field("job") == job
        rows = self._rows(condition, STORY_COLUMNS, arrivals=True)
        if not rows:
            raise InvalidInput(f"trajectory {trajectory_id!r}{_scope(job, None)} is not in {self.where}: expected "
                               "one the archive holds (a trajectory is archived once the broker lets go of it: "
                               "committed, reclaimed by a seal or `rollstream end-run`, or a pruned dead letter)")
        if len(rows) > 1:
            raise InvalidInput(f"trajectory {trajectory_id!r} is in {len(rows)} jobs of {self.where}: expected --job "
                               f"to name one of {sorted(row['job'] for row in rows)}")
        return story(rows[0], held=self.held)

    def _steps_held(self, job: str | None, run: str | None) -> str:
        import pyarrow.compute as pc

        steps = self._data.to_table(columns=["step"], filter=_trained(job, run)).column("step")
        if not len(steps):
            return "and it holds no trained trajectory"
        bounds = pc.min_max(steps).as_py()
        return f"it holds steps {bounds['min']} to {bounds['max']}"


def _batch_order(rows: list[dict], step: int, where: str) -> list[dict]:
    """A step's rows (of one run) in batch order, each with the weight
    versions that sampled it and its staleness (the step less the oldest)."""
    runs = {(row["job"], row["run"]) for row in rows}
    if len(runs) > 1:
        raise InvalidInput(f"step {step} was trained by more than one run in {where}: expected --job/--run "
                           f"to name one of {sorted(runs, key=str)}")
    for row in rows:
        versions = sorted({span["version"] for spans in row.pop("weight_version_spans") or () for span in spans})
        oldest = oldest_version(versions)
        row.update(weight_versions=versions, staleness=None if oldest is None else step - oldest)
    return sorted(rows, key=lambda row: row["position"])


def _trained(job: str | None, run: str | None):
    """The filter of the trained rows of `job` and `run` (either None: any)."""
    import pyarrow.dataset as ds

    condition = ds.field("outcome") == "trained"
    if job is not None:
        condition &= ds.field("job") == job
    if run is not None:
        condition &= ds.field("run") == run
    return condition


def _scope(job: str | None, run: str | None) -> str:
    return "".join(f" of {kind} {value!r}" for kind, value in (("job", job), ("run", run)) if value is not None)


# How a row a live broker holds stands, where it has not left (its `outcome`, as `rollstream export` names states).
HELD_STANDING = {"open": "held open (turns still arriving)", "scoring": "held, its reward awaited",
                 "queued": "held, queued for delivery", "left": "held as a group member that left (no data)",
                 "trained": "held until a seal after its step reclaims it",
                 "dead": "held as a dead letter (until revived, or pruned)"}


def _job(job: str) -> str:
    """A job as an answer names it: the default job goes unsaid."""
    return "" if job == DEFAULT_JOB else _scope(job, None)


def story(row: Mapping[str, Any], *, held: bool = False) -> dict:
    """A trajectory's row as what happened to it, in order: to its leaving
    the broker and the archive, or (`held`: a live broker's row) to where
    it stands now."""
    events: list[dict] = []

    def event(what: str, at: Any, **details: Any) -> None:
        events.append({"event": what, "at": None if at is None else at.isoformat(), **details})

    event("first turn arrived", row["first_turn_at"], producer=row["producer"])
    arrivals = row.get("turn_arrivals")  # an archive's rows: each stored turn's arrival
    for arrival in (arrivals or ())[1:]:
        event("turn arrived", arrival["at"], turn=arrival["turn"])
    if row["gap_turn"] is not None:
        event("cut at a replay gap", None, turn=row["gap_turn"], field=row["gap_field"])
    outcome = row["outcome"]
    reward = json.loads(row["reward_json"]) if row["reward_json"] is not None else None
    if held and outcome == "open":
        event("last turn arrived", row["ended_at"], turns=row["turns"], response_length=row["response_length"])
    else:
        event("ended", row["ended_at"], turns=row["turns"], response_length=row["response_length"],
              status=row["status"], reward=reward)
    if row["first_delivered_at"] is not None:
        event("first delivered", row["first_delivered_at"], deliveries=row["deliveries"])
    if outcome == "dead":
        event("dead-lettered", row["dead_at"], reason=row["dead_reason"])
    elif outcome == "trained":
        event("trained", row["committed_at"], run=row["run"], lineage=row["lineage"], epoch=row["epoch"],
              step=row["step"], position=row["position"])
    elif not held:
        event("committed (deleted on commit)", row["committed_at"])
    if held:
        event(HELD_STANDING.get(outcome, f"held, {outcome}"), None)
    else:
        event("archived", None)
    keeper = "the broker" if held else "the archive"
    not_recorded = [f"each lease and requeue ({keeper} records the first delivery and the count)",
                    "the seal that reclaimed it (what it was trained at is recorded: a seal of a later step, or the "
                    "run's end, let it go)"]
    if arrivals is None:
        not_recorded.append("each later turn's arrival (a broker's archive keeps it; this source keeps the first and "
                            "the last)")
    return {"trajectory_id": row["trajectory_id"], "job": row["job"], "group_id": row["group_id"],
            "sample_index": row["sample_index"], "outcome": outcome, "events": events, "not_recorded": not_recorded}


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_TIMES = ("first_turn_at", "ended_at", "first_delivered_at", "committed_at", "dead_at")


def _timestamp(seconds: float | None) -> datetime.datetime | None:
    """Unix seconds as the archive keeps a time: UTC, whole microseconds."""
    return None if seconds is None else _EPOCH + datetime.timedelta(microseconds=int(seconds * 1_000_000))


class LiveHistory:
    """The same questions to a live broker, over its admin socket (the
    `history` request, docs/protocol.md §5): what it holds now, as the
    archive's rows, so the answers read as `History`'s. What it let go of
    (reclaimed, deleted on commit, a pruned dead letter) is said, never
    guessed: its row is in the archive, where the broker keeps one. The
    CURVE keys are `AdminClient`'s."""

    def __init__(self, endpoint: str, *, timeout: float = 5.0, curve_secret_key: str | None = None,
                 curve_server_key: str | None = None):
        self.endpoint = endpoint
        self.where = f"the broker at {endpoint}"
        self._client = dict(timeout=timeout, curve_secret_key=curve_secret_key, curve_server_key=curve_server_key)

    def _ask(self, **question: Any) -> dict:
        from rollstream.common.admin import AdminClient

        with AdminClient(self.endpoint, **self._client) as admin:  # type: ignore[arg-type]
            return admin.history(**question)

    @staticmethod
    def _row(row: Mapping[str, Any], columns: tuple[str, ...]) -> dict:
        return {name: _timestamp(row[name]) if name in _TIMES else row[name] for name in columns}

    def step(self, step: int, *, job: str | None = None, run: str | None = None) -> list[dict]:
        """As `History.step`, of the trajectories the broker still holds as
        trained at `step`; none: `InvalidInput` naming the steps it holds
        and the runs whose steps through this one it let go of."""
        if type(step) is not int or step < 0:
            raise InvalidInput(f"a step is an integer >= 0, got {step!r}")
        reply = self._ask(step=step, job=job, run=run)
        rows = [self._row(row, STEP_COLUMNS) for row in reply["rows"]]
        if not rows:
            held = ("it holds steps {} to {}".format(*reply["steps"]) if "steps" in reply
                    else "and it holds no trained trajectory")
            let_go = "".join(f"; it let go of what run {r['run']!r}{_job(r['job'])}"
                             f" trained through step {r['through']}" for r in reply.get("reclaimed", ()))
            raise InvalidInput(f"no trajectory trained at step {step}{_scope(job, run)} is held by {self.where}: "
                               f"expected a step it holds, {held}{let_go}"
                               + (" (with an archive, their rows are in it: rollstream history --archive DIR)"
                                  if let_go else ""))
        return _batch_order(rows, step, self.where)

    def trajectory(self, trajectory_id: str, *, job: str | None = None) -> dict:
        """As `History.trajectory`, to where it stands in the broker now.
        Raises `InvalidInput` when the broker let go of it (saying so) or
        neither holds nor remembers it."""
        reply = self._ask(trajectory_id=trajectory_id, job=job)
        rows, let_go = reply["rows"], reply.get("let_go", [])
        jobs = sorted([row["job"] for row in rows] + [gone["job"] for gone in let_go])
        if len(jobs) > 1:
            raise InvalidInput(f"trajectory {trajectory_id!r} is in {len(jobs)} jobs of {self.where}: expected --job "
                               f"to name one of {jobs}")
        if rows:
            return story(self._row(rows[0], STORY_COLUMNS), held=True)
        if let_go:
            gone = let_go[0]
            pruned = "" if "reason" not in gone else f" (a dead letter, {gone['reason']}, whose data was pruned)"
            raise InvalidInput(f"trajectory {trajectory_id!r}{_job(gone['job'])}: {self.where} let go of "
                               f"it{pruned} (trained and reclaimed, deleted on commit, or a pruned dead letter) and "
                               "remembers only its id: expected one it holds; with --archive DIR its row is in the "
                               "archive, where the broker keeps one (`rollstream broker --archive`)")
        raise InvalidInput(f"trajectory {trajectory_id!r}{_scope(job, None)} is neither held nor remembered by "
                           f"{self.where}: expected one it holds (it holds {reply['held']} trajectories) or let go "
                           "of within its dedup window")


def of_data_dir(data_dir: str | Path, work: str | Path, *, steps: tuple[int, int] | None = None,
                job: str | None = None) -> History:
    """A `History` of what a broker's data directory holds now (trained at
    `steps` only, when given), exported under `work` first."""
    try:
        from rollstream.broker.export import Selection, export
    except ImportError:
        raise ExtraMissing("pyarrow", "archive", "history over a data directory") from None

    out = Path(work) / "rows.parquet"
    selection = Selection(job=job, steps=steps) if steps is not None else Selection(job=job, trained=True,
                                                                                   queued=True, dead_letters=True)
    export(data_dir, out, selection)
    return History(out, where=f"the data directory {data_dir}", held=True)


def _table(rows: Iterable[Mapping[str, Any]], columns: tuple[str, ...]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns)
    for row in rows:
        table.add_row(*("" if row.get(name) is None else str(row[name]) for name in columns))
    Console().print(table)


@click.command()
@click.option("--archive", type=click.Path(exists=True), help="An archive directory (`rollstream broker --archive`) "
              "or a file `rollstream export` wrote.")
@click.option("--data-dir", type=click.Path(exists=True, file_okay=False), help="A broker's data directory, stopped "
              "or running (read only).")
@click.option("--admin", "endpoint", default=None, help="A live broker's admin endpoint: what it holds now.")
@click.option("--endpoints-file", type=click.Path(dir_okay=False),
              help="Read the admin endpoint from the file a broker's --endpoints-file names (instead of --admin).")
@click.option("--timeout", type=click.FloatRange(min=0.0, min_open=True), default=5.0, show_default=True,
              help="Seconds to wait for a live broker.")
@curve_client_options
@click.option("--step", type=click.IntRange(min=0), help="The trajectories trained at this step, in batch order.")
@click.option("--trajectory", "trajectory_id", help="One trajectory's story.")
@click.option("--job", default=None, help="The job (when the archive holds several).")
@click.option("--run", default=None, help="The trainer's run (when several trained the step).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of a table.")
def history(archive: str | None, data_dir: str | None, endpoint: str | None, endpoints_file: str | None,
            timeout: float, curve_secret_key: str | None, curve_server_key: str | None, step: int | None,
            trajectory_id: str | None, job: str | None, run: str | None, as_json: bool) -> None:
    """What happened to the run's data: the trajectories a step trained
    (--step) or one trajectory's story (--trajectory), from an archive, a
    broker's data directory or a live broker."""
    from rollstream.common.admin import AdminError, read_endpoints_file
    from rollstream.common.curve import CurveError

    sources = [name for name, given in (("--archive", archive), ("--data-dir", data_dir), ("--admin", endpoint),
                                        ("--endpoints-file", endpoints_file)) if given is not None]
    if len(sources) != 1:
        raise click.UsageError("history reads one source: expected exactly one of --archive, --data-dir, --admin and "
                               f"--endpoints-file, got {' and '.join(sources) or 'none'}")
    if (step is None) == (trajectory_id is None):
        raise click.UsageError("history answers one question: expected exactly one of --step and --trajectory")
    try:
        with tempfile.TemporaryDirectory(prefix="rollstream-history-") as work:
            source: History | LiveHistory
            if archive is not None:
                source = History(archive)
            elif data_dir is not None:
                source = of_data_dir(data_dir, work, steps=None if step is None else (step, step), job=job)
            else:
                source = LiveHistory(endpoint or read_endpoints_file(endpoints_file)["admin"],  # type: ignore[arg-type]
                                     timeout=timeout, curve_secret_key=curve_secret_key,
                                     curve_server_key=curve_server_key)
            answer: Any = (source.step(step, job=job, run=run) if step is not None
                           else source.trajectory(trajectory_id, job=job))  # type: ignore[arg-type]
    except (InvalidInput, ExtraMissing, AdminError, CurveError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(answer, default=str))
    elif step is not None:
        _table(answer, ("position", "trajectory_id", "producer", "weight_versions", "staleness", "reward"))
    else:
        click.echo(f"trajectory {answer['trajectory_id']} (job {answer['job']}, {answer['outcome']})")
        _table([{**e, "details": ", ".join(f"{k} {v}" for k, v in e.items() if k not in ("event", "at"))}
                for e in answer["events"]], ("event", "at", "details"))
