"""`SendBuffers` (common/sockets.py): a buffer a message went out from by
reference is written again only once ZeroMQ is done with it; and
`encode_batch` writes a batch's body into such a buffer byte for byte as it
would build it."""
import numpy as np
import zmq
from test_codec import _batchable

from rollstream.common.codec import encode_batch
from rollstream.common.sockets import SendBuffers, send_frames


class Tracker:
    def __init__(self):
        self.done = False


def test_a_buffer_is_taken_again_only_once_its_send_is_done():
    buffers = SendBuffers(keep=2)
    first = buffers.take(10)
    assert len(first) == 10 and not first.readonly
    tracker = Tracker()
    assert buffers.holds(first)
    buffers.sending(tracker)
    second = buffers.take(10)
    assert second.obj is not first.obj, "a buffer still being sent was handed out again"
    buffers.unsent()  # refused by the socket: idle at once
    assert buffers.take(10).obj is second.obj
    tracker.done = True
    buffers.unsent()
    assert {buffers.take(10).obj is first.obj, buffers.take(10).obj is first.obj} == {True, False}
    assert not buffers.holds(memoryview(bytearray(10)))  # not one of its buffers


def test_a_buffer_fits_the_next_message_of_about_its_size_and_at_most_keep_stay_idle():
    buffers = SendBuffers(keep=1)
    small = buffers.take(100)
    assert len(small.obj) == SendBuffers.GRANULE
    buffers.unsent()
    large = buffers.take(SendBuffers.GRANULE + 1)  # the idle one is too small
    assert large.obj is not small.obj and len(large.obj) == 2 * SendBuffers.GRANULE
    buffers.unsent()
    assert buffers.take(50).obj is small.obj  # the smallest that fits
    buffers.take(SendBuffers.GRANULE * 2)
    buffers.unsent()
    assert len(buffers._idle) <= 2  # `keep` is enforced at the next take
    buffers.take(1)
    assert len(buffers._idle) <= 1


def test_a_tracked_send_reuses_its_buffer_once_the_peer_has_the_bytes():
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    receiver.bind("tcp://127.0.0.1:0")
    sender.connect(receiver.getsockopt_string(zmq.LAST_ENDPOINT))
    buffers = SendBuffers()
    try:
        got = []
        for k in range(3):
            payload = np.full(300_000, k + 1, np.uint8)
            view = buffers.take(len(payload))
            view[:] = memoryview(payload)
            tracker = send_frames(sender, [b"header", view], track_last=True)
            assert buffers.holds(view)
            buffers.sending(tracker)
            assert receiver.poll(10_000)
            got.append(receiver.recv_multipart())
            tracker.wait(10)
        assert [frames[1] == bytes([k + 1]) * 300_000 for k, frames in enumerate(got)] == [True] * 3
        assert buffers.take(10).obj is view.obj  # the one buffer served every send
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
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
