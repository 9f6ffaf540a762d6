"""Settings for the daemons: one dataclass per daemon is the single list of
keys, and the command line, a TOML file and the environment all fill it.

Every field is declared with `setting(...)` (or one of its short forms:
`seconds`, `count`, `size`, ...), which states once what it takes: its kind
and unit, its range, and its help line. From that declaration come the
flag's type and `--help` text, the check of a flag, a TOML key and an
environment variable alike, and `settings_problems` for settings built in
Python. What only the machine can tell (a data directory that is a file, a
key file that is missing, an ipc endpoint's folder) is checked there too,
so `--check-config` finds it; a port another process holds shows only when
the daemon binds it (`bind_problem`).

Precedence, highest first: command-line flags, environment variables
(`ROLLSTREAM_<DAEMON>_<KEY>`), the `--config` TOML file, built-in defaults.
A renamed setting declares its `older` name, which its flag, TOML key and
environment variable still take (the newer name wins where both are given).

Loading never stops at the first mistake: every unknown flag, key or
environment variable and every value of the wrong type or out of range is
collected as a `Problem` (the key, where it came from, the rule, what was
expected, what was given), and `settings_from` raises them all in one
`ConfigError` (exit status 2). `--check-config` does exactly what a real
start does up to there, then exits 0 without starting anything.
"""
from __future__ import annotations

import dataclasses
import difflib
import errno
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable

import click
from click.core import ParameterSource

from .errors import InvalidInput, InvalidType

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}
SIZE_EXAMPLES = "such as 1048576, 512MiB or 2G"

# ctx.meta keys: the problems found while loading, the --config file, the dry run.
PROBLEMS = "rollstream.config.problems"
CONFIG_FILE = "rollstream.config.file"
CHECK_ONLY = "rollstream.config.check_only"

# The daemons take no arguments: unknown flags are kept (not fatal at the
# first one) and reported with every other problem by `settings_from`.
SETTINGS_CONTEXT = {"ignore_unknown_options": True, "allow_extra_args": True}

# The ZeroMQ transports a daemon's endpoints may name.
ZMQ_SCHEMES = ("tcp", "ipc", "inproc")
# The longest ipc path a Unix socket address holds (sun_path, less its final NUL).
IPC_PATH_BYTES = 107
HIGHEST_PORT = 65535


def parse_bytes(value: Any) -> int:
    """`268435456`, `256MiB`, `2G` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise InvalidInput(f"expected a byte size {SIZE_EXAMPLES}, got {value!r}")
    unit = (match.group(2) or "").lower().rstrip("b")
    size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size):
        raise InvalidInput(f"expected a byte size {SIZE_EXAMPLES}, got {value!r:.80} (too large to hold)")
    return int(size)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One configuration mistake: `key` (a setting, a flag or a variable),
    `where` it came from, what was `expected` and what was given (`actual`,
    already in words), and the `rule` broken (`type`, `range`, `scheme`...)."""

    key: str
    where: str
    expected: str
    actual: str
    rule: str

    def __str__(self) -> str:
        where = f" ({self.where})" if self.where else ""
        return f"{self.key} must be {self.expected}, got {self.actual}{where} [rule: {self.rule}]"


class ConfigError(InvalidInput, click.UsageError):
    """Every problem of a configuration at once (exit status 2). A
    `click.UsageError`, so a command reports it as a usage mistake, and an
    `InvalidInput` for settings built in Python."""

    code = "invalid_input"

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        message = f"{len(problems)} configuration error(s):\n" + "\n".join(f"  {p}" for p in problems)
        InvalidInput.__init__(self, message)
        click.UsageError.__init__(self, message)  # ValueError, between the two in the MRO, does not pass it on


# -- the declaration of one setting -----------------------------------------------------------------

SETTING = "rollstream.setting"  # the dataclass field's metadata key

# Kinds of setting, and the TOML types that may stand for each (a TOML
# string always may: it is converted like a flag's text).
INTEGER, NUMBER, BYTES, PORT, FLAG, CHOICE, TEXT, ENDPOINT, URL = (
    "integer", "number", "bytes", "port", "flag", "choice", "text", "endpoint", "url")
DIRECTORY, FOLDER, FILE, EXISTING, PATH, OUTPUT_FILE = (
    "directory", "existing directory", "file", "existing path", "path", "output file")
