"""deploy/ is checked: every manifest by the real tool for its kind
(kubernetes-validate, promtool, systemd-analyze), and every `rollstream`
command line and TOML file in it by the CLI's own `--check-config` dry run.
A tool that is missing skips its test, naming the package; .ci/run installs
them all."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from rollstream.app.cli import main
from rollstream.common.config import parse_bytes
from rollstream.common.curve import KeyLayout

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ROLLSTREAM = Path(sys.executable).with_name("rollstream")
DAEMONS = ("broker", "producer")  # the commands that take --config and --check-config
# Values the cluster fills in at run time (env valueFrom.fieldRef), for the dry run.
FIELD_SAMPLES = {"status.hostIP": "10.0.0.1", "metadata.name": "rollout-sglang-0"}
KEYS = "/etc/rollstream/keys"  # where every pod and unit finds its CURVE keys
PROMPTS = "/etc/rollstream/prompts.jsonl"  # the prompts an operator gives the sglang producer
# The broker's directories and whom each allows: with the broker's, the Secret's key pairs.
ALLOWED = {"producers": "producer", "consumers": "trainer", "admin": "admin"}
REQUIRED_ALERTS = {"RollstreamBrokerDown", "RollstreamDeadLettersGrowing", "RollstreamReplayGapRate",
                   "RollstreamStorageNearBudget", "RollstreamRedeliveryRate", "RollstreamCurveRefused",
                   "RollstreamArchiveFailing"}


def tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package {package!r}; .ci/run installs it when root)")
    return path


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("ROLLSTREAM_")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**clean, **(env or {})})


# -- what deploy/ holds ---------------------------------------------------------------------------


@dataclass
class CommandLine:
    where: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def kubernetes_documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def containerfile() -> dict[str, list[str]]:
    """The Containerfile's ENTRYPOINT, CMD (exec form) and USER."""
    found = {}
    for line in (DEPLOY / "container" / "Containerfile").read_text().splitlines():
        instruction, _, rest = line.partition(" ")
        if instruction in ("ENTRYPOINT", "CMD"):
            found[instruction] = json.loads(rest)
        elif instruction in ("USER", "COPY"):
            found.setdefault(instruction, []).append(rest)
    return found


def pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] == "Pod":
        return [doc["spec"]]
    template = doc.get("spec", {}).get("template")
    return [template["spec"]] if template else []


def container_env(container: dict) -> dict[str, str]:
    """A container's environment as Kubernetes sets it: `$(NAME)` expanded
    from the variables before it, field references from FIELD_SAMPLES."""
    env: dict[str, str] = {}
    assert "envFrom" not in container, f"{container['name']}: envFrom is not read by this test"
    for item in container.get("env", []):
        if "valueFrom" in item:
            env[item["name"]] = FIELD_SAMPLES[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
    return env


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """Real key pairs for the Secret's names, and the broker's directories of allowed keys: what an
    operator makes with `rollstream keys generate` (docs/operations.md, Security)."""
    return KeyLayout.generate(tmp_path_factory.mktemp("keys"), ALLOWED).root


def operator_paths(root: Path, keys: Path) -> dict[str, Path]:
    """The files an operator puts beside the configurations (the keys, a prompts file), made
    locally under `root`, by the paths the configurations name them."""
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"input_ids": [1, 2, 3]}\n')
    return {KEYS: keys, PROMPTS: prompts}


def localized(text: str, mounts: dict[str, Path]) -> str:
    """`text` with every mounted path (longest first) replaced by its local copy."""
    for mount in sorted(mounts, key=len, reverse=True):
        text = re.sub(rf"(?<![\w/]){re.escape(mount)}(?=[/\"\s]|$)", str(mounts[mount]), text)
    return text


