"""Types of the compiled module built from common/_native.c."""
from typing import Any

def inside_support(tokens: Any, ids: Any, offsets: Any, out: Any) -> None: ...
