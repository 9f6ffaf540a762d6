"""`SendBuffer` (common/sockets.py): the one buffer a producer's batches
are written into is copied out by the send, so writing the next batch into
it at once leaves every batch sent as it was; and `encode_batch` writes a
batch's body into such a buffer byte for byte as it would build it."""
import numpy as np
import zmq
from test_codec import _batchable

from rollstream.common.codec import encode_batch
from rollstream.common.sockets import SendBuffer, send_frames
from rollstream.producer.client import AsyncProducer


def test_the_buffer_is_one_and_grows_in_granules_to_the_largest_body():
    buffer = SendBuffer()
    small = buffer.take(100)
    assert len(small) == 100 and not small.readonly and len(small.obj) == SendBuffer.GRANULE
    assert buffer.take(50).obj is small.obj and buffer.holds(small)
    large = buffer.take(SendBuffer.GRANULE + 1)
    assert len(large.obj) == 2 * SendBuffer.GRANULE and buffer.holds(large) and not buffer.holds(small)
    assert buffer.take(10).obj is large.obj  # never shrinks
    assert not buffer.holds(memoryview(bytearray(10))) and not buffer.holds(bytes(10))


def _queued_pair(tmp_path):
    """A sender whose messages queue unsent (nothing is bound at its address
    yet) and the receiver that takes them once bound: a part handed over by
    reference would still be read from the caller's buffer after the send."""
    context = zmq.Context()
    endpoint = f"ipc://{tmp_path}/queued"
    sender = context.socket(zmq.PAIR)
    sender.connect(endpoint)
    return context, endpoint, sender


def _received(context, endpoint, count):
    receiver = context.socket(zmq.PAIR)
    receiver.bind(endpoint)
    try:
        got = []
        for _ in range(count):
            assert receiver.poll(10_000)
            got.append(receiver.recv_multipart())
        return got
    finally:
        receiver.close(linger=0)


def test_batches_sent_from_the_buffer_arrive_as_written_though_it_was_written_again(tmp_path):
    context, endpoint, sender = _queued_pair(tmp_path)
    buffer = SendBuffer()
    try:
        for k in range(3):
            view = buffer.take(300_000)
            view[:] = memoryview(np.full(300_000, k + 1, np.uint8))
            send_frames(sender, [b"header", view])  # the batch's body copied out, whatever its size
        got = _received(context, endpoint, 3)
        assert [frames[1] == bytes([k + 1]) * 300_000 for k, frames in enumerate(got)] == [True] * 3
    finally:
        sender.close(linger=0)
        context.term()


def test_the_producer_sends_a_batch_body_by_copy_and_a_large_frame_of_its_own_by_reference(tmp_path):
    context, endpoint, sender = _queued_pair(tmp_path)
    producer = AsyncProducer("tcp://127.0.0.1:1", "p")  # never started: its send is driven here alone
    producer._sock = sender
    own = bytearray(200_000)  # a large array frame, kept unchanged by the session until settled
    try:
        for k in range(2):
            body = producer._send_buffer.take(200_000)
            body[:] = bytes([k + 1]) * 200_000
            assert producer._send_now([b"batch", body])
        own[:] = b"\x07" * 200_000
        assert producer._send_now([b"turn", own])
        own[:] = b"\x08" * 200_000  # after the send: by reference, the queued message reads this
        got = _received(context, endpoint, 3)
        assert [frames[1][:1] for frames in got] == [b"\x01", b"\x02", b"\x08"]
    finally:
        producer._sock = None
        sender.close(linger=0)
        context.term()


def test_a_batch_written_into_a_given_body_is_the_bytes_it_builds():
    messages = _batchable()
    given = []

    def body(size):
        given.append(memoryview(bytearray(size + 64))[:size])
        return given[-1]

    built, written = encode_batch(messages), encode_batch(messages, body)
    assert written[0] == built[0] and written[1] is given[0]
    assert bytes(written[1]) == bytes(built[1])
