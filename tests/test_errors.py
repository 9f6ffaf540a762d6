"""rollstream's one error vocabulary: every error it raises on purpose is a
`RollstreamError` with a `code`, and whether it is retriable comes from one
table."""
import pytest

from rollstream.common import NACK_CODES, RETRIABLE, BatchValidationError, ClientFailed, ProtocolError, RollstreamError
from rollstream.common.errors import LOCAL_CODES
from rollstream.common.validation import Violation
from rollstream.consumer import ConsumerClosed
from rollstream.producer import ProducerClosed, Refused


def test_the_table_has_one_row_per_code():
    assert set(RETRIABLE) == set(NACK_CODES) | set(LOCAL_CODES)
    assert not set(NACK_CODES) & set(LOCAL_CODES)


@pytest.mark.parametrize("error", [
    ProtocolError("schema", "no such field"),
    Refused("dtype", "float64", kind="turn", trajectory_id="t", turn=0, seq=1),
    ProducerClosed("closed before the ack"),
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
