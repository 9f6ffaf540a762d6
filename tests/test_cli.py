"""The README's main command runs on its embedded defaults."""
import subprocess
import sys


def test_demo_runs_and_reports_a_valid_batch():
    out = subprocess.run(
        [sys.executable, "-m", "rollstream.common.cli", "demo", "--trajectories", "4", "--turns", "2"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert "trajectories: 4" in out and "valid: yes" in out
