"""rollstream's one error vocabulary: every error it raises on purpose is a
`RollstreamError` with a `code`, and whether it is retriable comes from one
table; who broke a protocol rule decides its type; no module raises a bare
builtin exception."""
import ast
import builtins
from pathlib import Path

import click
import numpy as np
import pytest

from rollstream.common import (
    NACK_CODES,
    RETRIABLE,
    BatchValidationError,
    ClientClosed,
    ClientFailed,
    LocalProtocolError,
    ProtocolError,
    Refused,
    RemoteProtocolError,
    RollstreamError,
    Turn,
)
from rollstream.common.errors import (
    LOCAL_CODES,
    InternalError,
    InvalidInput,
    InvalidState,
    InvalidType,
    NotFound,
    OutOfRange,
    TimedOut,
)
from rollstream.common.validation import Violation
from rollstream.consumer import ConsumerClosed
from rollstream.producer import Halted, ProducerClosed


def test_the_table_has_one_row_per_code():
    assert set(RETRIABLE) == set(NACK_CODES) | set(LOCAL_CODES)
    assert not set(NACK_CODES) & set(LOCAL_CODES)


@pytest.mark.parametrize("error", [
    ProtocolError("schema", "no such field"),
    Refused("dtype", "float64", kind="turn", trajectory_id="t", turn=0, seq=1),
    ProducerClosed("closed before the ack"),
    Halted("t", Refused("internal", "a bug", kind="turn", trajectory_id="t", turn=1, seq=2), "turn"),
    ConsumerClosed("the consumer is closed"),
    ClientFailed("producer 'p'", OSError("gone")),
    BatchValidationError([Violation("support", 0, 1, 1, "id 3 not in support")]),
], ids=lambda e: type(e).__name__)
def test_every_error_has_a_known_code(error):
    assert isinstance(error, RollstreamError)
    assert error.code in RETRIABLE
    assert error.retriable is RETRIABLE[error.code]


def test_retriable_means_the_same_request_may_succeed_later():
    assert ProtocolError("unavailable", "disk full").retriable
    assert Refused("unavailable", "disk full", kind="turn", trajectory_id="t", turn=0, seq=1).retriable
    assert not ProtocolError("schema", "no such field").retriable
    assert not Refused("mask_invalid", "empty support", kind="turn", trajectory_id="t", turn=0, seq=1).retriable
    assert not ClientFailed("consumer 'c'", OSError("gone")).retriable


def test_a_newer_peers_code_is_not_retriable():
    refused = Refused("from_the_future", "?", kind="end", trajectory_id="t", turn=None, seq=1)
    assert refused.code == "from_the_future" and not refused.retriable


def test_errors_keep_the_builtin_bases_callers_catch():
    assert isinstance(ProtocolError("dtype", "x"), ValueError)
    assert isinstance(BatchValidationError([Violation("support", 0, 1, 1, "x")]), ValueError)
    assert isinstance(ProducerClosed("x"), RuntimeError)
    assert isinstance(ClientFailed("consumer 'c'", OSError("gone")), RuntimeError)


def test_a_code_is_required():
    class Nameless(RollstreamError):
        pass

    with pytest.raises(TypeError, match="Nameless needs a code"):
        Nameless("what went wrong?")
    with pytest.raises(ValueError, match="unknown reply code 'nope'"):
        ProtocolError("nope", "x")


def test_client_failed_names_the_client_and_the_cause():
    error = ClientFailed("producer 'rollout-7'", ConnectionResetError("peer reset"))
    assert str(error) == "producer 'rollout-7' stopped: its I/O loop failed with ConnectionResetError('peer reset')"


def test_every_client_and_store_error_is_a_rollstream_error_with_a_meaningful_code():
    from rollstream.broker.store import StoreCorrupted, StoreUnavailable
    from rollstream.common.admin import AdminError
    from rollstream.producer.miles_samples import MilesMergeError
    from rollstream.producer.replay import ReplayError
    from rollstream.producer.spool import SpoolError
    from rollstream.producer.window import WindowFull

    retriable = {AdminError("x", code="no_answer"): True, AdminError("x", code="unavailable"): True,
                 AdminError("x", code="schema"): False, SpoolError("x"): False, WindowFull("x"): True,
                 ReplayError("x"): False, MilesMergeError("x"): False, StoreUnavailable("x"): True,
                 StoreCorrupted("x"): False}
    for error, expected in retriable.items():
        assert isinstance(error, RollstreamError) and error.code in RETRIABLE, type(error).__name__
        assert error.retriable is expected, (type(error).__name__, error.code)
    assert isinstance(SpoolError("x"), RuntimeError) and isinstance(ReplayError("x"), ValueError)  # bases kept


