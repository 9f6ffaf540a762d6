"""`rollstream demo`: the whole pipeline on loopback with embedded defaults,
shown and checked end to end.

The broker and the producers run as real daemons (`rollstream broker`,
`rollstream producer`) in subprocesses, exactly as on a node; the trainer
is `--dp-size` rank processes (`rollstream.app.demo_rank`, gloo through
host memory, each stepping on `--device`), all started by the harness
(`rollstream.app.harness`). Producers and ranks keep ledgers, and the
end-to-end checker (`checker.check`) joins them with the broker's dead
letters: the run fails when anything acknowledged was lost, duplicated,
cut short or changed. `--chaos` kills the broker, a producer and the
trainer's source rank during the run and restarts each, as a crash and a
supervisor would; the restarted trainer is killed again between a commit
and its next checkpoint, and resumes from that checkpoint (the batches
since are trained again, as they were).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable

from rollstream.common.checker import Report
from rollstream.common.clock import Clock
from rollstream.common.errors import InvalidInput

from .harness import VOCAB, Chaos, Counts, LoopbackNode, Pipeline, archived_rows, end_runs, inject_due

TOP_K = 20  # the synthetic producers' top-k (ProducerSettings.top_k): the padded layout's width


def run_demo(*, producers: int = 2, trajectories: int = 24, turns: int = 3, group_size: int = 4, batch_size: int = 4,
             abort_rate: float = 0.1, retry_rate: float = 0.1, dp_size: int = 2, chaos: bool = False, timeout: float = 180.0,
             keep_data: bool = False, max_staleness: int | None = None, group_filter: str | None = None,
             late_reward_rate: float = 0.2, endpoints_file: str | None = None, device: str = "cpu",
             archive: str | None = None, show: Callable[[Counts, list[str]], None] | None = None) -> dict[str, Any]:
    """Run the pipeline until every acknowledged trajectory is committed or
    dead-lettered (or `timeout` seconds pass); return the summary, the
    checker's verdict in it. The trainer's ranks step on `device`, where
    the source rank also validates each batch. `show` is called with the
    progress a few times a second. With `archive` (a directory) the broker
    archives what it deletes there (docs/archive.md); once the trainer
    stops, its run is ended, so the archive holds all it trained, and the
    broker stops only when nothing waits for the archive (within `timeout`
    seconds)."""
    if trajectories % group_size:
        raise InvalidInput(f"trajectories per producer must be a multiple of group_size (whole groups): "
                         f"expected a multiple of {group_size}, got {trajectories}")
    plan = producers * trajectories
    faults = Chaos() if chaos else None
    broker_args = (*(("--trajectory-ttl", "15", "--heartbeat-interval", "0.5") if chaos else ()),
                   *(("--max-staleness", str(max_staleness)) if max_staleness is not None else ()),
                   *(("--group-filters", group_filter) if group_filter else ()),
                   *(("--archive", archive) if archive is not None else ()))
    with LoopbackNode("rollstream-demo-", VOCAB, keep_data=keep_data, broker_args=broker_args,
                      endpoints_file=endpoints_file) as node:
        # The trainer writes its policy version after every step; the producers sample at the one they read.
        versions = ("--version-file", str(node.work / "policy.version"))
        pipeline = Pipeline(node, dp_size=dp_size, batch_size=batch_size, rank_args=(*versions, "--device", device))
        pipeline.trainer.start(die_before_commit=faults.trainer_kill_before_commit if faults else 0)
        pipeline.trainer.wait_welcomed(timeout)
        started = Clock.monotonic()
        for i in range(producers):
            pipeline.add_producer(i, trajectories=trajectories, turns=turns, group_size=group_size,
                                  abort_rate=abort_rate, retry_rate=retry_rate,
                                  extra=(*versions, "--reward-levels", "2", "--late-reward-rate", str(late_reward_rate),
                                         # under chaos a tool call takes a while: a killed producer has trajectories
                                         # open mid-way, which its restart continues
                                         *(("--rate", "5", "--heartbeat-interval", "0.5", "--tool-seconds", "0.2")
                                           if chaos else ())))

        def each() -> None:
            if faults is not None:
                inject_due(faults, pipeline, plan)
            if show is not None:
                show(pipeline.counts, faults.done if faults else [])

        drained = pipeline.run(timeout, each)
        seconds = Clock.monotonic() - started
        report = pipeline.finish()
        if show is not None:
            show(pipeline.counts, faults.done if faults else [])
        work = node.work
        if archive is not None:
            # The run the trainer's ranks committed under (the same run resumed after a restart), from their ledgers.
            runs = sorted({r["run"] for r in pipeline.records if r["kind"] == "committed" and "run" in r})
            archived = archive_summary(archive, runs, end_runs(node, runs, timeout))
    # A producer killed while its verifier was still scoring: the reward never comes.
    expected = discarded_on_purpose(max_staleness, group_filter, chaos=chaos, rewards_expire=chaos and late_reward_rate > 0)
    summary = _summary(pipeline.records, report, pipeline.dead, seconds, drained=drained, faults=faults,
                       dp_size=dp_size, counts=pipeline.counts, kept=work if keep_data else None, expected_dead=expected)
    return summary if archive is None else {**summary, "archive": archived}


def archive_summary(directory: str, runs: list[str], reclaimed: int) -> dict[str, Any]:
    """The summary's `archive`: where it is, the trainer's runs, what their
    ends reclaimed, and the rows the archive holds of those runs."""
    return {"dir": directory, "runs": runs, "reclaimed_at_end": reclaimed, "rows": archived_rows(directory, runs)}


def archive_line(archive: dict[str, Any]) -> str:
    """The summary's `archive` for a table."""
    return (f"{archive['rows']} trained trajectories of run {', '.join(archive['runs']) or '(none)'} in "
            f"{archive['dir']} ({archive['reclaimed_at_end']} reclaimed when the run ended)")


