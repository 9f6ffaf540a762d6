"""Everything under tests/faults/ is the fault-injection suite: marked `faults`
so that `pytest -m "not faults"` leaves it out."""
from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A conftest hook sees every collected item, not only this folder's.
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.faults)