@pytest.mark.parametrize(("error_type", "code", "builtin"), [
    (InvalidInput, "invalid_input", ValueError),
    (InvalidType, "invalid_input", TypeError),
    (OutOfRange, "invalid_input", IndexError),
    (InvalidState, "invalid_state", RuntimeError),
    (NotFound, "not_found", KeyError),
    (TimedOut, "timed_out", TimeoutError),
    (InternalError, "internal", RuntimeError),
    (ClientClosed, "closed", RuntimeError),
], ids=lambda value: getattr(value, "__name__", value))
def test_each_local_type_has_its_code_and_keeps_the_builtin_base_callers_catch(error_type, code, builtin):
    error = error_type("what went wrong, expected x, got y")
    assert isinstance(error, RollstreamError) and isinstance(error, builtin)
    assert error.code == code and error.retriable is RETRIABLE[code]
    assert str(error) == "what went wrong, expected x, got y"  # a KeyError base would quote it


def test_invalid_type_and_out_of_range_are_invalid_input():
    assert isinstance(InvalidType("x"), InvalidInput) and isinstance(InvalidType("x"), ValueError)
    assert isinstance(OutOfRange("x"), InvalidInput) and isinstance(OutOfRange("x"), ValueError)


def test_a_local_check_raises_local_protocol_error():
    """The caller's own turn breaks a rule of the data model: a local error,
    refused before anything is sent."""
    with pytest.raises(LocalProtocolError) as err:
        Turn.build([10, 11], [-0.1, -0.2], supports=[[10], []])
    assert err.value.code == "mask_invalid" and "non-empty support" in err.value.message
    assert not isinstance(err.value, RemoteProtocolError)


def _turn_frames(tokens, supports, *, seq: int = 5, crc: bool = False) -> list:
    from rollstream.common.wire import encode_turn

    turn = Turn.build(tokens, [-0.5] * len(tokens), supports=supports, check_content=False)
    frames = encode_turn("t", 0, turn, seq=seq, prompt_tokens=np.array([1, 2], "<i4"), crc=crc)
    return [bytes(frame) for frame in frames]


def test_a_corrupted_frame_decodes_to_remote_protocol_error():
    from rollstream.common.codec import decode
    from rollstream.common.messages import PRODUCER_TO_BROKER

    frames = _turn_frames([10, 11], [[10, 4], [11]], crc=True)
    decode(frames, PRODUCER_TO_BROKER)  # intact, it decodes
    corrupted = frames[:]
    corrupted[-1] = bytes([corrupted[-1][0] ^ 0xFF]) + corrupted[-1][1:]
    with pytest.raises(RemoteProtocolError) as err:
        decode(corrupted, PRODUCER_TO_BROKER)
    assert err.value.code == "crc_mismatch" and err.value.seq == 5


def test_a_shared_check_on_received_data_is_turned_remote_at_the_decoder():
    """The content rules are the same code on both ends (`check_message_arrays`
    raises `LocalProtocolError`); what arrived breaking them is remote, with
    the sender's seq."""
    from rollstream.common.codec import decode
    from rollstream.common.messages import PRODUCER_TO_BROKER

    frames = _turn_frames([10, 11], [[10], [3]], seq=9)  # token 11 outside its support [3]
    with pytest.raises(RemoteProtocolError) as err:
        decode(frames, PRODUCER_TO_BROKER)
    assert err.value.code == "mask_invalid" and err.value.seq == 9 and "inside its support" in err.value.message
    assert not isinstance(err.value, LocalProtocolError)
    with pytest.raises(LocalProtocolError):  # the same arrays, checked by their sender
        Turn.build([10, 11], [-0.5, -0.5], supports=[[10], [3]])


def test_a_delivery_that_breaks_a_data_model_rule_is_remote():
    from rollstream.common.codec import decode, encode
    from rollstream.common.messages import BROKER_TO_CONSUMER
    from rollstream.common.wire import trajectory_from_deliver

    arrays = {"prompt_tokens": np.array([1], "<i4"), "tokens": np.array([10, 11], "<i4"),
              "log_probs": np.array([-0.5], "<f4"), "loss_mask": np.array([1, 1], "<u1")}
    fields = {"lease": "l", "trajectory_id": "t", "status": "completed", "reward": 1.0, "response_length": 2,
              "weight_versions": [], "metadata": {}, "seq": 0}
    message = decode(encode(BROKER_TO_CONSUMER, "deliver", fields, arrays), BROKER_TO_CONSUMER, check_content=False)
    with pytest.raises(RemoteProtocolError) as err:
        trajectory_from_deliver(message)
    assert err.value.code == "misaligned" and "log_probs has 1 entries" in err.value.message


