"""Every setting of every daemon declares its kind, unit, range and help once
(`rollstream.common.config.setting`), and each way of giving a value (flag,
TOML key, environment variable, Python) is checked by that declaration."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import rollstream.common.config as config_module
from rollstream.app.cli import main
from rollstream.broker.cli import broker as broker_command
from rollstream.broker.service import BrokerService
from rollstream.broker.settings import BrokerSettings
from rollstream.common.config import (
    BYTES,
    CHOICE,
    DIRECTORY,
    ENDPOINT,
    EXISTING,
    FILE,
    FLAG,
    FOLDER,
    INTEGER,
    NUMBER,
    OUTPUT_FILE,
    PATH,
    PATH_KINDS,
    PORT,
    TEXT,
    URL,
    ConfigError,
    InvalidType,
    Setting,
    SettingOption,
    seconds,
    setting_of,
    settings_options,
)
from rollstream.common.errors import InvalidInput
from rollstream.consumer.cli import consume as consume_command
from rollstream.consumer.settings import ConsumeSettings
from rollstream.producer.cli import producer as producer_command
from rollstream.producer.daemon import check as check_producer
from rollstream.producer.settings import ProducerSettings

# The settings dataclass of each command, and the command's options that are not settings.
COMMANDS = {"broker": (broker_command, BrokerSettings), "producer": (producer_command, ProducerSettings),
            "consume": (consume_command, ConsumeSettings)}
NOT_SETTINGS = {"help", "config", "check_config", "log_format"}
# A value each kind refuses, whatever the field's range (a range's own bounds are tried apart).
KIND_REFUSES = {CHOICE: "no-such-choice", FLAG: "maybe", ENDPOINT: "http://x:1", URL: "ftp://x",
                INTEGER: "many", NUMBER: "soon", BYTES: "lots", PORT: "http"}

# A file name longer than any file system allows: the system refuses to look it up at all.
NAME_TOO_LONG = "n" * 300


def fields_of(settings_cls) -> list[dataclasses.Field]:
    return list(dataclasses.fields(settings_cls))


ALL_FIELDS = [(name, field) for name, (_, cls) in COMMANDS.items() for field in fields_of(cls)]


def field_id(item) -> str:
    return f"{item[0]}.{item[1].name}"


# -- the table ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("item", ALL_FIELDS, ids=field_id)
def test_every_setting_declares_its_kind_range_and_help(item):
    _, field = item
    declared = setting_of(field)
    assert declared.help.strip(), f"{field.name}: a setting must say what it does"
    if declared.kind in (INTEGER, NUMBER, BYTES, PORT):
        assert declared.low is not None or declared.high is not None or declared.unbounded, (
            f"{field.name}: a number must declare its range (low, high, or unbounded=True), got none")
    if declared.kind == CHOICE:
        assert declared.names(), f"{field.name}: a choice must name its choices"


def test_a_field_declared_without_a_setting_is_refused_when_its_options_are_made():
    @dataclasses.dataclass
    class Settings:
        window: int = seconds(1.0, "A declared one.")
        forgotten: int = 3

    with pytest.raises(InvalidType, match="settings field 'forgotten' must be declared with"):
        settings_options(Settings)(lambda **values: None)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_of_a_settings_command_is_a_declared_setting(name):
    command, settings_cls = COMMANDS[name]
    options = {param.name for param in command.params if param.name not in NOT_SETTINGS}
    assert options == {field.name for field in fields_of(settings_cls)}
    for param in command.params:
        if param.name not in NOT_SETTINGS:
            assert isinstance(param, SettingOption), f"--{param.name} must come from its settings declaration"


def test_help_shows_each_numbers_unit_and_range():
    out = CliRunner().invoke(main, ["broker", "--help"], terminal_width=1000).output
    assert "--lease-timeout SECONDS" in out and "[unit: seconds; range: > 0]" in out
    assert "--window INTEGER" in out and "[unit: frames; range: >= 1]" in out
    assert "--metrics-port PORT" in out and "[unit: port; range: 0-65535]" in out
    assert "--max-unsealed-bytes SIZE" in out and "default: 16GiB" in out
    assert "[unit: bytes, or a suffix k M G T Ki Mi Gi Ti; range: >= 0]" in out
    assert "--producer-endpoint ENDPOINT" in out and "[tcp://HOST:PORT or ipc://PATH or inproc://NAME]" in out
    producer = CliRunner().invoke(main, ["producer", "--help"], terminal_width=1000).output
    assert "--abort-rate NUMBER" in producer and "[unit: share; range: in [0, 1]]" in producer
    assert "--top-p NUMBER" in producer and "range: in (0, 1]" in producer


# -- each field refuses what its declaration refuses, from the command line ---------------------------


def refused_values(declared: Setting, tmp_path: Path) -> list[str]:
    """Values the declaration must refuse (outside its range, of another kind, a path of the wrong sort); a
    byte size below 0 is not a byte size at all (rule `type`)."""
    values = []
    if declared.kind in KIND_REFUSES and not declared.switch:  # a pair of switches takes no value to refuse
        values.append(KIND_REFUSES[declared.kind])
    if declared.kind in (INTEGER, PORT, BYTES, NUMBER) and not declared.unbounded:
        step = 1 if declared.kind != NUMBER else 0.5
        if declared.low is not None:
            values.append(str(declared.low if declared.above else declared.low - step))
        if declared.high is not None:
            values.append(str(declared.high + step))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    missing = tmp_path / "missing" / "thing"
    values += {DIRECTORY: [str(a_file), str(a_file / "below")], FOLDER: [str(missing), str(a_file)],
               FILE: [str(missing), str(tmp_path)], EXISTING: [str(missing)], PATH: [str(tmp_path)],
               OUTPUT_FILE: [str(tmp_path), str(missing)]}.get(declared.kind, [])
    if declared.kind in PATH_KINDS:
        values.append(str(tmp_path / NAME_TOO_LONG))
    if declared.kind == TEXT and declared.pattern:
        values.append("not a name!")
    return values


def rule_of(declared: Setting, value: str) -> str:
    """The rule a refused value breaks, as the problem names it."""
    if value == KIND_REFUSES.get(declared.kind) or value.startswith("-") and declared.kind == BYTES:
        return {CHOICE: "choice", ENDPOINT: "scheme", URL: "scheme"}.get(declared.kind, "type")
    if value.endswith(NAME_TOO_LONG):
        return "usable path"
    return {INTEGER: "range", NUMBER: "range", BYTES: "range", PORT: "range", TEXT: "pattern",
            DIRECTORY: "writable directory", FOLDER: "existing directory", FILE: "existing file",
            EXISTING: "existing path", PATH: "not a directory", OUTPUT_FILE: "writable file"}[declared.kind]


def shown_as(value: str) -> list[str]:
    """How a problem may show a refused value: as given, or as the number it was read as."""
    shown = [repr(value)]
    for kind in (int, float):
        try:
            shown.append(repr(kind(value)))
        except ValueError:
            pass
    return shown


def invoke(name: str, *args: str, env: dict[str, str] | None = None):
    """`rollstream NAME --check-config ARGS` (consume, which has no dry run, with a broker that is not there;
    a flag given twice takes the later value, so ARGS come last)."""
    tail = ["--check-config"] if name != "consume" else ["--endpoint", "tcp://127.0.0.1:9", "--timeout", "0.1",
                                                          "--batches", "1"]
    return CliRunner().invoke(main, [name, *tail, *args], env=env, prog_name="rollstream")


@pytest.mark.parametrize("item", ALL_FIELDS, ids=field_id)
def test_every_field_refuses_values_its_declaration_refuses_naming_setting_rule_expected_and_actual(item, tmp_path):
    name, field = item
    declared = setting_of(field)
    flag = "--" + field.name.replace("_", "-")
    values = refused_values(declared, tmp_path)
    if not values:
        pytest.skip(f"{declared.kind} takes any value of its type")
    for value in values:
        result = invoke(name, f"{flag}={value}")
        assert result.exit_code == 2, f"{flag}={value}: expected exit 2, got {result.exit_code}:\n{result.output}"
        line = next((line for line in result.output.splitlines() if line.strip().startswith(f"{field.name} must be")),
                    None)
        assert line is not None, f"{flag}={value}: no problem names {field.name}:\n{result.output}"
        assert any(f"got {shown}" in line for shown in shown_as(value)), line
        assert f"(flag {flag})" in line and line.endswith(f"[rule: {rule_of(declared, value)}]"), line
        assert "Traceback" not in result.output


# -- the values the user tried -------------------------------------------------------------


def test_check_config_refuses_each_nonsense_value_naming_its_setting_rule_expected_and_actual(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    result = invoke("broker", "--lease-timeout", "-5", "--heartbeat-interval", "0", "--vocab-size", "-3",
                    "--max-deliveries", "0", "--window", "0", "--read-max-frames", "0", "--segment-bytes", "0",
                    "--metrics-port", "99999", "--data-dir", str(a_file), "--producer-endpoint", "http://x:1",
                    "--vocab-size", "0")
    assert result.exit_code == 2, result.output
    for problem in [
        "lease_timeout must be a number of seconds > 0, got -5.0 (flag --lease-timeout) [rule: range]",
        "heartbeat_interval must be a number of seconds in (0, 2184.5], got 0.0 (flag --heartbeat-interval) "
        "[rule: range]",
        "vocab_size must be a whole number of token ids in [1, 2147483647], got 0 (flag --vocab-size) [rule: range]",
        "max_deliveries must be a whole number of deliveries >= 1, got 0 (flag --max-deliveries) [rule: range]",
        "window must be a whole number of frames >= 1, got 0 (flag --window) [rule: range]",
        "read_max_frames must be a whole number of frames >= 1, got 0 (flag --read-max-frames) [rule: range]",
        "segment_bytes must be a byte size >= 1 (such as 1048576, 512MiB or 2G), got 0 (flag --segment-bytes) "
        "[rule: range]",
        "metrics_port must be a TCP port 0-65535, got 99999 (flag --metrics-port) [rule: range]",
        f"data_dir must be a directory this user can write, or a path where one can be created, got '{a_file}', "
        "which is a file (flag --data-dir) [rule: writable directory]",
        "producer_endpoint must be an endpoint tcp://HOST:PORT or ipc://PATH or inproc://NAME, got 'http://x:1' "
        "(flag --producer-endpoint) [rule: scheme]",
    ]:
        assert problem in result.output, f"expected {problem!r} in:\n{result.output}"
    assert "10 configuration error(s)" in result.output


BAD_STARTS = [
    ["--lease-timeout", "-5"], ["--heartbeat-interval", "0"], ["--vocab-size", "0"], ["--max-deliveries", "0"],
    ["--window", "0"], ["--read-max-frames", "0"], ["--segment-bytes", "0"], ["--metrics-port", "99999"],
    ["--data-dir", "{file}"], ["--producer-endpoint", "http://x:1"], ["--consumer-endpoint", "ipc://{file}/below/c"],
    ["--curve-secret-key", "{missing}"],
]


@pytest.mark.slow
@pytest.mark.parametrize("args", BAD_STARTS, ids=lambda args: args[0])
def test_a_real_start_with_a_bad_value_exits_2_without_a_traceback(args, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    args = [arg.format(file=a_file, missing=tmp_path / "missing.key_secret") for arg in args]
    command = [sys.executable, "-m", "rollstream.app.cli", "broker", "--data-dir", str(tmp_path / "data"),
               "--producer-endpoint", f"ipc://{tmp_path}/p", "--consumer-endpoint", f"ipc://{tmp_path}/c",
               "--admin-endpoint", f"ipc://{tmp_path}/a", "--metrics-port", "0", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    setting = args[0][2:].replace("-", "_")
    assert f"  {setting} must be " in result.stderr and f"(flag {args[0]}) [rule: " in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists() or args[0] == "--data-dir"  # refused before the store was made


# -- one declaration for every way in -----------------------------------------------------------------


def test_a_size_takes_a_suffix_from_the_flag_the_file_and_the_environment(tmp_path):
    option = next(param for param in broker_command.params if param.name == "max_unsealed_bytes")
    assert option.type.convert("1GiB", option, None) == 1 << 30
    assert option.type.convert("2G", option, None) == 2 * 10**9
    config = tmp_path / "broker.toml"
    config.write_text('[broker]\nmax_unsealed_bytes = "1GiB"\n')
    data = ["--data-dir", str(tmp_path / "data")]
    for args, env in ((["--max-unsealed-bytes", "1GiB"], None), (["--config", str(config)], None),
                      ([], {"ROLLSTREAM_BROKER_MAX_UNSEALED_BYTES": "1GiB"})):
        result = invoke("broker", *data, *args, env=env)
        assert result.exit_code == 0 and "configuration ok" in result.output, (args, env, result.output)


def test_the_file_and_the_environment_are_checked_by_the_same_range(tmp_path):
    config = tmp_path / "broker.toml"
    config.write_text("[broker]\nwindow = 0\nmax_memory_bytes = \"0\"\n")
    result = invoke("broker", "--config", str(config), "--data-dir", str(tmp_path / "data"),
                    env={"ROLLSTREAM_BROKER_LEASE_TIMEOUT": "-1"})
    assert result.exit_code == 2, result.output
    for problem in (f"window must be a whole number of frames >= 1, got 0 ({config}) [rule: range]",
                    f"max_memory_bytes must be a byte size >= 1 (such as 1048576, 512MiB or 2G), got 0 ({config}) "
                    "[rule: range]",
                    "lease_timeout must be a number of seconds > 0, got -1.0 (environment "
                    "ROLLSTREAM_BROKER_LEASE_TIMEOUT) [rule: range]"):
        assert problem in result.output, f"expected {problem!r} in:\n{result.output}"


def test_settings_built_in_python_are_checked_by_the_same_declarations(tmp_path):
    with pytest.raises(ConfigError) as refused:
        BrokerService(BrokerSettings(data_dir=str(tmp_path / "data"), window=0, lease_timeout=float("nan"),
                                     producer_endpoint="http://x:1"))
    assert isinstance(refused.value, InvalidInput)
    assert [(p.key, p.rule) for p in refused.value.problems] == [
        ("producer_endpoint", "scheme"), ("lease_timeout", "range"), ("window", "range")]
    assert not (tmp_path / "data").exists()
    with pytest.raises(ConfigError, match=r"turns must be a whole number of turns >= 1, got 0 \[rule: range\]"):
        check_producer(ProducerSettings(turns=0))
    with pytest.raises(ConfigError, match=r"window must be a whole number of frames >= 1, got 1.5 \(float\) "
                                          r"\[rule: type\]"):
        check_producer(ProducerSettings(window=1.5))  # type: ignore[arg-type]


def test_an_ipc_endpoint_a_start_could_not_bind_is_refused_by_the_dry_run(tmp_path):
    result = invoke("broker", "--data-dir", str(tmp_path / "data"), "--admin-endpoint", f"ipc://{tmp_path}/no/a",
                    "--consumer-endpoint", "ipc://" + "x" * 120, "--producer-endpoint", "tcp://127.0.0.1")
    assert result.exit_code == 2, result.output
    assert f"admin_endpoint must be an endpoint tcp://HOST:PORT or ipc://PATH or inproc://NAME, got " \
           f"'ipc://{tmp_path}/no/a', whose folder '{tmp_path}/no' which does not exist" in result.output
    assert "whose path is longer than 107 bytes (flag --consumer-endpoint) [rule: endpoint form]" in result.output
    assert "got 'tcp://127.0.0.1', without HOST:PORT (flag --producer-endpoint) [rule: endpoint form]" in result.output


def test_a_client_connects_to_a_host_and_port_a_broker_binds_any(tmp_path):
    bound = invoke("broker", "--data-dir", str(tmp_path / "data"), "--producer-endpoint", "tcp://*:0")
    assert bound.exit_code == 0, bound.output
    connect = invoke("producer", "--broker-endpoint", "tcp://*:5555")
    assert connect.exit_code == 2 and "'*' names every interface to bind" in connect.output, connect.output
    port_zero = invoke("producer", "--broker-endpoint", "tcp://127.0.0.1:0")
    assert port_zero.exit_code == 2 and "whose port is not in 1-65535" in port_zero.output, port_zero.output


def test_a_choice_from_a_registry_lists_what_is_registered_when_asked():
    declared = setting_of(next(f for f in fields_of(ProducerSettings) if f.name == "source"))
    assert {"synthetic", "sglang", "vllm", "replay"} <= set(declared.names())
    with pytest.raises(click.BadParameter, match=r"one of .*'synthetic'.*, got 'nope'"):
        declared.accept("nope")


def test_a_renamed_setting_is_still_read_under_its_older_flag_key_and_variable(tmp_path, monkeypatch):
    """`read_max_frames` was `batch_max`: a flag, a TOML key or an environment
    variable of the older name sets it, and the newer name wins over it."""
    seen = []
    real = config_module.settings_from

    def settings_then_stop(*args, **kwargs):  # the settings a start would run with, and no start
        seen.append(real(*args, **kwargs))
        raise SystemExit(0)

    monkeypatch.setattr(config_module, "settings_from", settings_then_stop)
    data = ["--data-dir", str(tmp_path / "data")]
    config = tmp_path / "broker.toml"
    config.write_text("[broker]\nbatch_max = 7\nbatch_max_bytes = \"1MiB\"\n")
    both = tmp_path / "both.toml"
    both.write_text("[broker]\nbatch_max = 7\nread_max_frames = 9\n")
    runs = [(["--batch-max", "7"], None, 7), (["--config", str(config)], None, 7),
            ([], {"ROLLSTREAM_BROKER_BATCH_MAX": "7"}, 7), (["--config", str(both)], None, 9),
            (["--batch-max", "7", "--read-max-frames", "9"], None, 9),
            ([], {"ROLLSTREAM_BROKER_BATCH_MAX": "7", "ROLLSTREAM_BROKER_READ_MAX_FRAMES": "9"}, 9)]
    for args, env, expected in runs:
        seen.clear()
        result = CliRunner().invoke(main, ["broker", *data, *args], env=env, prog_name="rollstream")
        assert seen and seen[0].read_max_frames == expected, (args, env, result.output)
    result = invoke("broker", *data, "--config", str(config))
    assert result.exit_code == 0 and "configuration ok" in result.output, result.output
    result = invoke("broker", *data, env={"ROLLSTREAM_BROKER_BATCH_MAX": "0"})
    assert "read_max_frames must be a whole number of frames >= 1, got 0" in result.output, result.output
