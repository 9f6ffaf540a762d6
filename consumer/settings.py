"""Every setting of `rollstream consume` with its default and its
declaration (kind, unit, range, help), as the daemons declare theirs (see
`rollstream.common.config`)."""
from __future__ import annotations

from dataclasses import dataclass

from rollstream.common.config import (
    ENDPOINT,
    FILE,
    FLAG,
    ZMQ_SCHEMES,
    Problem,
    choice,
    count,
    log_level,
    seconds,
    setting,
    text,
    vocabulary,
)
from rollstream.common.contract import CreditUnit
from rollstream.common.curve import client_key_problems
from rollstream.common.jobs import JOB_PATTERN

from .assembly import POLICIES


@dataclass
class ConsumeSettings:
    endpoint: tuple[str, ...] = setting((), ENDPOINT, "A broker's consumer endpoint (repeatable; at least one).",
                                        schemes=ZMQ_SCHEMES, many=True)
    batch_size: int | None = count(None, "Units (trajectories or groups) per batch: 8 by default; with --batch-tokens "
                                         "alone, that budget's unit cap (at most 256).", "units")
    batch_tokens: int | None = count(None, "Close a batch before the unit that would take it past this many prompt + "
                                           "response tokens.", "tokens")
    unit: str = choice(str(CreditUnit.TRAJECTORY), "What a batch counts.", tuple(str(unit) for unit in CreditUnit))
    batches: int = count(0, "Stop after this many batches; 0 runs until interrupted.", "batches", low=0)
    vocab_size: int | None = vocabulary(None, "Refuse token and support ids outside [0, vocab_size). Unset: no "
                                              "bound.")
    on_invalid: str = choice("raise", "raise: stop on an invalid batch; quarantine: dead-letter invalid trajectories "
                                      "and go on.", POLICIES)
    reward_key: str | None = text(None, "Key of a map reward to use as the scalar reward.")
    commit: bool = setting(True, FLAG, "Ack each batch, or give it back for redelivery (inspect without "
                                         "consuming).", switch="release")
    device: str | None = text(None, "torch device for the batches (default: cuda if present, else cpu).")
    timeout: float | None = seconds(None, "Seconds to wait for a batch before giving up. Unset: wait for good.")
    log_level: str = log_level("warning")
    job: str = text("default", "The job whose trajectories to read.", pattern=JOB_PATTERN)
    curve_secret_key: str | None = setting(None, FILE, "This client's own key pair (a .key_secret file from "
                                                       "`rollstream keys generate`).")
    curve_server_key: str | None = setting(None, FILE, "The broker's public key (its .key file); with "
                                                       "--curve-secret-key: connect over CURVE.")


def consume_problems(settings: ConsumeSettings) -> list[Problem]:
    """What `consume` would refuse in settings each of whose values its
    declaration takes: no endpoint, or CURVE key files that are not a pair."""
    problems = client_key_problems(settings.curve_secret_key, settings.curve_server_key)
    if not settings.endpoint:
        problems.append(Problem("endpoint", "command line", "at least one --endpoint", "none", "required"))
    return problems
