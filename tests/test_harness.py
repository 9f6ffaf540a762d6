"""`Pipeline.drained` (rollstream.app.harness) against every moment a
producer may finish at, without processes, sockets or clocks.

The harness sees a run only through its node (producers exited or not, the
broker's status, its dead letters) and the ledgers it reads. A stand-in
node plays one producer with one trajectory left: at a chosen one of the
harness's looks (the `finish_at`-th) the producer sends it, writes its
`sent` and `acked` records, and exits, and from then on the broker's status
holds it queued. No trainer ever commits it, so the run is never drained:
whichever look the producer finishes at, `drained` must never say it is.
Once the trainer commits it, the run is drained.

The last test runs real processes: a node cut short stops what it started.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollstream.app.harness import LoopbackNode, Pipeline, Trainer
from rollstream.common.admin import AdminError
from rollstream.common.checker import check

ROUNDS = 6  # polls, each followed by `drained`: each looks at the node three times at least
LOOKS = 12  # the producer finishes at each of the first LOOKS looks in turn, all within the rounds
TID = "demo-producer-0-t0"
SENT = {"kind": "sent", "id": TID, "producer": "demo-producer-0", "prompt": "p", "turns": [["completed", [], "s", "f"]]}
ACKED = {"kind": "acked", "id": TID, "applied": True, "duplicate": False}
COMMITTED = {"kind": "committed", "id": TID, "digest": "f", "gap": None}  # the digest `SENT` makes (`checker.expected`)


def write(ledger: Path, *records: dict) -> None:
    with open(ledger, "a") as f:
        f.writelines(json.dumps(record) + "\n" for record in records)


class OneProducerLeft:
    """A node with one running producer and an idle broker; at its
    `finish_at`-th look (any method the harness calls on it) the producer
    sends its last trajectory, which the broker holds queued, writes its
    ledger records and exits. `commit()` plays the trainer committing it."""

    def __init__(self, work: Path, finish_at: int):
        self.work = work
        self.finish_at = finish_at
        self.looks = 0
        self.exited = False
        self.queued = 0
        self.producer_starts = 1
        self.answers = True  # False: the broker is too busy to answer an admin request in time
        self.broker = self  # `_status` asks `node.broker.poll()` whether the broker is alive
        self.admin = self

    def _look(self) -> None:
        self.looks += 1
        if self.looks == self.finish_at:
            (self.work / "ledgers").mkdir(exist_ok=True)
            write(self.work / "ledgers" / "producer-0.jsonl", SENT, ACKED)
            self.queued, self.exited = 1, True

    def commit(self) -> None:
        write(self.work / "ledgers" / "rank-0.jsonl", COMMITTED)
        self.queued = 0

    def poll(self) -> None:  # the broker process: alive
        self._look()

    def status(self) -> dict:
        self._look()
        return {"open": 0, "queued": self.queued, "leased": 0, "scoring": 0, "awaiting_group": 0, "unsealed": 0,
                "counters": {}}

    def dead_letters(self) -> list[dict]:
        self._look()
        if not self.answers:
            raise AdminError("no answer from the broker within 5.0 s", code="no_answer")
        return []

    @property
    def producers_exited(self) -> bool:
        self._look()
        return self.exited

    @property
    def producers_done(self) -> bool:
        self._look()
        return self.exited


def rounds(pipeline: Pipeline) -> list[bool]:
    """What `drained` said after each poll, as `Pipeline.run` asks it."""
    said = []
    for _ in range(ROUNDS):
        pipeline.poll()
        said.append(pipeline.drained)
    return said


@pytest.mark.parametrize("finish_at", range(1, LOOKS + 1))
def test_a_producer_finishing_at_any_look_never_leaves_its_acked_trajectory_behind_a_drained_run(tmp_path, finish_at):
    node = OneProducerLeft(tmp_path, finish_at)
    pipeline = Pipeline(node, dp_size=1, batch_size=1)
    said = rounds(pipeline)
    assert node.exited, f"the producer must finish within the rounds: expected it at look {finish_at}, got {node.looks} looks"
    pipeline.poll()
    report = check(pipeline.records, node.dead_letters(), broker_backlog=pipeline.backlog)
    assert not any(said), (f"drained must stay False while an acked trajectory is neither committed nor dead-lettered: "
                           f"expected no True with the producer finishing at look {finish_at}, got {said}; the checker "
                           f"reads {report.summary()}")


def test_a_run_whose_producer_finished_before_a_poll_and_whose_trajectory_was_committed_is_drained(tmp_path):
    node = OneProducerLeft(tmp_path, finish_at=1)
    pipeline = Pipeline(node, dp_size=1, batch_size=1)
    assert rounds(pipeline) == [False] * ROUNDS, "the acked trajectory is still queued at the broker: not drained"
    node.commit()
    pipeline.poll()
    assert pipeline.drained, (f"a run whose producers exited and whose acked trajectory was committed must be drained: "
                              f"got status {pipeline.status}, records {pipeline.records}")
    assert check(pipeline.records, node.dead_letters()).counts() == {"lost": 0, "duplicated": 0, "partial": 0,
                                                                     "corrupted": 0, "unseen": 0}


def test_a_broker_too_busy_to_list_its_dead_letters_leaves_the_run_undrained_until_it_answers(tmp_path):
    node = OneProducerLeft(tmp_path, finish_at=1)
    pipeline = Pipeline(node, dp_size=1, batch_size=1)
    pipeline.poll()  # the producer finishes at its first look
    node.commit()
    node.answers = False
    pipeline.poll()
    assert not pipeline.drained, "dead letters the broker did not list cannot be judged: not drained yet"
    node.answers = True
    pipeline.poll()
    assert pipeline.drained, f"once the broker lists its dead letters the run is drained: got status {pipeline.status}"


def test_a_node_left_by_an_exception_stops_the_trainer_ranks_it_started(tmp_path):
    """A demo cut short (an interrupt raises out of the node's block) must
    leave no trainer rank running after it, polling a broker that is gone."""
    ranks = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with LoopbackNode("rollstream-test-harness-", 1000) as node:
                trainer = Trainer(node, dp_size=2, batch_size=4, ledgers=tmp_path)
                trainer.start()
                ranks = list(trainer.ranks)
                raise KeyboardInterrupt
        assert [rank.poll() is not None for rank in ranks] == [True, True], "every rank must have exited"
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