NUMERIC = (INTEGER, NUMBER, BYTES, PORT)
PATH_KINDS = (DIRECTORY, FOLDER, FILE, EXISTING, PATH, OUTPUT_FILE)
TOML_TYPES = {INTEGER: (int,), NUMBER: (int, float), BYTES: (int,), PORT: (int,), FLAG: (bool,)}
METAVARS = {INTEGER: "INTEGER", NUMBER: "NUMBER", BYTES: "SIZE", PORT: "PORT", FLAG: "BOOLEAN", TEXT: "TEXT",
            ENDPOINT: "ENDPOINT", URL: "URL", DIRECTORY: "DIRECTORY", FOLDER: "DIRECTORY", FILE: "FILE", EXISTING: "PATH",
            PATH: "PATH",
            OUTPUT_FILE: "FILE"}


class Refused(click.BadParameter):
    """A value a setting does not take: the rule it breaks, what was
    expected, and the value in words."""

    def __init__(self, rule: str, expected: str, actual: str):
        super().__init__(f"{expected}, got {actual}")
        self.rule, self.expected, self.actual = rule, expected, actual


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclasses.dataclass(frozen=True)
class Setting:
    """What one setting takes, declared once beside its default: its kind
    (one of the constants above), its unit, its range (`low`, `high`;
    `above`: strictly more than `low`), its choices (or a function naming
    them, for a registry filled later), the schemes an endpoint or URL may
    use, the pattern a text must match, and its help line."""

    kind: str
    help: str
    unit: str = ""
    low: float | None = None
    high: float | None = None
    above: bool = False
    choices: tuple[str, ...] | Callable[[], Iterable[str]] = ()
    schemes: tuple[str, ...] = ()
    pattern: str | None = None
    binds: bool = False  # an endpoint this daemon binds (rather than connects to)
    unbounded: bool = False  # a number whose range is every finite value, declared so rather than forgotten
    many: bool = False  # the flag repeats, and the setting is the tuple of its values
    switch: str | None = None  # a flag's off name: `--NAME/--SWITCH` rather than `--NAME BOOLEAN`
    older: str | None = None  # the key this setting had before it was renamed, still read everywhere

    # -- words ---------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.choices() if callable(self.choices) else self.choices)

    def range_text(self) -> str:
        """The range in words: `> 0`, `>= 1`, `in [0, 1]`, `0-65535`; empty for a kind without one."""
        low, high = self.low, self.high
        if self.kind == PORT:
            return f"{_number(low or 0)}-{_number(HIGHEST_PORT if high is None else high)}"
        if self.unbounded:
            return "finite"
        if low is not None and high is not None:
            return f"in {'(' if self.above else '['}{_number(low)}, {_number(high)}]"
        if low is not None:
            return f"{'>' if self.above else '>='} {_number(low)}"
        return "" if high is None else f"<= {_number(high)}"

    def expected(self) -> str:
        """What the setting takes, in words (its rule's expected value)."""
        span = self.range_text()
        if self.kind == INTEGER:
            noun = f"a whole number of {self.unit}" if self.unit else "an integer"
        elif self.kind == NUMBER:
            noun = "a share" if self.unit == "share" else f"a number of {self.unit}" if self.unit else "a number"
        elif self.kind == BYTES:
            return f"a byte size {span} ({SIZE_EXAMPLES})"
        elif self.kind == PORT:
            noun = "a TCP port"
        elif self.kind == FLAG:
            return "true or false"
        elif self.kind == CHOICE:
            return "one of " + ", ".join(repr(name) for name in self.names())
        elif self.kind == ENDPOINT:
            return "an endpoint " + " or ".join(ENDPOINT_FORMS[scheme] for scheme in self.schemes)
        elif self.kind == URL:
            return "a URL " + " or ".join(f"{scheme}://HOST[:PORT]" for scheme in self.schemes)
        elif self.kind == DIRECTORY:
            return "a directory this user can write, or a path where one can be created"
        elif self.kind == FOLDER:
            return "an existing directory"
        elif self.kind == FILE:
            return "an existing file"
        elif self.kind == EXISTING:
            return "an existing file or directory"
        elif self.kind == OUTPUT_FILE:
            return "a file path in an existing directory this user can write"
        elif self.kind == PATH:
            return "a path that is not a directory"
        else:
            return f"a string matching {self.pattern}" if self.pattern else "a string"
        return f"{noun} {span}" if span else noun

    def help_text(self) -> str:
        """The help line with the unit and range `--help` shows."""
        words = [self.help.rstrip()]
        if self.kind == BYTES:
            words.append(f"[unit: bytes, or a suffix k M G T Ki Mi Gi Ti; range: {self.range_text()}]")
        elif self.kind in NUMERIC:
            words.append(f"[unit: {self.unit or self.kind}; range: {self.range_text()}]")
        elif self.kind == ENDPOINT:
            words.append(f"[{' or '.join(ENDPOINT_FORMS[scheme] for scheme in self.schemes)}]")
        return " ".join(words)

    def metavar(self) -> str:
        if self.kind == CHOICE:
            return "[" + "|".join(self.names()) + "]"
        return "SECONDS" if self.unit == "seconds" else METAVARS.get(self.kind, self.kind.upper())

    # -- checks --------------------------------------------------------------------------------------
    def accept(self, value: Any) -> Any:
        """`value` (text from a flag, a variable or a TOML string, or a
        Python value) as the setting's type, or `Refused` naming the rule."""
        value = self._typed(value)
        broken = self.breaks(value)
        if broken is not None:
            rule, actual = broken
            raise Refused(rule, self.expected(), actual)
        return value

    def _typed(self, value: Any) -> Any:
        text = isinstance(value, str)
        shown = repr(value) if text else f"{value!r} ({type(value).__name__})"
        try:
            if self.kind in (INTEGER, PORT):
                if text:
                    return int(value.strip())
                if type(value) is int:
                    return value
            elif self.kind == NUMBER:
                if text:
                    return float(value)
                if type(value) in (int, float):
                    return float(value)
            elif self.kind == BYTES:
                if text or type(value) is int:
                    return parse_bytes(value)
            elif self.kind == FLAG:
                if text or type(value) is bool:
                    return click.BOOL.convert(value, None, None)
            elif text:
                return value
        except (ValueError, click.BadParameter):
            pass
        raise Refused("type", self.expected(), shown)

    def breaks(self, value: Any) -> tuple[str, str] | None:
        """The rule a typed value breaks and the value in words, or None."""
        if self.kind in NUMERIC:
            if isinstance(value, float) and not math.isfinite(value):
                return "range", repr(value)
            too_low = self.low is not None and (value <= self.low if self.above else value < self.low)
            if too_low or (self.high is not None and value > self.high):
                return "range", repr(value)
            return None
        if self.kind == CHOICE:
            return None if value in self.names() else ("choice", repr(value))
        if self.kind == TEXT:
            return None if self.pattern is None or re.fullmatch(self.pattern, value) else ("pattern", repr(value))
        if self.kind == ENDPOINT:
            return endpoint_problem(value, self.schemes, self.binds)
        if self.kind == URL:
            scheme, sep, rest = value.partition("://")
            return None if sep and scheme in self.schemes and rest else ("scheme", repr(value))
        if self.kind in PATH_KINDS:
            try:
                return self._path_breaks(value)
            except OSError as error:
                return "usable path", f"{value!r}, which the system refuses: {error.strerror}"
        return None

    def _path_breaks(self, value: str) -> tuple[str, str] | None:
        """The rule a path value breaks, or None; a path the system cannot
        even look up (a name too long) raises OSError."""
        if self.kind == DIRECTORY:
            return _directory_problem(Path(value))
        if self.kind == FOLDER:
            return None if Path(value).is_dir() else ("existing directory", f"{value!r}, {_what_is(Path(value))}")
        if self.kind == FILE:
            return None if Path(value).is_file() else ("existing file", f"{value!r}, {_what_is(Path(value))}")
        if self.kind == EXISTING:
            return None if Path(value).exists() else ("existing path", f"{value!r}, which does not exist")
        if self.kind == OUTPUT_FILE:
            path = Path(value)
            if path.is_dir():
                return "writable file", f"{value!r}, a directory"
            folder = path.parent
            if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
                return "writable file", f"{value!r}, whose folder {str(folder)!r} is {_what_is(folder, 'not writable')}"
            return None
        assert self.kind == PATH, self.kind  # the last of PATH_KINDS
        return ("not a directory", f"{value!r}, a directory") if Path(value).is_dir() else None


