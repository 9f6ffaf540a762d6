"""Settings for the daemons: one dataclass per daemon is the single list of
keys, and the command line, a TOML file and the environment all fill it.

Precedence, highest first: command-line flags, environment variables
(`ROLLSTREAM_<DAEMON>_<KEY>`), the `--config` TOML file, built-in defaults.

Loading never stops at the first mistake: every unknown flag, key or
environment variable and every value of the wrong type is collected as a
`Problem` (the key, where it came from, what was expected, what was given),
and `settings_from` raises them all in one `ConfigError`. `--check-config`
does exactly what a real start does up to there, then exits 0 without
starting anything.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable

import click
from click.core import ParameterSource

from .errors import InvalidInput, RollstreamError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}

# ctx.meta keys: the problems found while loading, the --config file, the dry run.
PROBLEMS = "rollstream.config.problems"
CONFIG_FILE = "rollstream.config.file"
CHECK_ONLY = "rollstream.config.check_only"

# The daemons take no arguments: unknown flags are kept (not fatal at the
# first one) and reported with every other problem by `settings_from`.
SETTINGS_CONTEXT = {"ignore_unknown_options": True, "allow_extra_args": True}


def parse_bytes(value: Any) -> int:
    """`268435456`, `256MiB`, `2G` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise InvalidInput(f"expected a byte size such as 1048576, 512MiB or 2G, got {value!r}")
    unit = (match.group(2) or "").lower().rstrip("b")
    size = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(size):
        raise InvalidInput(f"expected a byte size such as 1048576, 512MiB or 2G, got {value!r:.80} (too large to hold)")
    return int(size)