def mounted_files(spec: dict, container: dict, root: Path, keys: Path) -> dict[str, Path]:
    """Each of the container's ConfigMap and Secret mounts, written under `root`: mount path -> local
    directory. A Secret's items are the generated `keys` of their names; ConfigMap files name the
    mounts by their paths in the container, which are made local too."""
    documents = {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in kubernetes_documents()}
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    mounts, files = {}, {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        local = root / container["name"] / mount["name"]
        if "configMap" in volume:
            source, data = volume["configMap"], documents["ConfigMap", volume["configMap"]["name"]]["data"]
            for item in source.get("items", [{"key": key, "path": key} for key in data]):
                files[local / item["path"]] = data[item["key"]]
        elif "secret" in volume:
            source = volume["secret"]
            assert ("Secret", source["secretName"]) in documents, f"{container['name']}: no Secret {source['secretName']}"
            for item in source["items"]:
                (local / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(keys / item["key"], local / item["path"])
        else:
            continue
        mounts[mount["mountPath"]] = local
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(localized(text, mounts))
    return mounts


def rebase(arg: str, mounts: dict[str, Path]) -> str:
    """`arg` (a path, or `--flag=path`) with a mounted path replaced by its local copy."""
    flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount + "/"):
            return f"{flag}{eq}{mounts[mount]}{value[len(mount):]}"
    return arg


def kubernetes_command_lines(root: Path, keys: Path) -> list[CommandLine]:
    image = containerfile()
    lines = []
    for path, doc in kubernetes_documents():
        for spec in pod_specs(doc):
            for container in spec.get("initContainers", []) + spec["containers"]:
                ours = container["image"].split(":")[0] == "rollstream"
                argv = container.get("command") or (image["ENTRYPOINT"] if ours else [])
                argv = argv + container.get("args", image["CMD"] if ours and "command" not in container else [])
                if argv and Path(argv[0]).name == "rollstream":
                    mounts = mounted_files(spec, container, root, keys)
                    lines.append(CommandLine(f"{path.name}: {doc['kind']} {doc['metadata']['name']}, container "
                                             f"{container['name']}", [rebase(arg, mounts) for arg in argv],
                                             container_env(container)))
    return lines


def unit_files() -> list[Path]:
    return sorted((DEPLOY / "systemd").glob("*.service"))


def unit_instances(unit: Path) -> list[str]:
    """`name@.service` runs one instance per configuration in deploy/systemd/<role>/ (the
    layout of /etc/rollstream); a plain unit is its own single instance."""
    if not unit.name.endswith("@.service"):
        return [""]
    role = unit.name.removesuffix("@.service").removeprefix("rollstream-")
    instances = sorted(path.stem for path in (DEPLOY / "systemd" / role).glob("*.toml"))
    assert instances, f"{unit.name}: no example configuration in deploy/systemd/{role}/"
    return instances


def exec_lines(unit: Path) -> list[str]:
    return [line.partition("=")[2] for line in unit.read_text().splitlines() if re.match(r"Exec\w*=", line)]


def etc_rollstream(root: Path, keys: Path) -> Path:
    """A local /etc/rollstream as the units expect it: deploy/systemd's files (naming the keys by
    their local paths) and the keys."""
    etc = root / "etc-rollstream"
    shutil.copytree(DEPLOY / "systemd", etc)
    paths = operator_paths(etc, keys)
    for path in etc.rglob("*.toml"):
        path.write_text(localized(path.read_text(), paths))
    return etc


def systemd_command_lines(state: Path, etc: Path) -> list[CommandLine]:
    """Exec lines with the specifiers filled in: %E/rollstream is `etc` (see `etc_rollstream`),
    %S a scratch state directory, %i each instance."""
    lines = []
    for unit in unit_files():
        for instance in unit_instances(unit):
            for line in exec_lines(unit):
                filled = (line.replace("%E/rollstream", str(etc)).replace("%S", str(state))
                          .replace("%i", instance))
                assert "%" not in filled, f"{unit.name}: a specifier this test does not fill in: {line}"
                argv = shlex.split(filled)
                if Path(argv[0]).name == "rollstream":
                    lines.append(CommandLine(f"{unit.name} instance {instance!r}", argv))
    return lines


def container_command_line() -> CommandLine:
    image = containerfile()
    return CommandLine("Containerfile ENTRYPOINT + CMD", image["ENTRYPOINT"] + image["CMD"])


def toml_files(root: Path, keys: Path) -> list[tuple[str, Path]]:
    """Every TOML file in deploy/ and every *.toml entry of a ConfigMap, written under `root` with
    the keys' mount path made local."""
    files, paths = [], operator_paths(root, keys)
    for path in sorted(DEPLOY.rglob("*.toml")):
        local = root / path.relative_to(DEPLOY)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(localized(path.read_text(), paths))
        files.append((str(path.relative_to(ROOT)), local))
    for path, doc in kubernetes_documents():
        if doc["kind"] == "ConfigMap":
            for key, text in doc["data"].items():
                if key.endswith(".toml"):
                    local = root / doc["metadata"]["name"] / key
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_text(localized(text, paths))
                    files.append((f"{path.name}: ConfigMap {doc['metadata']['name']} key {key}", local))
    return files


def daemon_of(where: str, path: Path) -> str:
    """A configuration file is one `[broker]` or `[producer]` table."""
    tables = list(tomllib.loads(path.read_text()))
    assert len(tables) == 1 and tables[0] in DAEMONS, f"{where}: expected one table of {DAEMONS}, got {tables}"
    return tables[0]


def check_config(line: CommandLine) -> None:
    assert Path(line.argv[0]).name == "rollstream" and line.argv[1] in DAEMONS, \
        f"{line.where}: expected `rollstream {'|'.join(DAEMONS)} ...` (the commands with --check-config), got {line.argv}"
    result = run([str(ROLLSTREAM), *line.argv[1:], "--check-config"], line.env)
    assert result.returncode == 0 and "configuration ok" in result.stdout, (
        f"{line.where}: `{shlex.join(line.argv)}` (environment {line.env}) must pass --check-config, "
        f"got exit {result.returncode}:\n{result.stderr}")


# -- every command line and configuration file passes --check-config --------------------------------


@pytest.mark.slow
def test_every_command_line_in_deploy_passes_check_config(tmp_path, keys):
    lines = [*systemd_command_lines(tmp_path / "state", etc_rollstream(tmp_path, keys)),
             *kubernetes_command_lines(tmp_path / "mounts", keys), container_command_line()]
    found = {line.where.split(":")[0].split(" ")[0] for line in lines}
    assert {"rollstream-broker.service", "rollstream-producer@.service", "broker-daemonset.yaml",
            "producer-sidecar.yaml", "Containerfile"} <= found, f"command lines found in: {sorted(found)}"
    for line in lines:
        check_config(line)


@pytest.mark.slow
def test_every_toml_file_in_deploy_passes_check_config(tmp_path, keys):
    files = toml_files(tmp_path, keys)
    assert len(files) >= 5, files
    for where, path in files:
        check_config(CommandLine(where, ["rollstream", daemon_of(where, path), "--config", str(path)]))


def test_every_deployed_daemon_runs_curve(tmp_path, keys):
    """Brokers require CURVE on every socket, with a directory per socket; producers use it."""
    required = {"broker": {"curve_secret_key", "curve_producers", "curve_consumers", "curve_admin"},
                "producer": {"curve_secret_key", "curve_server_key"}}
    for where, path in toml_files(tmp_path, keys):
        daemon = daemon_of(where, path)
        table = tomllib.loads(path.read_text())[daemon]
        assert required[daemon] <= set(table), f"{where}: expected CURVE keys {sorted(required[daemon])}, got {sorted(table)}"


def test_a_bad_key_path_in_a_configuration_is_caught(tmp_path, keys):
    """The check reads the keys: a producer pointing at the broker's public key as its own is refused."""
    where, path = next((w, p) for w, p in toml_files(tmp_path, keys) if w.endswith("producer/synthetic.toml"))
    path.write_text(path.read_text().replace("producer.key_secret", "broker.key"))
    with pytest.raises(AssertionError, match="curve_secret_key must be this client's own .key_secret file"):
        check_config(CommandLine(where, ["rollstream", "producer", "--config", str(path)]))


def test_a_bad_flag_in_a_manifest_is_caught(tmp_path, keys):
    """The check can fail: the sidecar's command line with one flag misspelt."""
    line = next(line for line in kubernetes_command_lines(tmp_path, keys) if "producer-sidecar" in line.where)
    line.argv.append("--spool-byte=1GiB")
    with pytest.raises(AssertionError, match=r"--spool-byte must be a flag of this command \(did you mean --spool-bytes"):
        check_config(line)


# -- --check-config itself ---------------------------------------------------------------------------


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env, prog_name="rollstream")


