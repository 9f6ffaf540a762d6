"""Settings for the daemons: one dataclass per daemon is the single list of
keys, and the command line, a TOML file and the environment all fill it.

Precedence, highest first: command-line flags, environment variables
(`ROLLSTREAM_<DAEMON>_<KEY>`), the `--config` TOML file, built-in defaults.
"""
from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

import click

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_bytes(value: Any) -> int:
    """`268435456`, `256MiB`, `2G` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"expected a byte size such as 1048576, 512MiB or 2G, got {value!r}")
    unit = (match.group(2) or "").lower().rstrip("b")
    return int(float(match.group(1)) * _UNITS[unit])


class ByteSize(click.ParamType):
    name = "bytes"

    def convert(self, value, param, ctx):
        try:
            return parse_bytes(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


BYTES = ByteSize()


def load_toml(path: str | Path, allowed: set[str], section: str) -> dict[str, Any]:
    """Keys of a TOML file (top level or a `[section]` table); unknown keys
    are an error so a typo never silently falls back to a default."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    table = data.get(section, data)
    values = {key.replace("-", "_"): value for key, value in table.items() if not isinstance(value, dict)}
    unknown = sorted(set(values) - allowed)
    if unknown:
        raise click.BadParameter(f"{path}: unknown key(s) {unknown}; expected some of {sorted(allowed)}", param_hint="--config")
    return values


def config_option(settings_cls, section: str):
    """A `--config FILE` option that loads TOML defaults for the command."""

    def load(ctx: click.Context, param, value):
        if value is not None:
            names = {f.name for f in dataclasses.fields(settings_cls)}
            ctx.default_map = {**(ctx.default_map or {}), **load_toml(value, names, section)}
        return value

    return click.option(
        "--config",
        type=click.Path(exists=True, dir_okay=False),
        is_eager=True,
        expose_value=False,
        callback=load,
        help=f"TOML file with the same keys as the flags (top level or a [{section}] table).",
    )


def settings_from(settings_cls, values: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(settings_cls)}
    return settings_cls(**{key: value for key, value in values.items() if key in names})


def settings_options(settings_cls, helps: dict[str, str], types: dict[str, Any] | None = None):
    """One click option per settings field, with the field's default."""
    types = types or {}

    def decorate(fn):
        for f in reversed(dataclasses.fields(settings_cls)):
            default = f.default
            kind = types.get(f.name)
            if kind is None:
                kind = {int: int, float: float, str: str}.get(type(default), str)
                if default is None:
                    kind = {"int | None": int, "str | None": str}.get(str(f.type), str)
            fn = click.option(
                "--" + f.name.replace("_", "-"),
                f.name,
                type=kind,
                default=default,
                show_default=True,
                show_envvar=True,
                help=helps.get(f.name, ""),
            )(fn)
        return fn

    return decorate
