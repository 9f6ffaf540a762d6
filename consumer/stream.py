"""Where the consumer uploads and checks a batch: on CUDA, a stream of its own.

The trainer calls `next_batch` right after queueing a training step on its
stream. Were the next batch's upload and checks queued behind that step, the
verdict's one host read would wait for the whole step: loading would never
overlap compute. On `UploadStream.side` they run beside it, and the read
waits for them alone. `hand_over` then orders the trainer's stream after
them (an event the trainer's stream waits on) and tells the caching
allocator that the batch's tensors, made on the side stream, are used on
the trainer's (`record_stream`), so their memory is never given to other
work before the trainer's use of them is done. On the CPU both are no-ops.
"""
from __future__ import annotations

import contextlib
from dataclasses import fields
from typing import Iterator

import torch

from .batch import Batch


def batch_tensors(batch: Batch) -> Iterator[torch.Tensor]:
    """Every tensor a batch holds (its packed, per-sample and replay fields)."""
    for field in fields(batch):
        value = getattr(batch, field.name)
        if isinstance(value, torch.Tensor):
            yield value
    yield from batch.replay.values()


class UploadStream:
    """The consumer's own CUDA stream for building and checking batches on
    `device` (none on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def side(self) -> contextlib.AbstractContextManager:
        """Work queued inside runs on the side stream."""
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def hand_over(self, batch: Batch) -> Batch:
        """`batch`, made on the side stream, ready for the trainer's current
        stream: that stream waits for the side stream's work so far (the
        upload and the checks), and each tensor is recorded as used there."""
        if self.stream is None:
            return batch
        trainer = torch.cuda.current_stream(self.device)
        trainer.wait_stream(self.stream)
        for tensor in batch_tensors(batch):
            tensor.record_stream(trainer)
        return batch