ENDPOINT_FORMS = {"tcp": "tcp://HOST:PORT", "ipc": "ipc://PATH", "inproc": "inproc://NAME"}


def _what_is(path: Path, otherwise: str = "") -> str:
    """What stands at `path`, in words, for a refusal."""
    if not path.exists():
        return "which does not exist"
    if path.is_dir():
        return otherwise or "a directory"
    return otherwise or "not a regular file"


def _directory_problem(path: Path) -> tuple[str, str] | None:
    """Why a daemon could not create or write the directory `path`."""
    shown = str(path)
    if path.exists() and not path.is_dir():
        return "writable directory", f"{shown!r}, which is a file"
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return "writable directory", f"{shown!r}, below {str(existing)!r}, which is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return "writable directory", f"{shown!r}, where {str(existing)!r} is not writable by this user"
    return None


def endpoint_problem(endpoint: str, schemes: Iterable[str], binds: bool) -> tuple[str, str] | None:
    """The rule a ZeroMQ endpoint breaks (its scheme or its form), with the
    value in words, or None. A bound ipc endpoint's folder must exist."""
    scheme, sep, address = endpoint.partition("://")
    if not sep or scheme not in schemes:
        return "scheme", repr(endpoint)
    if not address:
        return "endpoint form", f"{endpoint!r}, with nothing after {scheme}://"
    if scheme == "tcp":
        host, colon, port = address.rpartition(":")
        if not colon or not host:
            return "endpoint form", f"{endpoint!r}, without HOST:PORT"
        if binds and port == "*":
            return None
        if not port.isdigit() or int(port) > HIGHEST_PORT or (not binds and int(port) == 0):
            low = 0 if binds else 1
            return "endpoint form", f"{endpoint!r}, whose port is not in {low}-{HIGHEST_PORT}"
        if not binds and host == "*":
            return "endpoint form", f"{endpoint!r}: '*' names every interface to bind, not a host to connect to"
    if scheme == "ipc" and not address.startswith("@"):
        if len(os.fsencode(address)) > IPC_PATH_BYTES:
            return "endpoint form", f"{endpoint!r}, whose path is longer than {IPC_PATH_BYTES} bytes"
        folder = Path(address).parent
        if binds and not folder.is_dir():
            return "endpoint form", f"{endpoint!r}, whose folder {str(folder)!r} {_what_is(folder, 'is not a directory')}"
    return None


