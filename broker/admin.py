"""A small admin client for the broker's admin endpoint."""
from __future__ import annotations

import zmq

from rollstream.common.codec import decode, encode
from rollstream.common.messages import ADMIN_REPLIES, ADMIN_REQUESTS
from rollstream.common.sockets import dealer


class AdminError(RuntimeError):
    pass


class AdminClient:
    def __init__(self, endpoint: str, *, timeout: float = 5.0, context: zmq.Context | None = None):
        self.endpoint = endpoint
        self.timeout_ms = int(timeout * 1000)
        self._sock = dealer(context or zmq.Context.instance(), endpoint, linger_ms=0)
        self._seq = 0

    def _call(self, mtype: str, fields: dict | None = None):
        self._seq += 1
        self._sock.send_multipart(encode(ADMIN_REQUESTS, mtype, {**(fields or {}), "seq": self._seq}))
        while True:
            if not self._sock.poll(self.timeout_ms):
                raise AdminError(f"no answer from the broker at {self.endpoint} within {self.timeout_ms / 1000:.1f} s")
            reply = decode(self._sock.recv_multipart(), ADMIN_REPLIES)
            if reply.get("seq") != self._seq:
                continue  # a late answer to an earlier call
            if reply.type == "nack":
                raise AdminError(f"{reply['code']}: {reply['message']}")
            return reply

    def status(self) -> dict:
        return dict(self._call("status").fields)

    def dead_letters(self, limit: int = 100) -> list[dict]:
        return self._call("dead_letters", {"limit": limit})["items"]

    def requeue(self, trajectory_ids: list[str]) -> list[str]:
        return self._call("requeue", {"trajectory_ids": trajectory_ids})["trajectory_ids"]

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