class ByteSize(click.ParamType):
    name = "bytes"

    def convert(self, value, param, ctx):
        try:
            return parse_bytes(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


BYTES = ByteSize()

# What each option type accepts, in words, and the TOML types that may stand
# for it (a TOML string always may: it is converted like a flag's text).
EXPECTED = {"integer": "an integer", "float": "a number", "boolean": "true or false", "text": "a string",
            "bytes": "a byte size such as 1048576, 512MiB or 2G", "file": "an existing file"}
TOML_TYPES = {"integer": (int,), "float": (int, float), "boolean": (bool,), "bytes": (int,)}


def toml_types(param_type: click.ParamType) -> tuple[type, ...]:
    """The TOML types that may stand for an option of `param_type` (a
    range of numbers takes what its kind of number takes)."""
    if isinstance(param_type, click.types.IntParamType):
        return TOML_TYPES["integer"]
    if isinstance(param_type, click.types.FloatParamType):
        return TOML_TYPES["float"]
    return TOML_TYPES.get(param_type.name, ())


@dataclasses.dataclass(frozen=True)
class Problem:
    """One configuration mistake: `key` (a setting, a flag or a variable),
    `where` it came from, what was `expected` and what was given (`actual`,
    already in words)."""

    key: str
    where: str
    expected: str
    actual: str

    def __str__(self) -> str:
        return f"{self.key} must be {self.expected}, got {self.actual}" + (f" ({self.where})" if self.where else "")


class ConfigError(RollstreamError, click.UsageError):
    """Every problem of a configuration at once (exit status 2). A
    `click.UsageError`, so a command reports it as a usage mistake."""

    code = "invalid_input"

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__(f"{len(problems)} configuration error(s):\n" + "\n".join(f"  {p}" for p in problems))


def expected_for(param_type: click.ParamType) -> str:
    if isinstance(param_type, click.Choice):
        return "one of " + ", ".join(repr(choice) for choice in param_type.choices)
    return EXPECTED.get(param_type.name, param_type.name)


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


class SettingOption(click.Option):
    """An option that records a bad value as a `Problem` and goes on, so
    every problem is reported together; a TOML value must also be of a TOML
    type that fits (`window = 1.5` is refused, not truncated to 1)."""

    def process_value(self, ctx: click.Context, value: Any) -> Any:
        where = origin(ctx, self)
        from_file = ctx.get_parameter_source(self.name) is ParameterSource.DEFAULT_MAP
        if from_file and not isinstance(value, str) and type(value) not in toml_types(self.type):
            found(ctx).append(Problem(self.name, where, expected_for(self.type), f"{value!r} ({type(value).__name__})"))
            return None
        try:
            return super().process_value(ctx, value)
        except click.BadParameter:
            found(ctx).append(Problem(self.name, where, expected_for(self.type), repr(value)))
        return None


def config_option(settings_cls, section: str):
    """`--config FILE`, which loads TOML defaults for the command, and
    `--check-config`, the dry run (see the module's docstring)."""

    def load(ctx: click.Context, param, value):
        if value is not None:
            ctx.meta[CONFIG_FILE] = value
            names = {f.name for f in dataclasses.fields(settings_cls)}
            values, problems = read_toml(value, names, section)
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
        return click.option(
            "--config",
            cls=SettingOption,
            type=click.Path(exists=True, dir_okay=False),
            is_eager=True,
            expose_value=False,
            callback=load,
            help=f"TOML file with the same keys as the flags (top level or a [{section}] table).",
        )(fn)

    return decorate


def read_toml(path: str | Path, allowed: set[str], section: str) -> tuple[dict[str, Any], list[Problem]]:
    """The known keys of a TOML file (a `[section]` table, or the top level
    when there is none) and a problem for each unknown one (a stray table,
    a key beside `[section]` too), so a typo never silently falls back to a
    default."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        return {}, [Problem("config", str(path), "valid TOML", f"a syntax error: {exc}")]
    except UnicodeDecodeError as exc:
        return {}, [Problem("config", str(path), "valid TOML (UTF-8 text)", f"bytes that are not UTF-8: {exc}")]
    except RecursionError:  # tomllib reads nested arrays and inline tables recursively
        return {}, [Problem("config", str(path), "valid TOML", "arrays or inline tables nested too deep to read")]
    table = data.get(section, data)
    if type(table) is not dict:
        return {}, [Problem(section, str(path), f"a [{section}] table", f"a {type(table).__name__}: {table!r:.80}")]
    values = {key.replace("-", "_"): value for key, value in table.items()}
    problems = [Problem(key, str(path), unknown_expected(key, allowed, f"a key of [{section}]"), "an unknown key")
                for key in values if key not in allowed]
    problems += [Problem(key, str(path), f"nothing beside the [{section}] table", "a key outside it")
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
            problems.append(Problem(repr(token), "command line", "no arguments, only flags", "an argument"))
            continue
        flag, _, value = token.partition("=")
        if not value and args and not args[0].startswith("-"):
            value = args.pop(0)
        given = f"an unknown flag{f' with value {value!r}' if value else ''}"
        problems.append(Problem(flag, "command line", unknown_expected(flag, flags, "a flag of this command"), given))
    if ctx.auto_envvar_prefix is None:  # invoked without the `rollstream` group: no environment is read
        return problems
    prefix = f"{ctx.auto_envvar_prefix}_"
    variables = {f"{prefix}{(param.name or '').upper()}" for param in ctx.command.params
                 if isinstance(param, click.Option) and param.allow_from_autoenv}
    problems += [Problem(name, "environment", unknown_expected(name, variables, "a variable of this command"),
                         "an unknown variable")
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
    params = {param.name: param for param in ctx.command.params}
    problems += [dataclasses.replace(problem, where=problem.where or origin(ctx, params[problem.key]))
                 for problem in (rules(settings) if rules else []) if problem.key not in bad]
    if problems:
        raise ConfigError(problems)
    if ctx.meta.get(CHECK_ONLY):
        click.echo(f"{ctx.command_path}: configuration ok ({ctx.meta.get(CONFIG_FILE) or 'no --config file'})")
        ctx.exit(0)
    return settings


def settings_options(settings_cls, helps: dict[str, str], types: dict[str, Any] | None = None):
    """One click option per settings field, with the field's default."""
    types = types or {}

    def decorate(fn):
        for f in reversed(dataclasses.fields(settings_cls)):
            default = f.default
            kind = types.get(f.name)
            if kind is None:
                kind = {bool: click.BOOL, int: int, float: float, str: str}.get(type(default), str)
                if default is None:
                    kind = {"int | None": int, "str | None": str}.get(str(f.type), str)
            fn = click.option(
                "--" + f.name.replace("_", "-"),
                f.name,
                cls=SettingOption,
                type=kind,
                default=default,
                show_default=True,
                show_envvar=True,
                help=helps.get(f.name, ""),
            )(fn)
        return fn

    return decorate