def test_check_config_reports_every_problem_with_the_key_the_expected_and_the_actual_value(tmp_path):
    config = tmp_path / "broker.toml"
    config.write_text('[broker]\nsync = "fast"\nwindow = 1.5\nmax_memory = "8GiB"\nmax_disk_bytes = "lots"\n'
                      'metrics_port = "9464"\n')
    result = invoke("broker", "--config", str(config), "--read-max-frames", "many", "--windw", "5", "--data-dir",
                    str(tmp_path / "data"), "--check-config",
                    env={"ROLLSTREAM_BROKER_LEASE_TIMEOUT": "soon", "ROLLSTREAM_BROKER_SYNCC": "full"})
    assert result.exit_code == 2, result.output
    expected = [
        f"sync must be one of 'normal', 'full', got 'fast' ({config}) [rule: choice]",
        # a bad type: not truncated to 1
        f"window must be a whole number of frames >= 1, got 1.5 (float) ({config}) [rule: type]",
        f"max_memory must be a key of [broker] (did you mean max_memory_bytes?), got an unknown key ({config}) "
        "[rule: known key]",
        f"max_disk_bytes must be a byte size >= 1 (such as 1048576, 512MiB or 2G), got 'lots' ({config}) [rule: type]",
        "read_max_frames must be a whole number of frames >= 1, got 'many' (flag --read-max-frames) [rule: type]",
        "lease_timeout must be a number of seconds > 0, got 'soon' (environment ROLLSTREAM_BROKER_LEASE_TIMEOUT) "
        "[rule: type]",
        "--windw must be a flag of this command (did you mean --window",
        "ROLLSTREAM_BROKER_SYNCC must be a variable of this command (did you mean ROLLSTREAM_BROKER_SYNC",
    ]
    for problem in expected:
        assert problem in result.output, f"expected {problem!r} in:\n{result.output}"
    assert "8 configuration error(s)" in result.output  # metrics_port = "9464": a string converts like a flag
    assert not (tmp_path / "data").exists()  # nothing started


