"""The README's main command runs the whole pipeline on its embedded defaults."""
import re
import subprocess
import sys


def test_demo_runs_the_pipeline_end_to_end():
    out = subprocess.run(
        [sys.executable, "-m", "rollstream.common.cli", "demo", "--producers", "2", "--trajectories", "8",
         "--group-size", "2", "--batch-size", "2"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert "trajectories: 16 in groups of 2" in out and "valid: yes" in out
    applied, delivered = map(int, re.search(r"frames applied (\d+), delivered (\d+)", out).groups())
    assert delivered == 16 and applied >= 16
    assert "open 0, ready 0, dead 0" in out


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "rollstream.common.cli", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    for command in ("broker", "producer", "consume", "status", "requeue", "demo"):
        assert command in out