def setting(default: Any, kind: str, help: str, **declared: Any) -> Any:
    """A settings dataclass field: `default`, and what the setting takes."""
    return dataclasses.field(default=default, metadata={SETTING: Setting(kind, help, **declared)})


def seconds(default: float | None, help: str, *, low: float = 0.0, above: bool = True, high: float | None = None) -> Any:
    return setting(default, NUMBER, help, unit="seconds", low=low, above=above, high=high)


def count(default: int | None, help: str, unit: str, *, low: int = 1, high: int | None = None,
          older: str | None = None) -> Any:
    return setting(default, INTEGER, help, unit=unit, low=low, high=high, older=older)


def size(default: int | None, help: str, *, low: int = 1, older: str | None = None) -> Any:
    return setting(default, BYTES, help, low=low, older=older)


def number(default: float, help: str, unit: str = "", **bounds: Any) -> Any:
    return setting(default, NUMBER, help, unit=unit, **bounds)


def share(default: float, help: str, *, above: bool = False) -> Any:
    return setting(default, NUMBER, help, unit="share", low=0.0, high=1.0, above=above)


def port(default: int, help: str) -> Any:
    return setting(default, PORT, help, low=0, high=HIGHEST_PORT)


def flag(default: bool, help: str) -> Any:
    return setting(default, FLAG, help)


def choice(default: str, help: str, choices: tuple[str, ...] | Callable[[], Iterable[str]]) -> Any:
    return setting(default, CHOICE, help, choices=choices)


def text(default: str | None, help: str, *, pattern: str | None = None) -> Any:
    return setting(default, TEXT, help, pattern=pattern)


def endpoint(default: str, help: str, *, binds: bool) -> Any:
    return setting(default, ENDPOINT, help, schemes=ZMQ_SCHEMES, binds=binds)