def test_check_config_runs_the_producers_rules_and_passes_a_clean_configuration(tmp_path):
    config = tmp_path / "producer.toml"
    config.write_text("[producer]\nturns = 0\ngroup_size = 0\ncrc = 1\n")
    result = invoke("producer", "--config", str(config), "--abort-rate", "2", "--check-config")
    assert result.exit_code == 2, result.output
    for problem in (f"turns must be a whole number of turns >= 1, got 0 ({config}) [rule: range]",
                    f"group_size must be a whole number of samples >= 1, got 0 ({config}) [rule: range]",
                    "abort_rate must be a share in [0, 1], got 2.0 (flag --abort-rate) [rule: range]",
                    f"crc must be true or false, got 1 (int) ({config}) [rule: type]"):
        assert problem in result.output, f"expected {problem!r} in:\n{result.output}"
    config.write_text("[producer]\nturns = 2\n")
    clean = invoke("producer", "--config", str(config), "--check-config", env={"ROLLSTREAM_PRODUCER_WINDOW": "8"})
    assert clean.exit_code == 0 and f"rollstream producer: configuration ok ({config})" in clean.output, clean.output


def test_a_real_start_refuses_the_same_problems_before_starting(tmp_path):
    result = run([str(ROLLSTREAM), "broker", "--data-dir", str(tmp_path / "data"), "--window", "x",
                  "--sync", "fast"])
    assert result.returncode == 2, result.stderr
    assert "window must be a whole number of frames >= 1, got 'x' (flag --window) [rule: type]" in result.stderr
    assert "sync must be one of 'normal', 'full', got 'fast' (flag --sync) [rule: choice]" in result.stderr
    assert not (tmp_path / "data").exists()


# -- the manifests, by the real tools ----------------------------------------------------------------


def test_kubernetes_manifests_validate_against_the_bundled_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra)")
    documents = kubernetes_documents()
    kinds = sorted(doc["kind"] for _, doc in documents)
    assert {"ConfigMap", "DaemonSet", "Deployment", "Pod", "Secret"} <= set(kinds), kinds
    version = kubernetes_validate.latest_version()
    for path, doc in documents:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']} must validate against Kubernetes "
                        f"{version} (strict), got: {exc.caught.message} at {'.'.join(map(str, exc.caught.path))}")


def test_keys_are_mounted_as_pyzmq_certificate_files_under_etc_rollstream_keys():
    secret = next(doc for _, doc in kubernetes_documents() if doc["kind"] == "Secret")
    names = set(secret["stringData"])
    assert all(re.fullmatch(r"\w+\.key(_secret)?", name) for name in names), names
    assert {"broker.key", "broker.key_secret", "producer.key", "producer.key_secret"} <= names
    for path, doc in kubernetes_documents():
        for spec in pod_specs(doc):
            volumes = {v["name"]: v for v in spec.get("volumes", []) if "secret" in v}
            for container in spec["containers"]:
                for mount in container.get("volumeMounts", []):
                    if mount["name"] in volumes:
                        assert mount["mountPath"] == "/etc/rollstream/keys", f"{path.name}: {mount}"
                        assert volumes[mount["name"]]["secret"]["secretName"] == secret["metadata"]["name"]


