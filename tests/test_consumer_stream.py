"""The consumer builds and checks batches on a CUDA stream of its own.

Without a GPU, the stream calls are recorded by stand-ins for torch.cuda's
and checked for order and coverage; with one, a batch is built, checked and
read back while a long kernel still occupies the trainer's stream.
"""
import contextlib

import numpy as np
import pytest
import torch
from consumer_helpers import delivery, make_rollout, replaying_trajectories
from test_consumer_client import ScriptedBroker

import rollstream.consumer.client as client_module
from rollstream.common.wire import encode_deliver
from rollstream.consumer import Batch, Consumer
from rollstream.consumer.stream import UploadStream
from rollstream.consumer.validate import checked_batch

# Every tensor field of a batch that carries masks and a replay capture, named here, not read off the class.
TENSOR_FIELDS = ("tokens", "cu_seqlens", "response_tokens", "response_cu", "prompt_lengths", "response_lengths",
                 "loss_mask", "log_probs", "rewards", "sample_indices", "group_index", "mask_ids", "mask_offsets")


def replaying_batch() -> Batch:
    return Batch.from_deliveries([delivery(t) for t in replaying_trajectories(np.random.default_rng(5))])


class RecordedStream:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def wait_stream(self, other: "RecordedStream") -> None:
        self.calls.append(("wait", self.name, other.name))


@pytest.fixture
def recorded_cuda(monkeypatch):
    """torch.cuda's streams and `Tensor.record_stream` replaced by recorders."""
    calls: list = []
    trainer = RecordedStream("trainer", calls)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: RecordedStream("side", calls))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: trainer)

    @contextlib.contextmanager
    def stream(s):
        calls.append(("enter", s.name))
        yield
        calls.append(("exit", s.name))

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, s: calls.append(("record", tensor, s.name)))
    return calls


def test_on_cuda_the_trainers_stream_waits_for_the_side_stream_and_every_tensor_is_recorded_as_used_there(recorded_cuda):
    batch = replaying_batch()
    upload = UploadStream(torch.device("cuda", 0))
    with upload.side():
        recorded_cuda.append(("built",))
    assert upload.hand_over(batch) is batch
    assert recorded_cuda[:4] == [("enter", "side"), ("built",), ("exit", "side"), ("wait", "trainer", "side")]
    records = recorded_cuda[4:]
    assert all(kind == "record" and stream == "trainer" for kind, _, stream in records), records
    expected = [getattr(batch, name) for name in TENSOR_FIELDS] + [batch.replay["routed_experts"]]
    assert sorted(map(id, (tensor for _, tensor, _ in records))) == sorted(map(id, expected))


def test_on_the_cpu_there_is_no_stream_and_nothing_is_recorded(recorded_cuda):
    upload = UploadStream(torch.device("cpu"))
    batch = replaying_batch()
    with upload.side():
        pass
    assert upload.hand_over(batch) is batch
    assert upload.stream is None and recorded_cuda == []


class RecordedUpload:
    """An `UploadStream` stand-in that notes what ran inside `side` and what was handed over."""

    def __init__(self, device):
        self.inside, self.built_inside, self.handed = False, [], []

    @contextlib.contextmanager
    def side(self):
        self.inside = True
        yield
        self.inside = False

    def hand_over(self, batch):
        self.handed.append(batch)
        return batch


def test_the_consumer_builds_and_checks_each_batch_on_its_upload_stream_and_hands_it_over(monkeypatch):
    upload = RecordedUpload(None)
    monkeypatch.setattr(client_module, "UploadStream", lambda device: upload)

    def checked(*args, **kwargs):
        upload.built_inside.append(upload.inside)
        return checked_batch(*args, **kwargs)

    monkeypatch.setattr(client_module, "checked_batch", checked)
    rng = np.random.default_rng(2)
    broker = ScriptedBroker()
    try:
        with Consumer(broker.endpoint, batch_size=2, prefetch=4) as consumer:
            broker.expect("hello")
            broker.welcome()
            for i in range(2):
                broker.send(encode_deliver(make_rollout(rng, f"t{i}", sample_index=i).merged(), f"L{i}"))
            batch = consumer.next_batch(timeout=10)
    finally:
        broker.close()
    assert upload.built_inside == [True]
    assert upload.handed == [batch]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_with_cuda_a_batch_is_checked_while_the_trainers_stream_is_busy():
    """A long kernel on the trainer's stream: the next batch is uploaded,
    checked and its verdict read before that kernel ends."""
    rng = np.random.default_rng(9)
    deliveries = [delivery(make_rollout(rng, f"t{i}", sample_index=i, max_len=64).merged()) for i in range(8)]
    device = torch.device("cuda", torch.cuda.current_device())
    upload = UploadStream(device)
    with upload.side():  # warm-up: kernels loaded, pinned and device pools made
        checked_batch(deliveries, device=device, vocab_size=1000)
    torch.cuda.synchronize()
    step_done = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the trainer's stream
    step_done.record()
    with upload.side():
        batch, violations, _ = checked_batch(deliveries, device=device, vocab_size=1000)
    assert violations == []
    assert not step_done.query(), "the verdict waited for the trainer's stream"
    upload.hand_over(batch)
    after = torch.cuda.Event()
    after.record()
    assert int(batch.tokens.sum()) >= 0  # the trainer's stream reads the batch after its upload
    assert step_done.query() and after.query()
