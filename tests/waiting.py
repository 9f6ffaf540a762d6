"""Waiting on a condition instead of sleeping past it (this file holds no tests)."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition", *,
             interval: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy, and return that.

    `timeout` bounds a failing wait; it is not a timing assertion. The
    error names `what` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
