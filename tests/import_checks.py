"""What importing whole packages loads, checked in a fresh interpreter (the
test process has long loaded everything): optional and heavy dependencies
stay out of the modules that must not need them."""
from __future__ import annotations

import subprocess
import sys
from typing import Sequence


def assert_not_loaded(packages: Sequence[str], absent: str, *, reached: str | None = None, at_least: int = 1) -> None:
    """Import every module of each of `packages` (and the packages
    themselves); then `absent` must not be loaded, `reached` (a module the
    imports must have got to) must be, and at least `at_least` modules were
    imported."""
    code = (
        "import importlib, pkgutil, sys\n"
        "modules = []\n"
        f"for name in {list(packages)!r}:\n"
        "    package = importlib.import_module(name)\n"
        "    modules += [importlib.import_module(f'{name}.{m.name}') for m in pkgutil.iter_modules(package.__path__)]\n"
        f"assert len(modules) >= {at_least}, modules\n"
        f"assert {reached!r} is None or {reached!r} in sys.modules, sorted(sys.modules)\n"
        f"assert {absent!r} not in sys.modules, sorted(m for m in sys.modules if m.startswith({absent!r}))[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
