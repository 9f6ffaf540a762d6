"""The README's main command runs the whole pipeline on its embedded defaults; the role commands take their options."""
import json
import subprocess
import sys

import numpy as np
import pytest
from consumer_helpers import CLEAN


def demo(*args: str) -> tuple[str, dict]:
    """Run `rollstream demo --json` with `args`; its output and its summary (the last line)."""
    out = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "demo", "--json", *args],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return out, json.loads(out.strip().splitlines()[-1])




@pytest.mark.slow
def test_demo_runs_the_pipeline_end_to_end():
    out, summary = demo("--producers", "2", "--trajectories", "8", "--group-size", "1", "--batch-size", "3",
                        "--retry-rate", "0.5", "--device", "cpu")
    assert "lost 0  duplicated 0  partial 0  corrupted 0  unseen 0" in out and "committed" in out
    assert {key: summary[key] for key in CLEAN} == CLEAN
    assert summary["trajectories"] == summary["acked"] == summary["committed"] == 16
    assert summary["drained"] and summary["ok"] and summary["faults_injected"] == 0 and summary["dp_size"] == 2
    assert summary["tokens"] > 0 and summary["csr_bytes"] < summary["padded_bytes"]
    assert sum(summary["replay_gaps"].values()) <= 16
    assert summary["retried"] >= 1 and "retried" in out  # an abort starts it afresh, at the broker and in the ledger


@pytest.mark.slow
def test_demo_with_chaos_kills_and_restarts_every_role_and_the_checker_finds_nothing():
    _, summary = demo("--chaos")
    assert {key: summary[key] for key in CLEAN} == CLEAN
    assert sorted(summary["faults"]) == ["broker-0", "broker-1", "broker-2", "producer", "trainer-resumed",
                                         "trainer-source"]
    assert summary["faults_injected"] == 6 and summary["ok"] and summary["drained"]
    assert (summary["lineage_lost"], summary["lineage_duplicated"]) == (0, 0)
    assert summary["resumed_from_step"] is not None and summary["replayed"] > 0
    assert summary["replayed_batches_identical"] is True
    # the killed producer's restart continues what it had open (a reward its verifier had not sent yet too): every
    # prompt's group is trained once
    assert summary["continued"] > 0 and (summary["prompts_skipped"], summary["prompts_duplicated"]) == (0, 0)
    assert summary["committed"] == summary["acked"] == 48 and summary["prompts"] == 12


@pytest.mark.slow
def test_demo_exits_non_zero_when_the_checker_finds_anything(monkeypatch):
    from click.testing import CliRunner

    import rollstream.app.demo as demo_module
    from rollstream.app.cli import main

    real = demo_module.run_demo

    def one_lost(**options):
        summary = real(**options)
        return {**summary, "lost": 1, "ok": False}

    monkeypatch.setattr(demo_module, "run_demo", one_lost)
    result = CliRunner().invoke(main, ["demo", "--producers", "1", "--trajectories", "4", "--dp-size", "1", "--json"])
    # exit status 1 from the checker's verdict, not from an exception (a click runner reports both as 1)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, (result.exception, result.output)
    assert json.loads(result.output.strip().splitlines()[-1])["lost"] == 1


@pytest.mark.slow
def test_demo_with_a_staleness_bound_and_a_filter_counts_what_it_threw_away_and_the_checker_finds_nothing():
    out, summary = demo("--max-staleness", "0", "--filter", "all_equal_rewards", "--late-reward-rate", "0.5")
    assert {key: summary[key] for key in CLEAN} == CLEAN and summary["ok"] and summary["drained"]
    thrown = summary["dead_letters"]
    assert set(thrown) <= {"stale", "filtered:all_equal_rewards"}
    assert (summary["stale_dropped"], summary["filtered"]) == (thrown.get("stale", 0),
                                                               thrown.get("filtered:all_equal_rewards", 0))
    assert summary["committed"] + summary["stale_dropped"] + summary["filtered"] == summary["acked"] == 48
    assert summary["late_rewards"] > 0 and "late rewards" in out


@pytest.mark.parametrize("train", [False, True])
def test_demo_refuses_cuda_where_torch_sees_none_before_anything_starts(monkeypatch, train):
    import torch
    from click.testing import CliRunner

    import rollstream.app.demo as demo_module
    import rollstream.app.train_demo as train_module
    from rollstream.app.cli import main

    def started(**options):
        raise AssertionError("nothing may start")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(demo_module, "run_demo", started)
    monkeypatch.setattr(train_module, "run_train_demo", started)
    result = CliRunner().invoke(main, ["demo", *(["--train"] if train else []), "--device", "cuda"])
    assert result.exit_code == 2, (result.exception, result.output)
    assert ("Invalid value for '--device': cuda needs a CUDA device torch can use: expected "
            "torch.cuda.is_available() to be True, got False (torch " in result.output), result.output