LOG_LEVELS = ("debug", "info", "warning", "error")
LARGEST_VOCAB = 2**31 - 1  # token and support ids travel as int32


def vocabulary(default: int | None, help: str, *, low: int = 1) -> Any:
    return count(default, help, "token ids", low=low, high=LARGEST_VOCAB)


def log_level(default: str = "info") -> Any:
    return choice(default, "How much the log says.", LOG_LEVELS)


def setting_of(field: dataclasses.Field) -> Setting:
    """The declaration of a settings field; `InvalidType` for a field declared
    without `setting(...)`, so none can skip its range."""
    declared = field.metadata.get(SETTING)
    if not isinstance(declared, Setting):
        raise InvalidType(f"settings field {field.name!r} must be declared with rollstream.common.config.setting(...) "
                        f"(its kind, unit, range and help), got a plain field")
    return declared


def settings_problems(settings: Any) -> list[Problem]:
    """Every field of a settings object (built in Python, say) that its
    declaration refuses, as problems without `where`."""
    problems = []
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if value is None and field.default is None:
            continue
        declared = setting_of(field)
        try:
            for item in (value if declared.many else (value,)):
                declared.accept(item)
        except Refused as refusal:
            problems.append(Problem(field.name, "", refusal.expected, refusal.actual, refusal.rule))
    return problems


def check_settings(settings: Any, rules: Callable[[Any], list[Problem]] | None = None) -> None:
    """`ConfigError` with every problem of settings built in Python: the
    declarations' and the daemon's own `rules`."""
    problems = settings_problems(settings)
    bad = {problem.key for problem in problems}
    problems += [problem for problem in (rules(settings) if rules else []) if problem.key not in bad]
    if problems:
        raise ConfigError(problems)


def bind_problem(key: str, address: str, error: Exception) -> Problem:
    """A daemon's failure to bind `address` (the setting `key`) as a
    problem: a port in use, an interface this host lacks, a privileged port."""
    code = getattr(error, "errno", None)
    reason = os.strerror(code) if isinstance(code, int) and code > 0 else str(error)
    if code == errno.EADDRINUSE:
        return Problem(key, "", "a port no other process holds", f"{address!r}: {reason}", "free port")
    return Problem(key, "", "an address this host can bind", f"{address!r}: {reason}", "bindable address")


def unknown_expected(name: str, known: Iterable[str], what: str) -> str:
    """`what`, with the closest known names when there are any."""
    close = difflib.get_close_matches(name, list(known), n=3)
    return f"{what} (did you mean {' or '.join(close)}?)" if close else f"{what} (see --help)"


def origin(ctx: click.Context, param: click.Parameter) -> str:
    """Where `param`'s value came from, for a problem's `where`."""
    source = ctx.get_parameter_source(param.name)
    if source is ParameterSource.COMMANDLINE:
        return f"flag {param.opts[0]}"
    if source is ParameterSource.ENVIRONMENT:
        return f"environment {param.envvar or f'{ctx.auto_envvar_prefix}_{param.name.upper()}'}"
    if source is ParameterSource.DEFAULT_MAP:
        return str(ctx.meta.get(CONFIG_FILE, "default map"))
    return "default"


def found(ctx: click.Context) -> list[Problem]:
    return ctx.meta.setdefault(PROBLEMS, [])


class SettingType(click.ParamType):
    """A flag's, a variable's or a TOML value's conversion and check, from
    the setting's declaration."""

    def __init__(self, declared: Setting):
        self.setting = declared
        self.name = declared.kind

    def get_metavar(self, param: click.Parameter, ctx: click.Context) -> str:
        return self.setting.metavar()

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return self.setting.accept(value)


