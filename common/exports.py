"""Package names that load their module on first use (PEP 562), so that
importing a package, or a command that lists its siblings' help, pays only
for what it touches."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: each name of `exports` comes
    from the module it maps to (relative to `package` when it starts with
    a dot), imported when the name is first asked for."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