def test_as_remote_keeps_the_rule_and_the_sequence_number():
    local = LocalProtocolError("out_of_order", "turn 3 before turn 2", seq=4, expected=2)
    remote = local.as_remote()
    assert type(remote) is RemoteProtocolError
    assert (remote.code, remote.message, remote.seq, remote.expected) == ("out_of_order", "turn 3 before turn 2", 4, 2)
    assert remote.as_remote() is remote
    assert type(remote.with_seq(8)) is RemoteProtocolError and remote.with_seq(8).seq == 8


def test_except_protocol_error_catches_every_kind_and_so_does_except_value_error():
    kinds = [LocalProtocolError("schema", "x"), RemoteProtocolError("crc_mismatch", "x"),
             Refused("dtype", "float64", kind="turn", trajectory_id="t", turn=0, seq=1)]
    for error in kinds:
        for clause in (ProtocolError, ValueError, RollstreamError):
            try:
                raise error
            except clause as caught:
                assert caught is error
    assert not isinstance(kinds[2], (LocalProtocolError, RemoteProtocolError))


def test_a_refusal_is_one_type_in_the_producer_and_in_common():
    import rollstream.producer as producer

    assert producer.Refused is Refused
    assert Refused("schema", "x").message == "x" and "broker refused a message: schema: x" == str(Refused("schema", "x"))


def test_the_closed_clients_share_a_base():
    for closed in (ProducerClosed("closed before the ack"), ConsumerClosed("the consumer is closed")):
        assert isinstance(closed, ClientClosed) and isinstance(closed, RuntimeError) and closed.code == "closed"
    assert issubclass(ProducerClosed, ClientClosed) and issubclass(ConsumerClosed, ClientClosed)


def test_config_error_is_a_rollstream_error_and_a_usage_error():
    from rollstream.common.config import ConfigError, Problem

    error = ConfigError([Problem("window", "flag --window", "an integer", "'many'", "type")])
    assert isinstance(error, InvalidInput) and isinstance(error, click.UsageError)
    assert error.code == "invalid_input" and error.exit_code == 2
    assert str(error) == "1 configuration error(s):\n  window must be an integer, got 'many' (flag --window) [rule: type]"


def test_every_other_local_error_type_is_a_rollstream_error():
    from rollstream.common.curve import CurveError
    from rollstream.common.segments import SegmentDamaged
    from rollstream.consumer import SourceRankFailed

    assert isinstance(CurveError("x"), InvalidInput)
    assert isinstance(SegmentDamaged("x"), RollstreamError)
    failed = SourceRankFailed("the source rank failed", code="timed_out")
    assert isinstance(failed, RuntimeError) and failed.retriable


# -- no bare builtin exceptions --------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("common", "producer", "broker", "consumer", "app")
# Control flow rather than errors: the iterator protocol, and what ends a process or a generator.
NOT_ERRORS = {"StopIteration", "StopAsyncIteration", "GeneratorExit", "SystemExit", "KeyboardInterrupt"}
BUILTIN_ERRORS = {name for name, value in vars(builtins).items()
                  if isinstance(value, type) and issubclass(value, BaseException)} - NOT_ERRORS


def builtin_raises(source: str) -> list[tuple[int, str]]:
    """`(line, name)` of each `raise <builtin exception>` in `source`, but an
    `AttributeError` raised in a `__getattr__` (Python's attribute protocol).
    Re-raising (`raise`, `raise error`, `raise error.as_remote() from None`)
    names no builtin and passes."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id in BUILTIN_ERRORS \
                    and not (raised.id == "AttributeError" and function == "__getattr__"):
                found.append((node.lineno, raised.id))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), None)
    return found


def test_the_scan_finds_builtin_raises_and_allows_the_protocols():
    source = """
def f(x):
    if x:
        raise ValueError(f"x must be falsy, got {x}")
    raise TimeoutError
def __getattr__(name):
    raise AttributeError(name)
def g():
    try:
        pass
    except OSError as exc:
        raise InvalidInput(str(exc)) from None
    except KeyError:
        raise
    raise StopIteration from None
"""
    assert builtin_raises(source) == [(4, "ValueError"), (5, "TimeoutError")]


def test_no_module_raises_a_builtin_exception():
    """Every error the package raises is a `RollstreamError` that keeps the
    builtin base its callers catch: `InvalidInput` for `ValueError`,
    `InvalidType`, `OutOfRange`, `InvalidState`, `NotFound`, `TimedOut`,
    `InternalError` (common/errors.py)."""
    places = [f"{path.relative_to(ROOT)}:{line}: raise {name}"
              for folder in PACKAGE_DIRS if (ROOT / folder).is_dir()
              for path in sorted((ROOT / folder).rglob("*.py"))
              for line, name in builtin_raises(path.read_text())]
    assert not places, "raise the RollstreamError that keeps this builtin base instead:\n" + "\n".join(places)