@pytest.mark.slow
def test_demo_train_exits_1_when_its_replay_is_broken(monkeypatch, tmp_path):
    """The trainer replays at twice the sampler's temperature: every
    replayed log-prob misses, the run fails the replay bounds alone (the
    checker finds nothing), says so in its table and its JSON line, and
    exits 1."""
    from click.testing import CliRunner

    import rollstream.app.train_demo as train_module
    from rollstream.app.cli import main

    real = train_module.replay
    monkeypatch.setattr(train_module, "replay", lambda batch, versions, temperature: real(batch, versions, 2 * temperature))
    result = CliRunner().invoke(main, ["demo", "--train", "--steps", "3", "--producers", "1", "--group-size", "2",
                                       "--batch-size", "2", "--plot", str(tmp_path / "train.png"), "--json"])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, (result.exception, result.output)
    *shown, line = result.output.strip().splitlines()
    summary = json.loads(line)
    assert not summary["ok"] and {key: summary[key] for key in CLEAN} == {**CLEAN, "unseen": summary["unseen"]}
    # both replay bounds: each token's log-prob, and the KL over each support the producers sent log-probs for
    assert [reason.partition(":")[0] for reason in summary["failed"]] == ["replay bound"] * 2, summary["failed"]
    assert "the KL from the sampler's distribution" in summary["failed"][1]
    assert shown[-1].split(maxsplit=1) == ["verdict", f"FAILED: {'; '.join(summary['failed'])}"], shown


def fake_train_demo(monkeypatch, summary: dict) -> list[dict]:
    """`rollstream demo --train` runs in no time: its run prints one progress
    line and returns `summary`, its table is `TABLE`; the options each run
    got, in order."""
    import rollstream.app.train_demo as train_module

    runs = []

    def run(**options):
        runs.append(options)
        options["progress"]("step   1/1")
        return summary

    monkeypatch.setattr(train_module, "run_train_demo", run)
    monkeypatch.setattr(train_module, "summary_table", lambda summary: "TABLE")
    return runs


def test_demo_train_hands_its_device_to_the_trainer(monkeypatch):
    """CPU by default; `--device cuda` where torch sees CUDA reaches `run_train_demo`."""
    import torch
    from click.testing import CliRunner

    from rollstream.app.cli import main

    runs = fake_train_demo(monkeypatch, {"ok": True})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for args in ([], ["--device", "cuda"]):
        result = CliRunner().invoke(main, ["demo", "--train", "--json", *args])
        assert result.exit_code == 0, (result.exception, result.output)
    assert [options["device"] for options in runs] == ["cpu", "cuda"]


@pytest.mark.parametrize("ok", [True, False])
def test_demo_train_prints_progress_then_its_table_then_one_json_line_and_exits_with_its_verdict(monkeypatch, ok):
    """--json adds the line and changes nothing else; the exit status is 1
    from the run's verdict (`ok`), not from an exception."""
    from click.testing import CliRunner

    from rollstream.app.cli import main

    summary = {"ok": ok, "failed": [] if ok else ["replay bound: expected ..., got ..."], "lost": 0}
    fake_train_demo(monkeypatch, summary)
    plain = CliRunner().invoke(main, ["demo", "--train"])
    with_json = CliRunner().invoke(main, ["demo", "--train", "--json"])
    for result in (plain, with_json):
        assert result.exit_code == (0 if ok else 1), (result.exception, result.output)
        assert ok or isinstance(result.exception, SystemExit)
    assert plain.output.splitlines() == ["step   1/1", "TABLE"]
    assert with_json.output.splitlines() == ["step   1/1", "TABLE", json.dumps(summary)]


def test_demo_train_plots_by_default_where_no_tracked_file_is_and_git_ignores_it():
    """The default plot lands in the current directory under a name no file
    of the checkout has and .gitignore covers, wherever the demo runs in it:
    a first run leaves `git status` clean."""
    from pathlib import Path

    from rollstream.app.cli import demo as demo_command

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip(f"not a git checkout: expected {root / '.git'}, got none")
    default = next(param.default for param in demo_command.params if param.name == "plot")

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60)

    assert git("ls-files", f"*{default}").stdout == "", f"a tracked file is named {default}"
    for where in (default, f"docs/{default}"):
        assert git("check-ignore", "-q", where).returncode == 0, f"{where} is not ignored"


