"""Coverage-guided fuzzing of the targets in tests/fuzz/targets.py with
atheris (libFuzzer), one target at a time, each in its own process.

    python tests/fuzz/run.py                      # every target, 60 s each, seed 1
    python tests/fuzz/run.py store spool --seconds 600 --seed 7
    python tests/fuzz/run.py --runs 20000         # a fixed number of inputs: the same seed repeats the run exactly

Each target starts from its checked-in corpus (tests/fuzz/corpus/<target>)
and its regression inputs (tests/fuzz/regressions/<target>, but those not
fixed yet, `targets.NOT_FIXED_YET`); what the run
adds to the corpus goes to a temporary directory (or --corpus-out). Per
target it prints the inputs executed and the coverage libFuzzer counts
(`cov`: edges of the instrumented code, `ft`: features); at the end one JSON
line with every target's figures. A finding (an exception outside the
target's allowed family, a failed property, a hang or running out of
memory) is saved under --findings (tests/fuzz/findings/<target>/ by
default) with its traceback, and the exit status is 1, unless it is the
crash of an input not fixed yet (the same exception raised in the same
function): that one is reported as known. Kept as a regression
input (tests/fuzz/regressions/<target>/<name>), it is replayed by
tests/fuzz/test_fuzz_targets.py in the normal suite.

The child process (`--child TARGET`) imports the targets under atheris'
instrumentation and hands libFuzzer's own arguments through.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
REGRESSIONS = HERE / "regressions"
FINDINGS = HERE / "findings"
# Packages whose code is instrumented for coverage: rollstream's, and the TOML parser the settings are read with.
INSTRUMENTED = ("rollstream", "tomllib")
PER_INPUT_TIMEOUT = 20  # seconds one input may take before it counts as a hang
RSS_LIMIT_MB = 2048
STARTUP_ALLOWANCE = 120  # seconds a child may take beyond its fuzzing time (imports, the corpus) before it is stopped


@dataclass
class Result:
    """One target's run, read from libFuzzer's output."""

    target: str
    executions: int = 0
    edges: int = 0  # libFuzzer's `cov`
    features: int = 0  # libFuzzer's `ft`
    corpus: int = 0  # inputs in its corpus at the end
    new_inputs: int = 0  # inputs the run added to it
    finding: str | None = None  # the saved input of a finding
    known: str | None = None  # the finding is the crash of this regression input, not fixed yet (targets.NOT_FIXED_YET)
    error: str | None = None  # the run itself failed (no finding)

    @property
    def ok(self) -> bool:
        return (self.finding is None or self.known is not None) and self.error is None


def dictionary(target: str) -> list[bytes]:
    """Tokens for libFuzzer's mutations: the names the target's format
    uses (message types, fields, arrays and dtypes as msgpack strings;
    settings keys; an engine reply's JSON keys), so a mutation can put a
    known name in place."""
    import msgpack

    from rollstream.common import contract, messages
    from rollstream.common.messages import ENVELOPE_KEYS

    if target == "settings_toml":
        from dataclasses import fields

        from rollstream.broker.settings import BrokerSettings
        from rollstream.producer.settings import ProducerSettings

        names = {f.name for settings in (BrokerSettings, ProducerSettings) for f in fields(settings)}
        return [name.encode() for name in sorted(names)] + [b"[broker]", b"[producer]", b"GiB", b"true", b'"', b"="]
    if target == "engine_replies":
        from rollstream.common import ingest

        keys = {"output_ids", "meta_info", "choices", "metadata", "token_ids", "logprobs", "content", "token_id",
                "logprob", "sampling_mask", "finish_reason", "type", "message", "status_code", "code", "error",
                "response_token_ids", "version", "start", "end", "weight_version", ingest.SUPPORTS_KEY,
                ingest.LOG_PROBS_KEY, ingest.SUPPORTS_LENGTH_KEY, ingest.FULL_LOG_PROBS_KEY, ingest.SPANS_KEY,
                *ingest.FINISH_REASON_STATUS, *ingest.UNCARRIED_KEYS}
        return [f'"{key}"'.encode() for key in sorted(keys)] + [b"sampling mask", b"exceeds", b"support of", b"null"]
    if target in ("miles_session", "spool", "segments", "store"):
        return []
    words = set(ENVELOPE_KEYS) | set(contract.ARRAYS) | {spec.dtype.name for spec in contract.ARRAYS.values()}
    words |= set(contract.STATUSES) | set(contract.NACK_CODES)
    for schema in (messages.PRODUCER_TO_BROKER, messages.CONSUMER_TO_BROKER, messages.BROKER_TO_PRODUCER,
                   messages.BROKER_TO_CONSUMER, messages.ADMIN_REQUESTS, messages.ADMIN_REPLIES):
        for spec in schema.specs.values():
            words |= {spec.type, *spec.kinds}
    return [msgpack.packb(word) for word in sorted(words)]


def _dictionary_file(tokens: list[bytes], path: Path) -> None:
    path.write_text("".join('"' + "".join(f"\\x{byte:02x}" for byte in token) + '"\n' for token in tokens))


def run_target(target: str, *, seconds: int, seed: int, runs: int | None, findings: Path, corpus_out: Path | None,
               verbose: bool) -> Result:
    """Fuzz one target in a child process; its figures, and the finding if any."""
    from targets import NOT_FIXED_YET, memory_directory

    with tempfile.TemporaryDirectory(prefix=f"rollstream-fuzz-{target}-") as work:
        work_path = Path(work)
        grown = corpus_out / target if corpus_out else work_path / "corpus"
        grown.mkdir(parents=True, exist_ok=True)
        artifacts = findings / target
        artifacts.mkdir(parents=True, exist_ok=True)
        options = [f"-seed={seed}", f"-max_total_time={seconds}", f"-timeout={PER_INPUT_TIMEOUT}",
                   f"-rss_limit_mb={RSS_LIMIT_MB}", f"-artifact_prefix={artifacts}/", "-print_final_stats=1"]
        if runs is not None:
            options.append(f"-runs={runs}")
        tokens = dictionary(target)
        if tokens:
            _dictionary_file(tokens, work_path / "tokens.dict")
            options.append(f"-dict={work_path / 'tokens.dict'}")
        # The regression inputs, but those whose fix has not landed: the run would stop at once on them.
        regressions = work_path / "regressions"
        regressions.mkdir()
        for path in sorted(REGRESSIONS.glob(f"{target}/*")):
            if f"{target}/{path.name}" not in NOT_FIXED_YET:
                shutil.copy(path, regressions / path.name)
        dirs = [str(grown), str(regressions)] + ([str(CORPUS / target)] if (CORPUS / target).is_dir() else [])
        scratch = tempfile.mkdtemp(prefix=f"rollstream-fuzz-{target}-", dir=memory_directory())
        env = {**os.environ, "ROLLSTREAM_FUZZ_SCRATCH": scratch}
        command = [sys.executable, str(Path(__file__).resolve()), "--child", target, *options, *dirs]
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=env, timeout=seconds + STARTUP_ALLOWANCE)
            log = done.stdout.decode(errors="replace")
            code = done.returncode
        except subprocess.TimeoutExpired as expired:
            log = (expired.stdout or b"").decode(errors="replace")
            code = None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if verbose:
            print(log)
        result = _read_log(target, log)
        if result.finding is not None:
            (artifacts / (Path(result.finding).name + ".log")).write_text(log)
        elif code is None:
            result.error = f"did not end within {seconds + STARTUP_ALLOWANCE} s"
        elif code != 0:
            result.error = f"exited {code} without a finding; its output ends:\n" + "\n".join(log.splitlines()[-30:])
        return result


_STATUS = re.compile(r"cov: (\d+) ft: (\d+) corp: (\d+)/")


def _read_log(target: str, log: str) -> Result:
    result = Result(target)
    statuses = _STATUS.findall(log)
    if statuses:
        result.edges, result.features, result.corpus = map(int, statuses[-1])
    if executed := re.search(r"stat::number_of_executed_units: (\d+)", log):
        result.executions = int(executed.group(1))
    if initial := re.search(r"INITED cov: \d+ ft: \d+ corp: (\d+)/", log):
        result.new_inputs = result.corpus - int(initial.group(1))
    if written := re.search(r"Test unit written to (\S+)", log):
        result.finding = written.group(1)
        result.known = _known(target, log)
    return result


_FRAME = re.compile(r'\s*File "(.+)", line \d+, in (\S+)$')


def _known(target: str, log: str) -> str | None:
    """The regression input not fixed yet whose crash the log shows (the
    same exception type raised in the same function), if any."""
    from targets import NOT_FIXED_YET

    start = log.find("=== Uncaught Python exception: ===")
    if start < 0:
        return None
    lines = log[start:].splitlines()
    exception = lines[1].split(":")[0].strip().rsplit(".", 1)[-1] if len(lines) > 1 else ""
    frames = [match.groups() for line in lines if (match := _FRAME.match(line))]
    if not frames:
        return None
    path, function = frames[-1]  # the innermost frame of the last traceback: where it was raised
    for name, known in NOT_FIXED_YET.items():
        file, _, where = known.where.rpartition(":")
        if name.startswith(f"{target}/") and exception == known.exception and function == where \
                and (path == file or path.endswith("/" + file)):
            return name
    return None


def _report_finding(result: Result) -> None:
    path = Path(result.finding or "")
    log = (path.parent / (path.name + ".log")).read_text()
    start = log.find("=== Uncaught Python exception: ===")
    excerpt = log[start : log.find("==", start + 40)] if start >= 0 else "\n".join(log.splitlines()[-20:])
    print(f"  finding, saved as {path} (its output: {path.name}.log)")
    print("  " + excerpt.strip().replace("\n", "\n  "))
    data = path.read_bytes() if path.exists() else b""
    if len(data) <= 4096:
        print(f"  input (base64): {base64.b64encode(data).decode()}")
    print(f"  to keep it as a regression input: mv {path} {REGRESSIONS / result.target}/<a name saying what it is>")


def _remove_empty(findings: Path) -> None:
    """Take away the findings folders a run left empty."""
    for folder in [*findings.glob("*"), findings]:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def child(target: str, libfuzzer_args: list[str]) -> None:
    """Fuzz `target` in this process (libFuzzer's arguments after it)."""
    import logging

    import atheris

    logging.disable(logging.CRITICAL)  # the broker's own logs of refused input would drown libFuzzer's output
    sys.path.insert(0, str(HERE))
    with atheris.instrument_imports(include=list(INSTRUMENTED)):
        import targets
    run = targets.run_target
    atheris.Setup([sys.argv[0], *libfuzzer_args], lambda data: run(target, data))
    atheris.Fuzz()


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
        return 0
    sys.path.insert(0, str(HERE))
    from targets import NOT_FIXED_YET, TARGETS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", metavar="TARGET", help=f"of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--seconds", type=int, default=60, help="fuzzing time per target (default 60)")
    parser.add_argument("--seed", type=int, default=1, help="libFuzzer's seed, at least 1 (default 1)")
    parser.add_argument("--runs", type=int, default=None, help="stop each target after this many inputs")
    parser.add_argument("--findings", type=Path, default=FINDINGS, help="where findings are saved, per target")
    parser.add_argument("--corpus-out", type=Path, default=None, help="keep each target's grown corpus here")
    parser.add_argument("--verbose", action="store_true", help="print libFuzzer's whole output")
    args = parser.parse_args()
    unknown = [name for name in args.targets if name not in TARGETS]
    if unknown or args.seed < 1 or args.seconds < 1:
        parser.error(f"unknown target(s) {unknown}" if unknown else "--seed and --seconds must be at least 1")
    results = []
    for name in args.targets or list(TARGETS):
        result = run_target(name, seconds=args.seconds, seed=args.seed, runs=args.runs, findings=args.findings,
                            corpus_out=args.corpus_out, verbose=args.verbose)
        results.append(result)
        print(f"{name}: {result.executions} executions, cov {result.edges} edges, ft {result.features}, "
              f"corpus {result.corpus} (+{result.new_inputs})", flush=True)
        if result.known is not None:
            print(f"  stopped at a finding not fixed yet, {result.known} ({NOT_FIXED_YET[result.known].reason}), "
                  f"saved as {result.finding}; not counted")
        elif result.finding is not None:
            _report_finding(result)
        elif result.error is not None:
            print(f"  the run failed: {result.error}")
    findings = [r.target for r in results if r.finding is not None and r.known is None]
    print(json.dumps({"seconds": args.seconds, "seed": args.seed, "runs": args.runs, "findings": findings,
                      "not_fixed_yet": [r.known for r in results if r.known is not None],
                      "failed": [r.target for r in results if r.error is not None],
                      "targets": {r.target: {k: v for k, v in asdict(r).items() if k != "target"} for r in results}}))
    _remove_empty(args.findings)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
