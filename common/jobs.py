"""Jobs: what keeps two runs on one broker apart.

Every producer and consumer connection names a job in its hello (`default`
when it names none). A broker keeps each job's trajectories and groups in a
namespace of their own: the same trajectory or group id in two jobs is two
trajectories or groups, and a consumer is handed only its own job's. Inside
the broker a job's ids are keys: the id itself for the default job (so a data
directory written before jobs reads as the default job's), `job` + U+001F +
id for any other; ids on the wire never hold U+001F.
"""
from __future__ import annotations

import re

from .errors import InvalidInput

DEFAULT_JOB = "default"
JOB_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_JOB = re.compile(JOB_PATTERN)
SEPARATOR = "\x1f"  # never in an id on the wire (`messages.ID`)


def is_job(value) -> bool:
    return isinstance(value, str) and _JOB.fullmatch(value) is not None


def check_job(job: str) -> str:
    """`job` when it is a valid job name; `InvalidInput` naming the rule otherwise."""
    if not is_job(job):
        raise InvalidInput(f"a job name must match {JOB_PATTERN} (letters, digits, '.', '_', '-'; at most 64), "
                           f"got {job!r}")
    return job


def job_key(job: str, wire_id: str) -> str:
    """The broker's key of `wire_id` in `job`."""
    return wire_id if job == DEFAULT_JOB else job + SEPARATOR + wire_id


def job_of(key: str) -> str:
    """The job a broker key belongs to."""
    job, sep, _ = key.partition(SEPARATOR)
    return job if sep else DEFAULT_JOB


def wire_id(key: str) -> str:
    """The id a broker key stands for on the wire (its job's own id)."""
    _, sep, rest = key.partition(SEPARATOR)
    return rest if sep else key
