#!/bin/sh
# Builds the virtualenv bench/pipeline.py runs TransferQueue in (its
# `--tq-python`): torch first (the CPU build where the local wheel store has
# it), then transferqueue 0.1.11, which brings Ray, and psutil.
#
#   bench/peers/setup_tq.sh [DIR]    (DIR defaults to .venv-tq in the repository root)
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$root/.venv-tq}
python3 -m venv "$dir"
"$dir/bin/pip" install -q torch==2.13.0
"$dir/bin/pip" install -q transferqueue==0.1.11 psutil
echo "TransferQueue virtualenv ready: $dir/bin/python"
