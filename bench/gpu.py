"""Every GPU path of rollstream in one run, on a machine with CUDA, ending
with one JSON line; on a machine without CUDA it prints `{"skipped": WHY}`
and exits 0, having installed and run nothing.

The steps, each on its own (one that fails does not stop the others; the
exit status is 1 when any failed, and its entry says why):
- `gpu_tests`: pytest over the consumer's tests (their batches land on
  CUDA when it is present) and every other test file with a test skipped
  without CUDA (`skipif(not torch.cuda.is_available(), ...)`), the
  fault-injection suite left out;
- `validate`: bench/validate.py with a 1M-token GPU batch (CUDA events,
  medians; the target is under 1 ms per validation on an H200);
- `transfer`: one packed 1M-token batch's tensors copied host to device,
  from pinned memory and, to compare, from pageable memory;
- `masked_log_probs_tp8`: `masked_log_probs` over a 151,936-id vocabulary
  sharded 8 ways, simulated on the one GPU by slicing the logits and
  calling it with `tp_rank=k` for each slice; the slices' results, joined,
  are checked against the unsharded call;
- `sync_guard`: tests/test_sync_free.py where it exists (with CUDA it sets
  `torch.cuda.set_sync_debug_mode("error")` itself);
- `train_demo`: `rollstream demo --train --device cuda` (its replay over
  the supports must stay under 1e-4, its lineage whole);
- `demo`: `rollstream demo --device cuda`, two trainer ranks on the GPU;
- `pipeline_t8`: bench/pipeline.py at eight turns per sample with the
  consumer's batches on the GPU and, alternating with it, on the CPU
  (`--pipeline-runs` of each): the consumer's CPU seconds for the 256
  trajectories both ways (medians), and their ratio.

Dependencies. A lent GPU machine brings its own Python with torch built
for CUDA, and often neither a network nor this project's other
dependencies (pyzmq, msgspec, isal, ...). Whichever of them this Python
lacks (pyproject.toml's `[project] dependencies`, pytest and hypothesis)
is installed into a folder of its own put first on the path of this
process and of every command it starts; nothing is written into the
interpreter's environment:
- from `bench/wheels/` without an index, when that folder exists. It is
  gitignored; fill it on a machine that reaches PyPI, for the GPU
  machine's Python (`python3 --version` there: 3.12 on the H200s lent
  here) and the packages it lacks, for example
      python3 -m pip download --no-deps --only-binary=:all: --implementation cp \\
          --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \\
          -d bench/wheels pyzmq msgspec isal
  and copy it to the GPU machine with the working tree (being ignored, it
  must be named to go along). Each wheel is installed without its own
  dependencies: put theirs there too where that machine lacks them;
- otherwise from the package index, with a plain `pip install`.
rollstream itself is not installed: the same folder gets a link per
package (rollstream/common -> common/, ..., as pyproject.toml's
package-dir maps them), so the working tree is what runs.

usage: python3 bench/gpu.py [--steps N] [--gpu-tokens N] [--rows N] [--pipeline-runs N] [--logs DIR] [--smoke]
`--smoke` runs every step at a tiny size; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Callable

from procs import parse_args

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "bench" / "wheels"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TEST_DEPENDENCIES = ("pytest", "hypothesis")  # what the GPU tests import beside the package's own
SYNC_GUARD = ROOT / "tests" / "test_sync_free.py"
GPU_ONLY = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)")  # how a test file marks a test that needs CUDA
VOCAB, TP_SHARDS = 151_936, 8
VALIDATE_TARGET_S = 1e-3  # one 1M-token batch validated on an H200
SMOKE = {"steps": 3, "gpu_tokens": 50_000, "rows": 256, "trajectories": 8, "repeat": 3, "warmup": 1, "pipeline_runs": 1}


def cuda_absent() -> str | None:
    """Why this machine cannot run the GPU paths; None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed: expected a torch built for CUDA, got none"
    if not torch.cuda.is_available():
        return (f"no CUDA device: expected torch.cuda.is_available() to be True, got False "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return None


def missing_distributions() -> list[str]:
    """The distributions the GPU paths import that this Python lacks."""
    names = [re.match(r"[A-Za-z0-9._-]+", spec).group() for spec in PYPROJECT["project"]["dependencies"]]
    missing = []
    for name in [*names, *TEST_DEPENDENCIES]:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def prepare(site: Path) -> dict:
    """Put into `site` what this Python lacks (from bench/wheels/ when it
    exists, else from the index) and a link per rollstream package to the
    working tree, and put `site` first on this process's path. What was
    installed, and from where."""
    missing = missing_distributions()
    if missing:
        source = ["--no-index", "--find-links", str(WHEELS), "--no-deps"] if WHEELS.is_dir() else []
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(site), *source, *missing],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip must install {missing} from {WHEELS if source else 'the index'}: expected exit "
                               f"status 0, got {done.returncode}: {done.stderr.strip()[-1500:]}")
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        link = site.joinpath(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(ROOT / folder, target_is_directory=True)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    still = missing_distributions()
    if still:
        raise RuntimeError(f"every dependency must be importable once installed: expected none missing, got {still}")
    return {"installed": missing, "from": ("bench/wheels" if WHEELS.is_dir() else "index") if missing else None}


# Every command the step under way has run, for `--logs` (the JSON line keeps only a failure's tail).
_RAN: list[subprocess.CompletedProcess] = []


def command(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    _RAN.append(done)
    return done


def write_log(folder: Path, step: str) -> None:
    """The whole output of every command `step` ran, into `folder`/`step`.log."""
    with open(folder / f"{step}.log", "w") as log:
        for done in _RAN:
            log.write(f"$ {' '.join(map(str, done.args))}\nexit status {done.returncode}\n{done.stdout}{done.stderr}\n")


def tail(done: subprocess.CompletedProcess, characters: int = 3000) -> str:
    return (done.stdout + done.stderr)[-characters:]


def last_json(done: subprocess.CompletedProcess) -> dict:
    """The JSON object a command printed last."""
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"the command must end with a JSON line, exit status {done.returncode}: {tail(done)}")
    return json.loads(lines[-1])


def pytest_run(files: list[Path], env: dict[str, str], timeout: float) -> dict:
    """pytest over `files` (the fault-injection suite left out): its counts from a JUnit report."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "junit.xml"
        done = command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not faults",
                        f"--junitxml={report}", *map(str, files)], env, timeout)
        suites = list(ElementTree.parse(report).getroot().iter("testsuite")) if report.exists() else []
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
    return {"ok": done.returncode == 0 and counts["tests"] > 0, "files": [str(path.relative_to(ROOT)) for path in files],
            **counts, **({} if done.returncode == 0 else {"output": tail(done)})}


def gpu_tests(args, env: dict[str, str]) -> dict:
    """The consumer's tests and every other test file with a test that needs CUDA (the sync guard apart)."""
    asks = {path for path in (ROOT / "tests").glob("test_*.py") if GPU_ONLY.search(path.read_text())}
    return pytest_run(sorted((asks | set((ROOT / "tests").glob("test_consumer_*.py"))) - {SYNC_GUARD}), env,
                      args.timeout)


def sync_guard(args, env: dict[str, str]) -> dict:
    if not SYNC_GUARD.exists():
        return {"ok": True, "skipped": f"{SYNC_GUARD.relative_to(ROOT)} does not exist"}
    return pytest_run([SYNC_GUARD], env, args.timeout)


def validate(args, env: dict[str, str]) -> dict:
    done = command([sys.executable, str(ROOT / "bench" / "validate.py"), "--gpu-tokens", str(args.gpu_tokens),
                    *(["--smoke"] if args.smoke else [])], env, args.timeout)
    if done.returncode != 0:
        return {"ok": False, "output": tail(done)}
    figures = last_json(done)
    return {"ok": True, "gpu_tokens": figures["gpu_tokens"],
            "gpu_validate_ms": round(figures["gpu_validate_s"] * 1e3, 4),
            "gpu_validate_best_ms": round(figures["gpu_validate_best_s"] * 1e3, 4),
            "target_ms": VALIDATE_TARGET_S * 1e3, "under_target": figures["gpu_validate_s"] < VALIDATE_TARGET_S,
            "gpu_pack_upload_ms": round(figures["gpu_pack_upload_s"] * 1e3, 3),
            "cpu_validate_ratio": figures["validate_ratio"]}


def transfer(args, env: dict[str, str]) -> dict:
    """A packed batch's tensors to the GPU, from pinned and from pageable host memory."""
    import torch
    from peers import seed_path
    from validate import cuda_timed, deliveries_of

    from rollstream.consumer import Batch

    deliveries, _, _ = deliveries_of(seed_path.make_workload(n_traj=8))  # repeated up to --gpu-tokens
    tokens = sum(len(d.arrays["tokens"]) for d in deliveries)
    batch = Batch.from_deliveries(deliveries * -(-args.gpu_tokens // tokens), device="cpu")  # pageable
    pageable = [*batch.ragged().values(), batch.mask_offsets]
    pinned = [tensor.pin_memory() for tensor in pageable]
    nbytes = sum(tensor.numel() * tensor.element_size() for tensor in pageable)
    device = torch.device("cuda")
    figures: dict = {"tokens": int(batch.lengths["response"].sum()), "bytes": nbytes}
    for name, sources in (("pinned", pinned), ("pageable", pageable)):
        runs = cuda_timed(lambda: [tensor.to(device, non_blocking=True) for tensor in sources], args.repeat, args.warmup)
        figures[f"{name}_ms"] = round(statistics.median(runs) * 1e3, 3)
        figures[f"{name}_gb_per_s"] = round(nbytes / statistics.median(runs) / 1e9, 2)
    arrived = [tensor.to(device, non_blocking=True) for tensor in pinned]
    return {"ok": all(torch.equal(there.cpu(), here) for there, here in zip(arrived, pageable)), **figures}


def masked_log_probs_tp8(args, env: dict[str, str]) -> dict:
    """Each of 8 vocabulary slices through `masked_log_probs(..., tp_rank=k)`,
    joined (the token's logit less the log of the slices' summed
    exponentials) and compared with one call over the whole vocabulary."""
    import torch
    from validate import cuda_timed

    from rollstream.consumer import masked_log_probs

    device, rows, width = torch.device("cuda"), args.rows, VOCAB // TP_SHARDS
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, VOCAB, generator=generator, device=device).to(torch.bfloat16)
    sizes = torch.randint(1, 65, (rows,), generator=generator, device=device)  # top-k-sized supports
    offsets = torch.zeros(rows + 1, dtype=torch.int64, device=device)
    torch.cumsum(sizes, 0, out=offsets[1:])
    ids = torch.randint(0, VOCAB, (int(offsets[-1]),), generator=generator, device=device, dtype=torch.int32)
    pick = (torch.rand(rows, generator=generator, device=device) * sizes).long()
    tokens = ids[offsets[:-1] + pick].long()  # each token one of its support's ids

    def sliced() -> list[torch.Tensor]:
        return [masked_log_probs(logits[:, k * width:(k + 1) * width], tokens, ids, offsets, tp_rank=k)
                for k in range(TP_SHARDS)]

    whole = masked_log_probs(logits, tokens, ids, offsets)
    token_logit = logits[torch.arange(rows, device=device), tokens].float()
    # A slice's result where its slice holds some of the row's support: (its share of the token's logit, the
    # whole logit in the slice that holds the token, else 0) less the log of its share of the sum. A row
    # whose support has no id in a slice has no share there (what the call gives for it is not read).
    present = torch.zeros(TP_SHARDS, rows, dtype=torch.bool, device=device)
    present[ids.long() // width, torch.repeat_interleave(torch.arange(rows, device=device), sizes)] = True
    owned = torch.arange(TP_SHARDS, device=device)[:, None] == (tokens // width)[None]
    shares = torch.where(present, torch.where(owned, token_logit, 0.0) - torch.stack(sliced()), float("-inf"))
    difference = float((token_logit - torch.logsumexp(shares, dim=0) - whole).abs().max())
    all_slices = statistics.median(cuda_timed(sliced, args.repeat, args.warmup))
    unsharded = statistics.median(cuda_timed(lambda: masked_log_probs(logits, tokens, ids, offsets),
                                             args.repeat, args.warmup))
    return {"ok": difference < 1e-4, "rows": rows, "vocab": VOCAB, "shards": TP_SHARDS, "support_ids": len(ids),
            "max_abs_diff_vs_unsharded": difference, "per_slice_ms": round(all_slices / TP_SHARDS * 1e3, 4),
            "all_slices_ms": round(all_slices * 1e3, 4), "unsharded_ms": round(unsharded * 1e3, 4)}


def demo_summary(done: subprocess.CompletedProcess) -> dict | None:
    """A demo's JSON line, which it prints whether its verdict passed (exit 0) or failed (exit 1); None
    when it ended otherwise."""
    if done.returncode not in (0, 1):
        return None
    try:
        return last_json(done)
    except (RuntimeError, ValueError):
        return None


def train_demo(args, env: dict[str, str]) -> dict:
    """The demo's own verdict (checker, replay bound, reward check), and every step asked for run."""
    done = command([sys.executable, "-m", "rollstream.app.cli", "demo", "--train", "--device", "cuda", "--steps",
                    str(args.steps), "--plot", "", "--json"], env, args.timeout)
    summary = demo_summary(done)
    if summary is None:
        return {"ok": False, "output": tail(done)}
    kept = ("steps", "reward_first", "reward_last", "replay_max_abs_diff_support", "replay_mean_abs_diff_full",
            "replay_tokens", "lineage_lost", "lineage_duplicated", "failed", "seconds")
    return {"ok": bool(summary["ok"]) and summary["steps"] == args.steps, **{key: summary[key] for key in kept}}


def demo(args, env: dict[str, str]) -> dict:
    done = command([sys.executable, "-m", "rollstream.app.cli", "demo", "--device", "cuda", "--producers", "1",
                    "--trajectories", str(args.trajectories), "--dp-size", "2", "--json"], env, args.timeout)
    summary = demo_summary(done)
    if summary is None:
        return {"ok": False, "output": tail(done)}
    kept = ("trajectories", "acked", "committed", "lost", "duplicated", "corrupted", "tokens_per_s", "seconds")
    return {"ok": bool(summary["ok"]), **{key: summary[key] for key in kept}}


def pipeline_t8(args, env: dict[str, str]) -> dict:
    """The eight-turn pipeline, its consumer on the GPU against on the CPU, runs alternating."""
    size = ["--smoke"] if args.smoke else ["--rounds", "1", "--reps", "5"]
    runs: dict[str, list[dict]] = {"cuda": [], "cpu": []}
    for _ in range(args.pipeline_runs):
        for device, figures in runs.items():
            done = command([sys.executable, str(ROOT / "bench" / "pipeline.py"), *size, "--modes", "8", "--no-half-load",
                            "--device", device], env, args.timeout)
            if done.returncode != 0:
                return {"ok": False, "device": device, "output": tail(done)}
            figures.append(last_json(done))

    def median(device: str, key: str) -> float:
        return statistics.median(figures[key] for figures in runs[device])

    out: dict = {"ok": all(figures["verified"] for figures in (*runs["cuda"], *runs["cpu"])), "runs": args.pipeline_runs}
    for device in runs:
        out[f"consumer_cpu_s_t8_{device}"] = round(median(device, "consumer_cpu_s_t8"), 4)
        out[f"consumer_cpu_by_thread_s_t8_{device}"] = [figures["consumer_cpu_by_thread_s_t8"] for figures in runs[device]]
        out[f"broker_us_per_frame_t8_{device}"] = median(device, "broker_us_per_frame_t8")
    out["consumer_cpu_ratio_cuda_to_cpu"] = round(out["consumer_cpu_s_t8_cuda"] / out["consumer_cpu_s_t8_cpu"], 3)
    return out


STEPS: dict[str, Callable[..., dict]] = {
    "gpu_tests": gpu_tests, "validate": validate, "transfer": transfer, "masked_log_probs_tp8": masked_log_probs_tp8,
    "sync_guard": sync_guard, "train_demo": train_demo, "demo": demo, "pipeline_t8": pipeline_t8,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps of the --train demo")
    parser.add_argument("--gpu-tokens", type=int, default=1_000_000, help="tokens at least in the validated and copied batch")
    parser.add_argument("--rows", type=int, default=8192, help="response tokens through masked_log_probs")
    parser.add_argument("--trajectories", type=int, default=16, help="trajectories of the synthetic demo")
    parser.add_argument("--repeat", type=int, default=50, help="timed runs of each in-process measurement (medians)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed runs before them")
    parser.add_argument("--pipeline-runs", type=int, default=2, help="bench/pipeline.py runs of each device (pipeline_t8)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each command may take")
    parser.add_argument("--logs", type=Path, help="a folder to write each step's whole command output into")
    args = parse_args(parser, SMOKE)
    why = cuda_absent()
    if why is not None:
        print(json.dumps({"skipped": why}))
        return
    import torch

    started = time.perf_counter()
    site = Path(tempfile.mkdtemp(prefix="rollstream-gpu-"))
    figures: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()}
    try:
        try:
            figures["dependencies"] = {"ok": True, **prepare(site)}
        except Exception as exc:  # noqa: BLE001 - reported in the JSON line: nothing else can run
            figures["dependencies"] = {"ok": False, "error": str(exc)}
        else:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))}
            for name, step in STEPS.items():
                print(f"gpu.py: {name} ...", flush=True)
                began = time.perf_counter()
                try:
                    figures[name] = step(args, env)
                except Exception as exc:  # noqa: BLE001 - one step's failure is its entry, the others still run
                    figures[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-3000:]}
                figures[name]["step_seconds"] = round(time.perf_counter() - began, 1)
                if args.logs is not None:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    write_log(args.logs, name)
                _RAN.clear()
    finally:
        shutil.rmtree(site, ignore_errors=True)
    figures["seconds"] = round(time.perf_counter() - started, 1)
    figures["ok"] = all(entry["ok"] for entry in figures.values() if isinstance(entry, dict))
    print(json.dumps(figures))
    sys.exit(0 if figures["ok"] else 1)


if __name__ == "__main__":
    main()
