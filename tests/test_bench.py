"""The benchmarks run from a fresh clone: no file of the project reaches
outside the repository (a clone has no `../shared`), and every bench script
has a `--smoke` size that ends with its one JSON line of figures."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A path above the repository: `../shared`, a `shared` folder joined on, or a parent of the repository's root.
OUTSIDE = re.compile(r"\.\./shared|[\"']shared[\"']\s*/|parents\[1\]\.parent|\.parent\.parent\.parent")
HELPERS = {"procs.py", "stores.py"}  # modules the scripts import, not scripts
SCRIPTS = sorted(path.name for path in (ROOT / "bench").glob("*.py") if path.name not in HELPERS)


def _tracked() -> list[Path]:
    """The project's text files git tracks (this one, which names the pattern, aside)."""
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / name for name in names if Path(name).suffix in {".py", ".md", ".sh", ".toml", ".cfg", ".yaml",
                                                                     ".yml", ".txt", ""}
            and ROOT / name != Path(__file__).resolve()]


def test_no_file_of_the_project_reaches_outside_the_repository():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in _tracked() if path.is_file()
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, "paths outside the repository:\n" + "\n".join(found)


def test_the_pattern_finds_what_it_is_for():
    assert all(OUTSIDE.search(text) for text in ('sys.path.insert(0, "../shared/bench")',
                                                 'Path(__file__).resolve().parents[1].parent / "shared" / "bench"'))
    assert not OUTSIDE.search('ROOT = Path(__file__).resolve().parents[1]')


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_bench_script_runs_at_its_smoke_size_and_ends_with_its_json_line(script):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"{script} --smoke exited {run.returncode}:\n{run.stderr[-3000:]}"
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict) and figures, figures


def _smoke_figures(script: str, *args: str) -> dict:
    """The last JSON line of `script --smoke args`, which must exit 0."""
    run = subprocess.run([sys.executable, script, "--smoke", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _refuses(script: str, flag: str, value: str, rule: str) -> None:
    """`script flag value` exits 2 naming `rule`."""
    refused = subprocess.run([sys.executable, script, flag, value], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and rule in refused.stderr, refused.stderr


@pytest.mark.slow
def test_the_replay_records_one_turn_trajectories_and_refuses_a_turn_count_out_of_range():
    script = str(ROOT / "bench" / "broker_replay.py")
    figures = _smoke_figures(script, "--turns", "1")
    assert figures["turns"] == 1 and figures["frames"] >= 2 * 8, figures  # a turn and an end per trajectory, and a hello
    for turns in ("0", "5001"):
        _refuses(script, "--turns", turns, f"--turns must be in [1, 5000], got {turns}")


@pytest.mark.slow
def test_the_consumer_replay_counts_a_delivery_per_trajectory_and_refuses_sizes_out_of_range():
    script = str(ROOT / "bench" / "consumer_replay.py")
    figures = _smoke_figures(script, "--turns", "2")
    # 8 trajectories of 2 turns: one delivery each, besides the welcome and whatever else the broker said
    assert figures["deliveries"] == 8 and figures["messages"] > 8 and figures["turns"] == 2, figures
    assert figures["calls_per_delivery"] > 0 and figures["consumer_us_per_delivery"] > 0, figures
    for flag, rule in (("--turns", "--turns must be in [1, 5000], got 0"), ("--samples", "--samples must be in [1, 4096], got 0"),
                       ("--reps", "--reps must be in [1, 1000], got 0")):
        _refuses(script, flag, "0", rule)


def test_the_gpu_script_on_a_machine_without_cuda_says_why_it_skipped_in_its_one_json_line():
    """With no CUDA device visible it installs and runs nothing: its whole
    output is the JSON line with the reason, and it exits 0."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, run.stdout
    figures = json.loads(lines[0])
    assert list(figures) == ["skipped"], figures
    assert figures["skipped"].startswith("no CUDA device: expected torch.cuda.is_available() to be True, got False "
                                         "(torch "), figures


@pytest.mark.slow
def test_restart_bias_smoke_trains_what_run_a_trained_when_restarts_continue_and_less_when_they_abort():
    """bench/restart_bias.py --smoke: B (killed, `--on-restart continue`)
    trains every trajectory of A with the very same content, so its length
    ratios are exactly 1; C (`--on-restart abort`) trains all but those it
    gave up, each unchanged. C's ratios are not checked: at this size which
    trajectories a kill finds open decides them."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "restart_bias.py"), "--smoke"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"restart_bias.py --smoke exited {run.returncode}:\n{run.stderr[-3000:]}"
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert (figures["prompts"], figures["group_size"]) == (12, 2), figures
    runs = figures["runs"]
    assert set(runs) == {"A", "B", "C"}, runs
    for name, kept in runs.items():
        assert {"trained", "mean", "p90", "kills", "resumed", "trained_twice"} <= set(kept), (name, kept)
        assert kept["trained_twice"] == 0, (name, kept)
    a, b, c = runs["A"], runs["B"], runs["C"]
    assert (a["kills"], a["resumed"], a["trained"]) == (0, {}, 24), a
    assert b["kills"] >= 1 and c["kills"] >= 1, (b, c)
    assert sum(b["listed_at_restarts"]) == b["resumed"]["listed"] == b["resumed"]["continued"] >= 1, b
    assert (b["trained"], b["missing_from_a"], b["differing_from_a"]) == (24, 0, 0), b
    assert (b["mean"], b["p90"], b["mean_ratio"], b["p90_ratio"]) == (a["mean"], a["p90"], 1.0, 1.0), b
    assert sum(c["listed_at_restarts"]) == c["resumed"]["listed"] == c["resumed"]["aborted"] >= 1, c
    assert (c["trained"], c["missing_from_a"], c["differing_from_a"]) == (24 - c["resumed"]["aborted"],
                                                                           c["resumed"]["aborted"], 0), c
    assert 0 < c["mean_ratio"] and 0 < c["p90_ratio"], c


@pytest.mark.slow
def test_wire_bytes_smoke_counts_four_bytes_per_support_id_for_mask_log_probs_on_the_wire_and_in_the_store():
    """bench/wire_bytes.py --smoke: `mask_log_probs` add one float32 per
    support id (and a flag in each turn's header) to every token, on the
    wire and in the store; a store record is its frames as they arrived,
    with a few bytes of its own."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "wire_bytes.py"), "--smoke"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"wire_bytes.py --smoke exited {run.returncode}:\n{run.stderr[-3000:]}"
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert figures["prime_rl_mask_wire_reference"] == 32 and figures["trajectories"] == 2, figures
    for name in ("prime_rl", "pipeline"):
        workload = figures[name]
        support, without, with_ = (workload[key] for key in ("support", "without_mask_log_probs", "with_mask_log_probs"))
        assert support["tokens"] == 10_000 and support["mean"] > 1, workload
        added = workload["mask_log_probs_wire"]
        assert 4 * support["mean"] - 0.05 <= added < 4 * support["mean"] + 1, workload
        assert 0 < with_["store"] - with_["wire"] < 1 and 0 < without["store"] - without["wire"] < 1, workload
        assert workload["mask_wire"] < without["wire"], workload
    assert figures["prime_rl"]["support"]["median"] == 2 and 0.4 < figures["prime_rl"]["support"]["single_share"] < 0.55
