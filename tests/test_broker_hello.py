"""The broker's side of each handshake (`broker.hello.Hellos`), without
sockets: the welcome's fields and what each connection negotiated."""
from rollstream.broker.hello import Hellos


def hellos() -> Hellos:
    return Hellos("b-1", max_message_bytes=1000, lease_timeout=30.0, heartbeat_interval=0.5)


def test_a_producer_gets_batched_acks_only_while_its_latest_hello_asks():
    h = hellos()
    assert h.welcome_producer(b"p", {"producer_id": "p", "seq": 4, "batch_acks": True, "batch_frames": True}, 16) == {
        "broker_id": "b-1", "max_message_bytes": 1000, "window": 16, "seq": 4, "batch_acks": True, "batch_frames": True}
    assert b"p" in h.batch_acks
    assert h.welcome_producer(b"p", {"producer_id": "p"}, 8) == {"broker_id": "b-1", "max_message_bytes": 1000, "window": 8}
    assert b"p" not in h.batch_acks  # a hello without it: plain acks again
    h.welcome_producer(b"q", {"producer_id": "q", "batch_acks": True}, 8)
    h.forget_producer(b"q")
    assert not h.batch_acks


def test_a_consumer_reads_the_layouts_its_hello_named_and_dropped_connections_are_forgotten():
    h = hellos()
    assert h.welcome_consumer(b"c1", {"consumer_id": "c", "packed_arrays": True, "seq": 2}, live=[b"c1"]) == {
        "broker_id": "b-1", "lease_timeout": 30.0, "heartbeat_interval": 0.5, "packed_arrays": True, "seq": 2}
    assert h.options_of(b"c1") == {"packed_arrays"} and h.options_of(b"unknown") == frozenset()
    h.welcome_consumer(b"c2", {"consumer_id": "d", "packed_arrays": True, "split_arrays": True}, live=[b"c2"])
    assert h.options_of(b"c2") == {"packed_arrays", "split_arrays"}
    assert h.options_of(b"c1") == frozenset()  # the dispatcher dropped c1: its layouts went with it
