"""rollstream.common: the data model, wire codec and miles interop that the
producer, broker and consumer share."""
from .codec import Message, content_digest, decode, encode, encode_error
from .contract import ARRAYS, NACK_CODES, PROTOCOL_VERSION, REPLAY_FIELDS, STATUSES
from .errors import (
    RETRIABLE,
    ClientClosed,
    ClientFailed,
    LocalProtocolError,
    ProtocolError,
    Refused,
    RemoteProtocolError,
    RollstreamError,
)
from .ingest import turn_from_sglang, turn_from_sglang_chat, turn_from_vllm
from .mask import SamplingMask
from .trajectory import Gap, Trajectory, Turn, TurnOutcome
from .validation import BatchValidationError, Violation, packed_violations

__all__ = [
    "ARRAYS",
    "BatchValidationError",
    "ClientClosed",
    "ClientFailed",
    "Gap",
    "LocalProtocolError",
    "Message",
    "NACK_CODES",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "REPLAY_FIELDS",
    "RETRIABLE",
    "Refused",
    "RemoteProtocolError",
    "RollstreamError",
    "STATUSES",
    "SamplingMask",
    "Trajectory",
    "Turn",
    "TurnOutcome",
    "Violation",
    "content_digest",
    "decode",
    "encode",
    "encode_error",
    "packed_violations",
    "turn_from_sglang",
    "turn_from_sglang_chat",
    "turn_from_vllm",
]
