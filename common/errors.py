"""Errors that carry a protocol reply code, so any layer can refuse input the
way a peer expects to be told (a `nack` with `code` and `message`)."""
from __future__ import annotations

from .contract import NACK_CODES


class ProtocolError(ValueError):
    """Input refused under a protocol rule; nothing was changed.

    `code` is one of `contract.NACK_CODES`; `seq` is the sender's sequence
    number when it could be read; `expected` carries the next expected turn
    for `out_of_order`.
    """

    def __init__(self, code: str, message: str, *, seq: int | None = None, expected: int | None = None):
        if code not in NACK_CODES:
            raise ValueError(f"unknown reply code {code!r}; expected one of {NACK_CODES}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.seq = seq
        self.expected = expected

    def with_seq(self, seq: int | None) -> "ProtocolError":
        """The same refusal, answering the sender's `seq`."""
        return ProtocolError(self.code, self.message, seq=seq, expected=self.expected)