class SettingOption(click.Option):
    """An option that records a bad value as a `Problem` and goes on, so
    every problem is reported together; a TOML value must also be of a TOML
    type that fits (`window = 1.5` is refused, not truncated to 1)."""

    def __init__(self, *args: Any, setting: Setting, **options: Any):
        super().__init__(*args, **options)
        self.setting = setting

    def process_value(self, ctx: click.Context, value: Any) -> Any:
        declared = self.setting
        where = origin(ctx, self)
        from_file = ctx.get_parameter_source(self.name) is ParameterSource.DEFAULT_MAP
        if from_file and not isinstance(value, str) and type(value) not in TOML_TYPES.get(declared.kind, ()):
            found(ctx).append(Problem(self.name, where, declared.expected(), f"{value!r} ({type(value).__name__})",
                                      "type"))
            return None
        try:
            return super().process_value(ctx, value)
        except Refused as refusal:
            found(ctx).append(Problem(self.name, where, refusal.expected, refusal.actual, refusal.rule))
        except click.BadParameter:
            found(ctx).append(Problem(self.name, where, declared.expected(), repr(value), "type"))
        return None

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        """The environment variable of the setting's name, else of its older one."""
        value = super().resolve_envvar_value(ctx)
        if value is None and self.setting.older and ctx.auto_envvar_prefix:
            value = os.environ.get(older_variable(ctx, self.setting.older)) or None
        return value


def older_variable(ctx: click.Context, older: str) -> str:
    return f"{ctx.auto_envvar_prefix}_{older.upper()}"


def setting_option(name: str, declared: Setting, default: Any, **options: Any):
    """The click option of one declared setting."""
    flag_name = "--" + name.replace("_", "-")
    older = ("--" + declared.older.replace("_", "-"),) if declared.older else ()
    kind: click.ParamType = SettingType(declared)
    if declared.switch:  # a pair of flags, which click takes only as a boolean
        flag_name, kind = f"{flag_name}/--{declared.switch.replace('_', '-')}", click.BOOL
    if declared.kind == BYTES and isinstance(default, int):
        default = human_bytes(default)  # converted back when the option is read; shown as written by `--help`
    return click.option(flag_name, *older, name, cls=SettingOption, setting=declared, type=kind, default=default,
                        multiple=declared.many, help=declared.help_text(), **{"show_default": True, **options})


def human_bytes(value: int) -> str:
    """`2147483648` -> `2GiB`: a size as `--help` shows it."""
    for suffix, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= factor and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)


def config_option(settings_cls, section: str):
    """`--config FILE`, which loads TOML defaults for the command, and
    `--check-config`, the dry run (see the module's docstring)."""

    def load(ctx: click.Context, param, value):
        if value is not None:
            ctx.meta[CONFIG_FILE] = value
            names = {f.name for f in dataclasses.fields(settings_cls)}
            values, problems = read_toml(value, names, section, older_names(settings_cls))
            found(ctx).extend(problems)
            ctx.default_map = {**(ctx.default_map or {}), **values}
        return value

    def check_only(ctx: click.Context, param, value):
        ctx.meta[CHECK_ONLY] = value

    def decorate(fn):
        fn = click.option(
            "--check-config", is_flag=True, is_eager=True, expose_value=False, allow_from_autoenv=False,
            callback=check_only,
            help="Load the configuration (flags, environment, --config) as a start would, report every error "
                 "and exit (0: clean, 2: errors) without starting anything.",
        )(fn)
        declared = Setting(FILE, f"TOML file with the same keys as the flags (top level or a [{section}] table).")
        return setting_option("config", declared, None, is_eager=True, expose_value=False, callback=load,
                              show_default=False)(fn)

    return decorate


def older_names(settings_cls) -> dict[str, str]:
    """Each renamed setting's older key -> its key."""
    return {declared.older: field.name for field in dataclasses.fields(settings_cls)
            if (declared := setting_of(field)).older}


def read_toml(path: str | Path, allowed: set[str], section: str,
              older: dict[str, str] | None = None) -> tuple[dict[str, Any], list[Problem]]:
    """The known keys of a TOML file (a `[section]` table, or the top level
    when there is none) and a problem for each unknown one (a stray table,
    a key beside `[section]` too), so a typo never silently falls back to a
    default. A key's `older` name is read as the key, unless both are given."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        return {}, [Problem("config", str(path), "valid TOML", f"a syntax error: {exc}", "toml")]
    except UnicodeDecodeError as exc:
        return {}, [Problem("config", str(path), "valid TOML (UTF-8 text)", f"bytes that are not UTF-8: {exc}",
                                "toml")]
    except RecursionError:  # tomllib reads nested arrays and inline tables recursively
        return {}, [Problem("config", str(path), "valid TOML", "arrays or inline tables nested too deep to read",
                                "toml")]
    table = data.get(section, data)
    if type(table) is not dict:
        return {}, [Problem(section, str(path), f"a [{section}] table", f"a {type(table).__name__}: {table!r:.80}",
                                "toml")]
    values = {key.replace("-", "_"): value for key, value in table.items()}
    for old, key in (older or {}).items():
        if old in values:
            value = values.pop(old)
            values.setdefault(key, value)
    problems = [Problem(key, str(path), unknown_expected(key, allowed, f"a key of [{section}]"), "an unknown key",
                         "known key")
                for key in values if key not in allowed]
    problems += [Problem(key, str(path), f"nothing beside the [{section}] table", "a key outside it", "toml")
                 for key in data if table is not data and key != section]
    return {key: value for key, value in values.items() if key in allowed}, problems


def load_toml(path: str | Path, allowed: set[str], section: str) -> dict[str, Any]:
    """`read_toml`'s values, or a `ConfigError` with all its problems."""
    values, problems = read_toml(path, allowed, section)
    if problems:
        raise ConfigError(problems)
    return values