def test_demo_progress_stays_readable_at_80_columns():
    """Every stage's name and every fault a chaos run injects, whole, in the
    live display at 80 columns; a stage that counted past the plan shows
    its count."""
    import io

    from rich.console import Console

    from rollstream.app.demo import STAGES, live_progress
    from rollstream.app.harness import Counts

    faults = ["broker-0", "broker-1", "broker-2", "producer", "trainer-source", "trainer-resumed"]
    console = Console(file=io.StringIO(), width=80)
    bars, show = live_progress(console, 48)
    show(Counts(produced=56, acked=56, merged=50, delivered=48, committed=44), faults)
    console.print(bars.get_renderable())
    shown = console.file.getvalue()
    words = shown.replace(",", " ").split()
    assert "…" not in shown and set(STAGES) | set(faults) <= set(words), shown
    assert [word for word in words if "/" in word] == ["56/56", "56/56", "50/50", "48/48", "44/48"], shown


def test_demo_refuses_groups_that_cannot_be_whole():
    result = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "demo", "--trajectories", "10",
                             "--group-size", "4"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "must be a multiple of --group-size 4" in result.stderr


@pytest.mark.slow
def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    for command in ("broker", "producer", "consume", "status", "requeue", "demo"):
        assert command in out


@pytest.mark.slow
def test_the_rollstream_command_adds_the_model_source_to_the_producer_daemon():
    """The app registers `model` with the producer's source registry: listed
    in `rollstream producer --help`, accepted by its settings check, and a
    name registered by nobody is refused naming every registered source."""
    help_text = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "producer", "--help"], capture_output=True,
                               text=True, timeout=60, check=True).stdout
    assert "[synthetic|sglang|vllm|replay|model]" in help_text
    checked = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "producer", "--source", "model",
                              "--check-config"], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "configuration ok" in checked.stdout, checked.stderr
    unknown = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "producer", "--source", "nope",
                              "--check-config"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2
    assert ("source must be one of 'synthetic', 'sglang', 'vllm', 'replay', 'model', got 'nope' (flag --source) "
            "[rule: choice]") in unknown.stderr


def test_the_producer_alone_knows_only_its_own_sources():
    """Without the app layer (a program running the daemon itself) `model`
    is not registered, and the settings check says which sources are."""
    code = (
        "import sys\n"
        "from rollstream.common.config import settings_problems\n"
        "from rollstream.producer.settings import ProducerSettings\n"
        "print(*settings_problems(ProducerSettings(source='model')), sep='\\n')\n"
        "assert not any(name.startswith('rollstream.app') for name in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "source must be one of 'synthetic', 'sglang', 'vllm', 'replay', got 'model' [rule: choice]"


def test_help_lists_every_command_without_loading_torch():
    """`rollstream --help` lists each command's one-line help, which means
    importing each command's module: none of them may load torch (it took
    seconds) or Ray."""
    code = (
        "import sys\n"
        "from rollstream.app.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, [m for m in ('torch', 'ray') if m in sys.modules]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    for command in ("broker", "consume", "demo", "producer", "status", "top"):
        assert f"  {command} " in out.stdout, f"--help must list {command}:\n{out.stdout}"


def test_consume_checks_its_settings_and_defaults_to_batches_of_8_units():
    """A budget of 0 tokens is refused by the setting's range before any
    consumer is made (exit 2, the setting, rule, expected and actual value).
    Given neither limit, a batch is 8 units (nothing to pull here: it times out)."""
    from click.testing import CliRunner

    from rollstream.consumer.cli import consume

    def run(*args: str):
        return CliRunner().invoke(consume, ["--endpoint", "tcp://127.0.0.1:9", "--timeout", "1", *args])

    refused = run("--batch-tokens", "0")
    assert refused.exit_code == 2, (refused.exit_code, refused.output)
    assert ("batch_tokens must be a whole number of tokens >= 1, got 0 (flag --batch-tokens) [rule: range]"
            in refused.output), refused.output
    default = run()
    assert default.exit_code == 1, (default.exit_code, default.output)
    assert "no full batch within the timeout: 0 of 8 units complete" in default.output, default.output


@pytest.mark.slow
def test_consume_with_batch_tokens_alone_closes_batches_by_tokens(brokers):
    """Four trajectories of 2 prompt + 3 response tokens under a 10-token
    budget and no --batch-size: two batches of two, 10 tokens each."""
    from consumer_helpers import VOCAB, RawProducer, Rollout

    from rollstream.common.trajectory import Turn

    node = brokers()
    producer = RawProducer(node.producer)
    try:
        producer.send([Rollout(f"b{i}", np.array([1, 2], np.int32),
                               [Turn.build([5, 6, 7], [-0.1] * 3, supports=[[5], [6], [7]])]) for i in range(4)])
    finally:
        producer.close()
    result = subprocess.run(
        [sys.executable, "-m", "rollstream.app.cli", "consume", "--endpoint", node.consumer, "--batch-tokens", "10",
         "--batches", "2", "--timeout", "30", "--vocab-size", str(VOCAB)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["samples"], line["tokens"]) for line in lines] == [(2, 10), (2, 10)], lines
