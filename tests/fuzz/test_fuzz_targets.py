"""The fuzz targets (tests/fuzz/targets.py) in the suite. Without atheris:
every input of the checked-in corpus and every regression input (a past
finding) goes through its target, which may raise only its decoders'
documented errors. Marked slow: a bounded, seeded coverage-guided run of
each target (tests/fuzz/run.py, atheris) finds nothing; skipped where
atheris is not installed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fuzz.targets import NOT_FIXED_YET, TARGETS, join_frames, run_target, split_frames

from rollstream.broker.cli import broker as broker_command
from rollstream.producer.cli import producer as producer_command

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
REGRESSIONS = HERE / "regressions"
RUN = HERE / "run.py"
# Seconds of fuzzing per target in the suite: with each child's start-up, the eleven targets take about four
# minutes in all. Before a release, run longer (docs/operations.md, Fuzzing).
SUITE_SECONDS = 15
SEED = 1


def _replay(target: str, path: Path) -> None:
    try:
        run_target(target, path.read_bytes())
    except BaseException as error:
        error.add_note(f"the input: {path.relative_to(HERE)} (tests/fuzz/run.py saves one like it from a finding)")
        raise


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_corpus_input_stays_within_its_targets_contract(target):
    paths = sorted(path for path in (CORPUS / target).glob("*") if path.is_file())
    assert paths, f"tests/fuzz/corpus/{target} holds no inputs: python tests/fuzz/seed.py {target} writes them"
    for path in paths:
        _replay(target, path)


def _regression_input(path: Path):
    """`path` as a test parameter; one whose fix has not landed, as a strict expected failure (targets.NOT_FIXED_YET)."""
    name = f"{path.parent.name}/{path.name}"
    known = NOT_FIXED_YET.get(name)
    return pytest.param(path, id=name, marks=[pytest.mark.xfail(strict=True, reason=known.reason)] if known else [])


REGRESSION_INPUTS = [_regression_input(path) for path in sorted(REGRESSIONS.glob("*/*")) if path.is_file()]


def test_every_input_not_fixed_yet_is_kept():
    kept = {f"{path.parent.name}/{path.name}" for path in REGRESSIONS.glob("*/*")}
    assert set(NOT_FIXED_YET) <= kept, f"entries without their input: {sorted(set(NOT_FIXED_YET) - kept)}"


@pytest.mark.parametrize("path", REGRESSION_INPUTS)
def test_every_past_finding_stays_within_its_targets_contract(path):
    assert path.parent.name in TARGETS, f"{path.relative_to(HERE)} is filed under no target of {sorted(TARGETS)}"
    _replay(path.parent.name, path)


def test_the_input_frames_come_back_as_written():
    frames = [b"header", b"", b"\x00" * 9, b"last"]
    assert split_frames(join_frames(frames)) == frames
    assert split_frames(join_frames([b"x" * 40] * 16)) == [b"x" * 40] * 16
    assert split_frames(b"") == [b""]
    assert split_frames(b"\x02\xff\xff\xff\xff") == [b"", b"", b""]  # lengths past the input read as what is left


@pytest.mark.parametrize("command, name", [(broker_command, "broker-flat"), (producer_command, "producer-flags")])
def test_a_valid_settings_file_of_the_corpus_loads_clean(command, name, capsys):
    """Ranges of numbers (max_staleness, reward_levels, late_reward_rate)
    given as TOML numbers are taken as numbers, not refused as text."""
    path = CORPUS / "settings_toml" / name
    assert command.main(["--config", str(path), "--check-config"], prog_name=command.name, standalone_mode=False) == 0
    assert "configuration ok" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_a_seeded_coverage_guided_run_finds_nothing(target, tmp_path):
    pytest.importorskip("atheris", reason="the fuzzing runs need atheris (the test extra installs it)")
    done = subprocess.run([sys.executable, str(RUN), target, "--seconds", str(SUITE_SECONDS), "--seed", str(SEED),
                           "--findings", str(tmp_path / "findings")],
                          capture_output=True, text=True, timeout=SUITE_SECONDS + 600)
    lines = done.stdout.splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    assert done.returncode == 0 and summary.get("findings") == [], f"{done.stdout}\n{done.stderr}"
    assert summary["targets"][target]["executions"] > 0, done.stdout