def unknown_inputs(ctx: click.Context) -> list[Problem]:
    """Flags no option takes (left in `ctx.args`) and `ROLLSTREAM_<COMMAND>_*`
    variables no option reads."""
    flags = [opt for param in ctx.command.params for opt in param.opts]
    problems, args = [], list(ctx.args)
    while args:
        token = args.pop(0)
        if not token.startswith("-"):
            problems.append(Problem(repr(token), "command line", "no arguments, only flags", "an argument",
                                    "no arguments"))
            continue
        flag, _, value = token.partition("=")
        if not value and args and not args[0].startswith("-"):
            value = args.pop(0)
        given = f"an unknown flag{f' with value {value!r}' if value else ''}"
        problems.append(Problem(flag, "command line", unknown_expected(flag, flags, "a flag of this command"), given,
                                "known flag"))
    if ctx.auto_envvar_prefix is None:  # invoked without the `rollstream` group: no environment is read
        return problems
    prefix = f"{ctx.auto_envvar_prefix}_"
    options = [param for param in ctx.command.params if isinstance(param, click.Option) and param.allow_from_autoenv]
    variables = {f"{prefix}{(param.name or '').upper()}" for param in options}
    variables |= {older_variable(ctx, param.setting.older) for param in options
                  if isinstance(param, SettingOption) and param.setting.older}
    problems += [Problem(name, "environment", unknown_expected(name, variables, "a variable of this command"),
                         "an unknown variable", "known variable")
                 for name in sorted(os.environ) if name.startswith(prefix) and name not in variables]
    return problems


def settings_from(settings_cls, values: dict[str, Any], rules: Callable[[Any], list[Problem]] | None = None):
    """The command's settings, or a `ConfigError` with every problem:
    those found while loading, unknown flags and variables, and what
    `rules` (the daemon's own checks, whose problems need not say `where`)
    finds in the settings built with the defaults in place of bad values.
    With `--check-config`, print that the configuration is clean and exit 0."""
    ctx = click.get_current_context()
    problems = [*found(ctx), *unknown_inputs(ctx)]
    names = {f.name for f in dataclasses.fields(settings_cls)}
    bad = {problem.key for problem in problems}
    settings = settings_cls(**{key: value for key, value in values.items() if key in names and key not in bad})
    problems += located([problem for problem in (rules(settings) if rules else []) if problem.key not in bad])
    if problems:
        raise ConfigError(problems)
    if ctx.meta.get(CHECK_ONLY):
        click.echo(f"{ctx.command_path}: configuration ok ({ctx.meta.get(CONFIG_FILE) or 'no --config file'})")
        ctx.exit(0)
    return settings


def located(problems: list[Problem]) -> list[Problem]:
    """`problems` of the current command's settings, each with where its
    value came from (a flag, the environment, the file, the default)."""
    ctx = click.get_current_context()
    params = {param.name: param for param in ctx.command.params}
    return [dataclasses.replace(problem, where=problem.where or origin(ctx, params[problem.key]))
            if problem.key in params else problem for problem in problems]


def settings_options(settings_cls):
    """One click option per settings field, from its declaration, with the
    field's default."""

    def decorate(fn):
        for field in reversed(dataclasses.fields(settings_cls)):
            fn = setting_option(field.name, setting_of(field), field.default, show_envvar=True)(fn)
        return fn

    return decorate