def discarded_on_purpose(max_staleness: int | None, group_filter: str | None, *, chaos: bool,
                         rewards_expire: bool = False) -> set[str]:
    """The dead-letter reasons a demo throws acked trajectories away for
    when asked to: counted apart, never a failure. With `chaos`, what the
    killed trainer's weights sampled after its checkpoint is not in the
    resumed lineage (`abandoned`)."""
    expected = {"stale"} if max_staleness is not None else set()
    expected |= {f"filtered:{name.partition(':')[0]}" for name in (group_filter or "").split(",") if name}
    if chaos:
        expected.add("abandoned")
    if rewards_expire:
        expected.add("reward_expired")
    return expected


def _percentiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return pick(0.5), pick(0.99)


def _summary(records: list[dict], report, dead: list[dict], seconds: float, *, drained: bool, faults: Chaos | None,
             dp_size: int, counts: Counts, kept: Path | None, expected_dead: set[str]) -> dict[str, Any]:
    committed: dict[str, dict] = {}
    for record in records:
        if record["kind"] == "committed":
            committed.setdefault(record["id"], record)
    sent_at = {r["id"]: r["at"] for r in records if r["kind"] == "sent"}
    tokens = sum(r["tokens"] for r in committed.values())
    ids = sum(r["support_ids"] for r in committed.values())
    csr_bytes = 4 * ids + 8 * (tokens + len(committed))
    ack_p50, ack_p99 = _percentiles([r["latency"] for r in records if r["kind"] == "acked" and r.get("latency") is not None])
    e2e_p50, e2e_p99 = _percentiles([r["at"] - sent_at[tid] for tid, r in committed.items() if tid in sent_at])
    return {
        "trajectories": len(committed),
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
        "dp_size": dp_size,
        "replay_gaps": dict(Counter(r["gap"][1] for r in committed.values() if r.get("gap"))),
        "retried": counts.retried,
        "continued": counts.continued,
        "dead_letters": dict(Counter(item.get("reason") or "unknown" for item in dead)),
        "stale_dropped": sum(1 for item in dead if item.get("reason") == "stale"),
        "filtered": sum(1 for item in dead if (item.get("reason") or "").startswith("filtered:")),
        "abandoned": sum(1 for item in dead if item.get("reason") == "abandoned"),
        "late_rewards": counts.late_rewards,
        "csr_bytes": csr_bytes,
        "padded_bytes": 4 * TOP_K * tokens,
        "ack_latency_p50_s": ack_p50,
        "ack_latency_p99_s": ack_p99,
        "e2e_latency_p50_s": e2e_p50,
        "e2e_latency_p99_s": e2e_p99,
        **report.summary(),
        "drained": drained,
        "faults_injected": len(faults.done) if faults else 0,
        "faults": list(faults.done) if faults else [],
        "ok": drained and report.ok(expected_dead) and report.replayed_batches_identical is not False,
        **({"data_kept_in": str(kept)} if kept else {}),
    }


# -- showing it ------------------------------------------------------------------
STAGES = ("produced", "acked", "merged", "delivered", "committed")