def test_container_runs_as_a_numeric_non_root_user_and_copies_what_exists():
    image = containerfile()
    user = image["USER"][-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"the last USER must be a numeric non-root uid, got {user!r}"
    assert image["ENTRYPOINT"] == ["rollstream"], image["ENTRYPOINT"]
    copied = {source for copy in image["COPY"] for source in copy.split()[:-1]}
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    missing = set(package_dirs.values()) - copied
    assert not missing, f"the image must copy every package folder of pyproject.toml, missing {sorted(missing)}"


def test_systemd_units_verify(tmp_path):
    """`systemd-analyze verify` works on unit files without systemd as PID 1. It checks that
    ExecStart's program exists and is executable, so the copy runs this venv's `rollstream`;
    a template is verified as each of its instances. Warnings (an unknown key, a bad value) exit
    0, so any output fails the test."""
    analyze = tool("systemd-analyze", "systemd")
    for unit in unit_files():
        for instance in unit_instances(unit):
            name = unit.name.replace("@.", f"@{instance}.")
            text = re.sub(r"^(Exec\w*=)\S*/rollstream\b", rf"\g<1>{ROLLSTREAM}", unit.read_text(), flags=re.M)
            (tmp_path / name).write_text(text)
            result = run([analyze, "verify", "--man=no", str(tmp_path / name)])
            assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
                f"{unit.name} ({name}) must verify cleanly, got exit {result.returncode}:\n{result.stdout}{result.stderr}")


def test_prometheus_config_rules_and_targets_pass_promtool():
    promtool = tool("promtool", "prometheus")
    prometheus = DEPLOY / "prometheus"
    for argv in (["check", "rules", "alerts.yml"], ["check", "config", "scrape.yml"]):
        result = subprocess.run([promtool, *argv], capture_output=True, text=True, timeout=60, cwd=prometheus)
        output = result.stdout + result.stderr
        assert result.returncode == 0 and "WARNING" not in output, f"promtool {' '.join(argv)}: {output}"


def exported_metrics() -> set[str]:
    """The sample names the broker and producer export, as Prometheus sees them."""
    from rollstream.broker.metrics import BrokerMetrics
    from rollstream.producer.metrics import ProducerMetrics

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {family.name + suffix for metrics in (BrokerMetrics(), ProducerMetrics())
            for family in metrics.registry.collect() for suffix in suffixes[family.type]}


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
            for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "prometheus" / "grafana-dashboard.json").read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), f"panel ids must be unique, got {ids}"
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_alerts_and_dashboard_name_only_exported_metrics():
    exported = exported_metrics()
    rules = alert_rules()
    assert REQUIRED_ALERTS <= {rule["alert"] for rule in rules}, {rule["alert"] for rule in rules}
    for where, expr in [(rule["alert"], rule["expr"]) for rule in rules] + [("dashboard", e) for e in dashboard_exprs()]:
        for name in re.findall(r"\brollstream_\w+", expr):
            assert name in exported, (
                f"{where}: {name} must be an exported metric (one of {sorted(exported)}), got it in {expr!r}")


def test_dashboard_queries_parse_as_promql(tmp_path):
    promtool = tool("promtool", "prometheus")
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": expr}
                                                        for i, expr in enumerate(dashboard_exprs())]}]}
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    result = run([promtool, "check", "rules", str(tmp_path / "dashboard.yml")])
    assert result.returncode == 0, f"every dashboard query must parse as PromQL, got:\n{result.stdout}{result.stderr}"


def test_budget_alerts_match_the_shipped_budgets(tmp_path, keys):
    """The budgets are not exported, so the near-budget thresholds are 0.9 x the shipped ones."""
    thresholds = {rule["expr"].split("where=\"")[1].split("\"")[0]: int(rule["expr"].rsplit("*", 1)[1])
                  for rule in alert_rules() if "rollstream_broker_bytes" in rule["expr"]}
    assert set(thresholds) == {"disk", "memory"}, thresholds
    for where, path in toml_files(tmp_path, keys):
        table = tomllib.loads(path.read_text())
        if "broker" in table:
            budgets = {"disk": table["broker"]["max_disk_bytes"], "memory": table["broker"]["max_memory_bytes"]}
            for key, budget in budgets.items():
                assert parse_bytes(budget) == thresholds[key], (
                    f"{where}: max_{key}_bytes must be the alert's budget {thresholds[key]}, got {budget!r}")