def live_progress(console, plan: int):
    """A rich progress display of the five stages; returns it (a context
    manager) and the `show` callback `run_demo` takes. The faults injected
    so far go on a line of their own below the bars, wrapped at the
    console's width: in a column beside the bars, their growing list
    squeezed the stage names away on a narrow terminal."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.text import Text

    class Stages(Progress):
        faults: tuple[str, ...] = ()

        def get_renderables(self):
            yield self.make_tasks_table(self.tasks)
            if self.faults:
                yield Text(f"faults injected: {', '.join(self.faults)}")

    bars = Stages(TextColumn("{task.description:>10}"), BarColumn(bar_width=32), MofNCompleteColumn(),
                  console=console, transient=False)
    tasks = {stage: bars.add_task(stage, total=plan) for stage in STAGES}

    def show(counts: Counts, faults: list[str]) -> None:
        bars.faults = tuple(faults)
        for stage in STAGES:
            value = getattr(counts, stage)
            # A stage may count past the plan (a chaos run's restarts): its bar grows with it.
            bars.update(tasks[stage], completed=value, total=max(plan, value))

    return bars, show


def batches_again(summary: dict[str, Any]) -> str:
    """What a resumed trainer trained again, and whether in the batches it trained first, for a table."""
    identical = summary["replayed_batches_identical"]
    if identical is None:
        return "no batch trained again"
    return (f"{summary['replayed']} trajectories trained again, "
            f"{'in the batches they were trained in' if identical else 'in batches NOT identical to the first'}")


def checker_counts(summary: dict[str, Any]) -> str:
    """The end-to-end checker's counts, as its own report line writes them."""
    return "  ".join(f"{name} {summary[name]}" for name in Report.PROBLEMS)


def summary_table(summary: dict[str, Any]):
    """The run's figures as a rich table."""
    from rich.table import Table

    def seconds(value) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms"

    table = Table(title="rollstream demo", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("trajectories", f"{summary['trajectories']} committed of {summary['acked']} acked, "
                         f"{summary['tokens']:,} response tokens, {summary['dp_size']} trainer ranks"),
        ("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s over {summary['seconds']:.1f} s"),
        ("replay gaps", ", ".join(f"{field} {n}" for field, n in summary["replay_gaps"].items()) or "none"),
        ("dead letters", ", ".join(f"{reason} {n}" for reason, n in summary["dead_letters"].items()) or "none"),
        ("supports (CSR)", f"{summary['csr_bytes'] / 1e6:.2f} MB, against {summary['padded_bytes'] / 1e6:.2f} MB "
                           f"padded to \\[tokens, top_k={TOP_K}]"),
        ("ack latency", f"p50 {seconds(summary['ack_latency_p50_s'])}, p99 {seconds(summary['ack_latency_p99_s'])}"),
        ("end to end", f"p50 {seconds(summary['e2e_latency_p50_s'])}, p99 {seconds(summary['e2e_latency_p99_s'])} "
                       "(end sent to batch committed)"),
        ("retried", f"{summary['retried']} trajectories discarded after a turn (abort) and produced again"),
        ("late rewards", f"{summary['late_rewards']} trajectories ended first, their rewards sent later"),
        ("thrown away", f"stale {summary['stale_dropped']}, filtered {summary['filtered']}, abandoned lineage "
                        f"{summary['abandoned']} (on purpose: counted, not lost)"),
        ("faults injected", ", ".join(summary["faults"]) or "none"),
        ("redelivered", f"{summary['redelivered']} hand-outs again after a lost consumer"),
        ("producer restart", f"{summary['continued']} open trajectories continued where they stood"),
        ("prompts", f"{summary['prompts']} issued, {summary['prompts_skipped']} skipped, "
                    f"{summary['prompts_duplicated']} trained twice"),
        ("resumed", "never" if summary["resumed_from_step"] is None else
                    f"from the checkpoint of step {summary['resumed_from_step']}: {batches_again(summary)}; "
                    f"lineage lost {summary['lineage_lost']}, duplicated {summary['lineage_duplicated']}"),
        ("checker", checker_counts(summary) + ("" if summary["drained"] else "  (not drained before the timeout)")),
    ]
    if not summary["retried"]:
        rows = [row for row in rows if row[0] != "retried"]
    if "producer" not in summary["faults"]:
        rows = [row for row in rows if row[0] != "producer restart"]
    if not summary["stale_dropped"] and not summary["filtered"] and not summary["abandoned"]:
        rows = [row for row in rows if row[0] != "thrown away"]
    if "archive" in summary:
        rows.append(("archive", archive_line(summary["archive"])))
    if "data_kept_in" in summary:
        rows.append(("data kept in", summary["data_kept_in"]))
    for name, value in rows:
        table.add_row(name, value)
    return table
