"""The end-to-end checker: its digest against hand-merged trajectories
(docs/semantics.md §8), its verdicts on made-up ledgers, and the ledgers the
producer and consumer clients write over a live broker."""
from __future__ import annotations

import asyncio
import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.common.checker import (
    CHOSEN_DEAD_REASONS,
    ON_RESTART_ABORT,
    ContentDigest,
    Ledger,
    LedgerReader,
    TurnRecord,
    check,
    delivered_digest,
    expected,
    read_records,
    turn_record,
)
from rollstream.common.trajectory import Trajectory, Turn


def hand_merged(prompt, tokens, log_probs, loss_mask, ids=None, offsets=None, full_log_probs=None,
                mask_log_probs=None) -> dict:
    arrays = {"prompt_tokens": np.array(prompt, np.int32), "tokens": np.array(tokens, np.int32),
              "log_probs": np.array(log_probs, np.float32), "loss_mask": np.array(loss_mask, np.uint8)}
    if ids is not None:
        arrays["mask_ids"], arrays["mask_offsets"] = np.array(ids, np.int32), np.array(offsets, np.int64)
    if full_log_probs is not None:
        arrays["full_log_probs"] = np.array(full_log_probs, np.float32)
    if mask_log_probs is not None:
        arrays["mask_log_probs"] = np.array(mask_log_probs, np.float32)
    return arrays


def sent(turns: list[Turn], prompt=(1, 2, 3)) -> tuple[str, list[TurnRecord]]:
    """The producer's side: the prompt digest and each turn's record."""
    digest = ContentDigest(np.array(prompt, np.int32))
    records = []
    for turn in turns:
        record, digest = turn_record(digest, turn)
        records.append(record)
    return ContentDigest(np.array(prompt, np.int32)).hexdigest(), records


EXAMPLE_6 = [Turn.build([10], [-0.1], supports=[[10, 4]], forced_tokens=[20, 21]),
             Turn.build([30], [-0.2], supports=[[30, 7, 8]])]


def test_the_digest_of_sent_turns_is_that_of_the_trajectory_merged_by_hand():
    """SEMANTICS example 6: forced tokens have log-prob 0, loss 0 and a singleton support."""
    prompt, records = sent(EXAMPLE_6)
    want = expected(prompt, records)
    merged = hand_merged([1, 2, 3], [10, 20, 21, 30], [-0.1, 0, 0, -0.2], [1, 0, 0, 1],
                         [10, 4, 20, 21, 30, 7, 8], [0, 2, 3, 4, 7])
    assert want.gap is None
    assert delivered_digest(merged) == want.digest
    for name, index, value in (("tokens", 1, 21), ("log_probs", 0, -0.11), ("loss_mask", 1, 1), ("mask_ids", 1, 5),
                               ("prompt_tokens", 0, 9)):
        broken = {key: array.copy() for key, array in merged.items()}
        broken[name][index] = value
        assert delivered_digest(broken) != want.digest, name
    moved = {key: array.copy() for key, array in merged.items()}
    moved["mask_offsets"] = np.array([0, 1, 3, 4, 7], np.int64)  # same ids, other supports
    assert delivered_digest(moved) != want.digest


def test_full_log_probs_are_vouched_for_and_a_trajectory_without_them_digests_as_before():
    """Forced tokens get full log-prob 0 as they get log-prob 0; a changed
    value or one left out is a different digest. Without them, a
    trajectory's digest is the one ledgers written before they existed hold."""
    prompt, records = sent(EXAMPLE_6)
    assert expected(prompt, records).digest == "fd992b3fe16ba848e8cb3e5b62961111"
    turns = [Turn.build([10], [-0.1], supports=[[10, 4]], forced_tokens=[20, 21], full_log_probs=[-0.3]),
             Turn.build([30], [-0.2], supports=[[30, 7, 8]], full_log_probs=[-0.4])]
    prompt, records = sent(turns)
    want = expected(prompt, records)
    merged = hand_merged([1, 2, 3], [10, 20, 21, 30], [-0.1, 0, 0, -0.2], [1, 0, 0, 1],
                         [10, 4, 20, 21, 30, 7, 8], [0, 2, 3, 4, 7], [-0.3, 0, 0, -0.4])
    assert records[0].carries == ("mask", "full_log_probs") and delivered_digest(merged) == want.digest
    changed = {**merged, "full_log_probs": np.array([-0.3, 0, 0, -0.41], np.float32)}
    assert delivered_digest(changed) != want.digest
    assert delivered_digest({k: v for k, v in merged.items() if k != "full_log_probs"}) != want.digest


def test_a_turn_without_full_log_probs_is_expected_as_a_replay_gap_naming_them():
    turns = [Turn.build([10], [-0.1], forced_tokens=[20], full_log_probs=[-0.3]), Turn.build([30], [-0.2])]
    prompt, records = sent(turns)
    want = expected(prompt, records)
    assert want.gap == (1, "full_log_probs")
    assert want.digest == delivered_digest(hand_merged([1, 2, 3], [10], [-0.1], [1], full_log_probs=[-0.3]))


def test_mask_log_probs_are_vouched_for_in_a_stream_of_their_own():
    """Each support id's log-prob, beside its id; a forced token's singleton
    gets 0 as its log-prob does. A changed value, two swapped within a
    support, or the array left out is a different digest; the same bytes as
    `full_log_probs` instead are too (a stream of its own). A trajectory
    without them digests as before they existed, with or without
    `full_log_probs` (what ledgers already written hold)."""
    prompt, records = sent(EXAMPLE_6)
    assert expected(prompt, records).digest == "fd992b3fe16ba848e8cb3e5b62961111"
    full_only = [Turn.build([10], [-0.1], supports=[[10, 4]], forced_tokens=[20, 21], full_log_probs=[-0.3]),
                 Turn.build([30], [-0.2], supports=[[30, 7, 8]], full_log_probs=[-0.4])]
    prompt, records = sent(full_only)
    assert expected(prompt, records).digest == "a49001f234bc825beece8e610ca4f92b"
    turns = [Turn.build([10], [-0.1], supports=[[10, 4]], forced_tokens=[20, 21], mask_log_probs=[-0.1, -2.5]),
             Turn.build([30], [-0.2], supports=[[30, 7, 8]], mask_log_probs=[-0.2, -1.75, -3.0])]
    prompt, records = sent(turns)
    want = expected(prompt, records)
    merged = hand_merged([1, 2, 3], [10, 20, 21, 30], [-0.1, 0, 0, -0.2], [1, 0, 0, 1], [10, 4, 20, 21, 30, 7, 8],
                         [0, 2, 3, 4, 7], mask_log_probs=[-0.1, -2.5, 0, 0, -0.2, -1.75, -3.0])
    assert records[0].carries == ("mask", "mask_log_probs") and delivered_digest(merged) == want.digest
    for values in ([-0.1, -2.5, 0, 0, -0.2, -1.75, -3.01], [-0.1, -2.5, 0, 0, -0.2, -3.0, -1.75],
                   [-0.1, -2.5, -1e-3, 0, -0.2, -1.75, -3.0]):
        assert delivered_digest({**merged, "mask_log_probs": np.array(values, np.float32)}) != want.digest, values
    assert delivered_digest({k: v for k, v in merged.items() if k != "mask_log_probs"}) != want.digest
    assert delivered_digest({**merged, "mask_log_probs": None}) != want.digest
    singletons = [Turn.build([10, 11], [-0.1, -0.2], supports=[[10], [11]], mask_log_probs=[-0.5, -0.25])]
    as_full = [Turn.build([10, 11], [-0.1, -0.2], supports=[[10], [11]], full_log_probs=[-0.5, -0.25])]
    assert expected(*sent(singletons)).digest != expected(*sent(as_full)).digest


def test_a_turn_without_mask_log_probs_is_expected_as_a_replay_gap_naming_them():
    """Its mask alone is not enough: the trajectory is cut after turn 0's
    sampled tokens, their supports and those supports' log-probs."""
    turns = [Turn.build([10], [-0.1], supports=[[10, 4]], forced_tokens=[20], mask_log_probs=[-0.1, -2.5]),
             Turn.build([30], [-0.2], supports=[[30]])]
    prompt, records = sent(turns)
    want = expected(prompt, records)
    assert records[1].carries == ("mask",) and want.gap == (1, "mask_log_probs")
    assert want.digest == delivered_digest(hand_merged([1, 2, 3], [10], [-0.1], [1], [10, 4], [0, 2],
                                                       mask_log_probs=[-0.1, -2.5]))


def test_a_replay_gap_expects_the_last_full_turn_without_its_trailing_forced_tokens():
    """SEMANTICS example 7: the aborted turn without a mask cuts the trajectory after turn 0's sampled tokens."""
    turns = [Turn.build([10], [-0.1], supports=[[10, 4]], forced_tokens=[20, 21]),
             Turn.build([30], [-0.2], status="aborted")]
    prompt, records = sent(turns)
    want = expected(prompt, records)
    assert want.gap == (1, "mask")
    assert want.digest == delivered_digest(hand_merged([1, 2, 3], [10], [-0.1], [1], [10, 4], [0, 2]))
    assert records[0].after_forced in want.shorter


def test_nothing_is_expected_after_a_terminal_turn():
    turns = [Turn.build([10], [-0.1], supports=[[10, 4]], status="truncated", forced_tokens=[20]),
             Turn.build([30], [-0.2], supports=[[30]])]
    prompt, records = sent(turns)
    want = expected(prompt, records)
    assert want.gap is None
    assert want.digest == delivered_digest(hand_merged([1, 2, 3], [10, 20], [-0.1, 0], [1, 0], [10, 4, 20], [0, 2, 3]))


supports_strategy = st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=4, unique=True), min_size=0, max_size=5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(supports_strategy, st.lists(st.integers(0, 50), max_size=3), st.booleans(), st.booleans()),
                min_size=1, max_size=4),
       st.sampled_from(["completed", "aborted"]), st.booleans(), st.booleans(), st.integers(1, 4))
def test_the_merge_engines_trajectory_has_the_digest_the_checker_expects(shapes, last_status, full, support_log_probs,
                                                                         without_them):
    """The checker models SEMANTICS independently; the library's merge must
    agree with it, the supports' log-probs (0.0 at forced tokens' singletons)
    and a gap at them (turn `without_them` lacks them) included."""
    turns = []
    for index, (supports, forced, keeps_mask, keeps_full) in enumerate(shapes):
        status = last_status if index == len(shapes) - 1 else "completed"
        tokens = [support[-1] for support in supports]
        has_mask = keeps_mask or index == 0
        has_full = full and (keeps_full or index == 0)
        has_support_log_probs = support_log_probs and has_mask and index != without_them
        turns.append(Turn.build(tokens, [-0.5] * len(tokens), supports=supports if has_mask else None,
                                forced_tokens=forced or None, status=status,
                                full_log_probs=[-1.0 - t / 64 for t in tokens] if has_full else None,
                                mask_log_probs=[-0.25 - i / 32 for s in supports for i in s]
                                if has_support_log_probs else None))
    prompt, records = sent(turns, prompt=(7, 8))
    traj = Trajectory("t", [7, 8])
    for turn in turns:
        traj.append_turn(turn)
    arrays = {"prompt_tokens": traj.prompt_tokens, "tokens": traj.tokens, "log_probs": traj.log_probs,
              "loss_mask": traj.loss_mask}
    if traj.mask is not None:
        arrays["mask_ids"], arrays["mask_offsets"] = traj.mask.ids, traj.mask.offsets
    if traj.full_log_probs is not None:
        arrays["full_log_probs"] = traj.full_log_probs
    if traj.mask_log_probs is not None:
        arrays["mask_log_probs"] = traj.mask_log_probs
    want = expected(prompt, records)
    assert delivered_digest(arrays) == want.digest
    assert (None if traj.gap is None else (traj.gap.turn, traj.gap.field)) == want.gap


def ledger_records(tmp_path, **kinds) -> list[dict]:
    ledger = Ledger(tmp_path / "x.jsonl")
    for kind, items in kinds.items():
        for fields in items:
            ledger.write(kind, **fields)
    ledger.close()
    return read_records([tmp_path])


def test_the_checker_names_each_kind_of_failure(tmp_path):
    prompt, records = sent(EXAMPLE_6)
    turns = [list(r) for r in records]
    good = expected(prompt, records).digest
    ids = ["ok", "lost", "dup", "partial", "corrupt", "dead", "gapless"]
    records_ = ledger_records(
        tmp_path,
        sent=[{"id": tid, "prompt": prompt, "turns": turns} for tid in ids],
        acked=[{"id": tid, "applied": True} for tid in ids],
        handed=[{"id": tid} for tid in ("ok", "dup", "dup", "partial", "corrupt", "gapless", "ok")],
        committed=[{"id": "ok", "digest": good, "gap": None},
                   {"id": "dup", "digest": good, "gap": None}, {"id": "dup", "digest": good, "gap": None},
                   {"id": "partial", "digest": records[0].after_forced, "gap": None},
                   {"id": "corrupt", "digest": "0" * 32, "gap": None},
                   {"id": "gapless", "digest": good, "gap": [1, "mask"]},
                   {"id": "stray", "digest": good, "gap": None}],
    )
    report = check(records_, [{"trajectory_id": "dead", "reason": "expired"}])
    assert (report.lost, report.duplicated, report.partial, report.unseen) == (["lost"], ["dup"], ["partial"], [])
    assert report.corrupted == ["corrupt", "gapless"]  # a gap the sent turns do not explain
    assert report.dead_lettered == {"expired": 1}
    assert report.acked == 7 and report.committed == 6
    assert report.redelivered == 1 and report.unacked_committed == 1
    assert report.line() == "lost 1  duplicated 1  partial 1  corrupted 2  unseen 0"
    assert not report.ok(["expired"])
    assert check(records_, [], broker_backlog=3).unseen == ["dead", "lost"]


def test_a_clean_run_is_ok_and_unapplied_acks_are_not_expected(tmp_path):
    prompt, records = sent(EXAMPLE_6)
    good = expected(prompt, records).digest
    records_ = ledger_records(
        tmp_path,
        sent=[{"id": "a", "prompt": prompt, "turns": [list(r) for r in records]},
              {"id": "b", "prompt": prompt, "turns": []}],
        acked=[{"id": "a", "applied": False, "duplicate": True}, {"id": "b", "applied": False, "reason": "unknown_trajectory"}],
        committed=[{"id": "a", "digest": good, "gap": None}],
    )
    report = check(records_, [{"trajectory_id": "a", "reason": "max_deliveries"}])
    assert report.ok() and report.acked == 1 and not report.dead_lettered
    assert report.summary()["committed"] == 1


def test_a_torn_last_line_is_skipped(tmp_path):
    ledger = Ledger(tmp_path / "p.jsonl")
    ledger.write("acked", id="a", applied=True)
    ledger.close()
    with open(tmp_path / "p.jsonl", "ab") as f:
        f.write(b'{"kind":"acked","id":"b","app')
    assert [r["id"] for r in read_records([tmp_path / "p.jsonl"])] == ["a"]
    follower = LedgerReader([tmp_path])
    assert [r["id"] for r in follower.read_new()] == ["a"]
    again = Ledger(tmp_path / "p.jsonl")  # a restarted writer: the torn line stays alone, its records count
    again.write("acked", id="c", applied=True)
    with open(tmp_path / "p.jsonl", "ab") as f:
        f.write(b'{"kind":"acked","id":"d"')  # being written: not yet a record
    assert [r["id"] for r in follower.read_new()] == ["c"]
    with open(tmp_path / "p.jsonl", "ab") as f:
        f.write(b',"applied":true}\n')
    assert [r["id"] for r in follower.read_new()] == ["d"]
    assert [r["id"] for r in read_records([tmp_path])] == ["a", "c", "d"]


def test_client_ledgers_over_a_live_broker_check_clean(tmp_path):
    """A producer's and a consumer's own ledgers, joined: every acked trajectory committed once, byte-equal."""
    from broker_process import BrokerProcess

    from rollstream.consumer import Consumer
    from rollstream.producer import AsyncProducer

    rng = np.random.default_rng(3)
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        async def produce():
            async with AsyncProducer(broker.producer, "ledgered", ledger=tmp_path / "producer.jsonl") as producer:
                for i in range(6):
                    traj = producer.trajectory(f"t{i}", rng.integers(0, 1000, 5, dtype=np.int32))
                    for index in range(3):
                        supports = [list(rng.choice(1000, size=3, replace=False)) for _ in range(4)]
                        aborted = i == 5 and index == 2
                        await traj.turn([s[0] for s in supports], -rng.exponential(size=4).astype(np.float32),
                                        supports=None if aborted else supports, forced_tokens=[9, 8] if index < 2 else None,
                                        status="aborted" if aborted else "completed")
                    await traj.end_and_wait(1.0)
        asyncio.run(produce())
        with Consumer(broker.consumer, batch_size=3, vocab_size=1000, ledger=tmp_path / "consumer.jsonl") as consumer:
            for _ in range(2):
                consumer.commit(consumer.next_batch(timeout=30))
            consumer.flush(30)
        records = read_records([tmp_path])
        report = check(records, broker.dead_letters(), broker_backlog=broker.status()["queued"])
    finally:
        broker.__exit__(None, None, None)
    assert report.summary() == {"acked": 6, "committed": 6, "lost": 0, "duplicated": 0, "partial": 0, "corrupted": 0,
                                "unseen": 0, "dead_lettered": {}, "given_up": {}, "redelivered": 0, "unacked_committed": 0,
                                "lineage_lost": 0, "lineage_duplicated": 0, "replayed": 0, "resumed_from_step": None,
                                "replayed_batches_identical": None, "prompts": 0, "prompts_skipped": 0,
                                "prompts_duplicated": 0, "prompts_unseen": 0}
    committed = [r for r in records if r["kind"] == "committed"]
    assert [r["gap"] for r in committed if r["id"] == "t5"] == [[2, "mask"]]
    assert json.loads((tmp_path / "producer.jsonl").read_text().splitlines()[0])["kind"] == "sent"


def lineage_run(tmp_path, second_step_2=("c", "d"), extra_second=(), abandoned_extra=()):
    """L1 trains steps 1-3 (a b | c d | e f, and `abandoned_extra` at step
    3), seals 1 and dies; L2 resumes from its checkpoint 1 and trains steps
    2-4 (`second_step_2` | e f | g h, and `extra_second` at step 4)."""
    prompt, records = sent(EXAMPLE_6)
    good = expected(prompt, records).digest
    ids = [*"abcdefgh", *abandoned_extra, *extra_second]

    def commits(lineage, step, tids):
        return [{"id": tid, "digest": good, "gap": None, "run": "R", "lineage": lineage, "step": step, "position": k}
                for k, tid in enumerate(tids)]

    return check(ledger_records(
        tmp_path,
        sent=[{"id": tid, "prompt": prompt, "turns": [list(r) for r in records]} for tid in dict.fromkeys(ids)],
        acked=[{"id": tid, "applied": True} for tid in dict.fromkeys(ids)],
        committed=[*commits("L1", 1, "ab"), *commits("L1", 2, "cd"), *commits("L1", 3, ["e", "f", *abandoned_extra]),
                   *commits("L2", 2, second_step_2), *commits("L2", 3, "ef"),
                   *commits("L2", 4, ["g", "h", *extra_second])],
        resumed=[{"run": "R", "lineage": "L2", "parent": "L1", "from_step": 1}],
    ))


def test_the_checker_follows_the_lineage_the_surviving_model_descends_from(tmp_path):
    report = lineage_run(tmp_path / "clean")
    assert report.counts() == {"lost": 0, "duplicated": 0, "partial": 0, "corrupted": 0, "unseen": 0}
    assert report.lineage() == {"lineage_lost": 0, "lineage_duplicated": 0, "replayed": 4, "resumed_from_step": 1,
                                "replayed_batches_identical": True}
    reordered = lineage_run(tmp_path / "reordered", second_step_2=("d", "c"))
    assert reordered.replayed_batches_identical is False and reordered.ok()
    twice = lineage_run(tmp_path / "twice", extra_second=("a",))  # trained into checkpoint 1 and again in L2
    assert twice.duplicated == ["a"] and twice.lineage()["lineage_duplicated"] == 1
    dropped = lineage_run(tmp_path / "dropped", abandoned_extra=("x",))  # trained only by the abandoned lineage
    assert dropped.lost == ["x"] and dropped.lineage()["lineage_lost"] == 1


def test_a_brokers_backlog_counts_its_queue_under_either_name():
    """A broker of this version sends `queued` beside its older name
    `ready` (the same count, counted once); an older broker sends `ready`
    alone, which must not read as an empty queue (its queued trajectories
    would be called lost)."""
    from rollstream.common.checker import broker_backlog

    assert broker_backlog({"queued": 3, "ready": 3, "leased": 1, "scoring": 2, "awaiting_group": 1}) == 7
    assert broker_backlog({"ready": 3, "leased": 1}) == 4
    assert broker_backlog({"queued": 0, "ready": 5}) == 0  # the new name wins where both are sent


def prompt_run(tmp_path, issued, trained=(), dead=(), given_up=(), taken_up=(), **kwargs):
    """A run issuing trajectories from prompts: `issued` is (prompt, sample,
    id) per `issued` record, each id but those `given_up` (aborted after a
    producer restart: issued, nothing more) is sent and acked, `trained` ids
    are committed once per mention, `dead` maps ids to their dead-letter
    reason."""
    prompt, records = sent(EXAMPLE_6)
    good = expected(prompt, records).digest
    ids = [tid for tid in dict.fromkeys(tid for _, _, tid in issued) if tid not in given_up]
    records_ = ledger_records(
        tmp_path,
        issued=[{"prompt": key, "sample": j, "id": tid, "producer": "p0"} for key, j, tid in issued],
        sent=[{"id": tid, "prompt": prompt, "turns": [list(r) for r in records]} for tid in ids],
        acked=[{"id": tid, "applied": True} for tid in ids],
        committed=[{"id": tid, "digest": good, "gap": None} for tid in trained],
        taken_up=[{"id": tid, "action": action, "producer": "p0"} for tid, action in taken_up],
    )
    return check(records_, [{"trajectory_id": tid, "reason": reason} for tid, reason in dict(dead).items()], **kwargs)


def test_a_prompt_a_restarted_producer_gave_up_by_its_on_restart_is_not_skipped(tmp_path):
    """`on_restart = abort` throws what was open away by the run's choice;
    continued or restarted ones must still be trained."""
    issued = [("1", 0, "1a"), ("2", 0, "2a"), ("3", 0, "3a")]
    report = prompt_run(tmp_path, issued, given_up=("1a", "2a", "3a"),
                        taken_up=[("1a", "abort"), ("2a", "continue"), ("3a", "restart")])
    assert report.prompts_skipped == ["2", "3"]


def test_trajectories_given_up_are_counted_by_reason_beside_a_clean_verdict(tmp_path):
    """A producer's give-ups (a refusal, a support overflow, `on_restart =
    abort`) are its choices: the report shows them by reason, and they fail
    nothing."""
    records_ = ledger_records(
        tmp_path,
        given_up=[{"id": "a", "reason": "turn 0 refused: out_of_vocab", "producer": "p0"},
                  {"id": "b", "reason": "turn 2 refused: out_of_vocab", "producer": "p0"},
                  {"id": "c", "reason": "turn 1 refused: out_of_vocab", "producer": "p0"},
                  {"id": "d", "reason": "support_overflow", "producer": "p0"}],
        taken_up=[{"id": "e", "action": "abort", "producer": "p0"}, {"id": "f", "action": "continue", "producer": "p0"}],
    )
    report = check(records_)
    assert report.given_up == {"turn 0 refused: out_of_vocab": 1, "turn 2 refused: out_of_vocab": 1,
                               "turn 1 refused: out_of_vocab": 1, "support_overflow": 1, ON_RESTART_ABORT: 1}
    assert report.summary()["given_up"] == dict(report.given_up) and report.ok()


def test_the_chosen_dead_reasons_are_the_runs_own():
    assert CHOSEN_DEAD_REASONS == {"filtered", "stale", "abandoned"}


def test_prompts_whose_group_never_trained_are_skipped_unless_the_run_dropped_them(tmp_path):
    issued = [("1", 0, "1a"), ("1", 1, "1b"),  # both trained: fine
              ("2", 0, "2a"), ("2", 1, "2b"),  # neither trained nor dead-lettered: skipped
              ("3", 0, "3a"),  # dead-lettered `expired` only: skipped (not the run's choice)
              ("4", 0, "4a"), ("4", 1, "4b"),  # one filtered, one expired: the run chose, not skipped
              ("5", 0, "5a"),  # dropped as stale: not skipped
              ("6", 0, "6a"),  # sampled by an abandoned lineage: not skipped
              ("7", 0, "7a"),  # dead-lettered `reward_expired`: skipped
              ("8", 0, "8a"), ("8", 1, "8b"), ("8", 2, "8c"),  # 8b given up after a restart: trained short, fine
              ("9", 0, "9a"), ("9", 0, "9a"), ("9", 1, "9b")]  # 9a issued again under its id (a restart): fine
    report = prompt_run(tmp_path, issued, trained=["1a", "1b", "8a", "8c", "9a", "9b"],
                        dead={"3a": "expired", "4a": "filtered:zero_variance", "4b": "expired", "5a": "stale",
                              "6a": "abandoned", "7a": "reward_expired"},
                        given_up=["8b"], prompts=["1", "2", "3", "4", "5", "6", "7", "8", "9", "10"])  # 10: never issued
    assert report.prompts == 10
    assert report.prompts_skipped == ["10", "2", "3", "7"]
    assert report.prompts_duplicated == [] and report.prompts_unseen == []
    assert not report.ok(["expired", "filtered:zero_variance", "stale", "abandoned", "reward_expired"])
    assert report.lost == ["2a", "2b"] and report.acked == 14  # 15 ids issued, 8b never sent
    assert report.counts() == {"lost": 2, "duplicated": 0, "partial": 0, "corrupted": 0, "unseen": 0,
                               "prompts_skipped": 4, "prompts_duplicated": 0, "prompts_unseen": 0}
    summary = report.summary()
    assert (summary["prompts"], summary["prompts_skipped"], summary["prompts_duplicated"]) == (10, 4, 0)


def test_a_sample_trained_under_two_ids_duplicates_its_prompt(tmp_path):
    issued = [("a", 0, "a0"), ("a", 0, "a0-again"), ("a", 1, "a1"),  # sample 0 issued twice, both trained
              ("b", 0, "b0"), ("b", 0, "b0"), ("b", 1, "b1"),  # the same id twice (a restart), trained once
              ("c", 0, "c0"), ("c", 0, "c0-again"),  # issued twice, only one of them trained
              ("d", 0, "d0")]  # one id trained twice
    report = prompt_run(tmp_path, issued, trained=["a0", "a0-again", "a1", "b0", "b1", "c0-again", "d0", "d0"])
    assert report.prompts == 4
    assert report.prompts_duplicated == ["a", "d"]
    assert report.prompts_skipped == [] and report.duplicated == ["d0"] and report.lost == ["c0"]
    assert report.line() == ("lost 1  duplicated 1  partial 0  corrupted 0  unseen 0  "
                             "prompts_skipped 0  prompts_duplicated 2  prompts_unseen 0")
    assert not report.ok()


def test_a_clean_prompt_run_is_ok(tmp_path):
    issued = [("0", 0, "x"), ("0", 1, "y"), ("0", 0, "x"), ("1", 0, "z")]
    report = prompt_run(tmp_path, issued, trained=["x", "y", "z"], prompts=["0", "1"])
    assert report.ok() and report.prompts == 2
    assert report.counts() == {"lost": 0, "duplicated": 0, "partial": 0, "corrupted": 0, "unseen": 0,
                               "prompts_skipped": 0, "prompts_duplicated": 0, "prompts_unseen": 0}


def test_without_prompts_the_report_reads_as_before(tmp_path):
    report = prompt_run(tmp_path, [], prompts=None)
    assert report.prompts == 0 and report.ok()
    assert report.counts() == {"lost": 0, "duplicated": 0, "partial": 0, "corrupted": 0, "unseen": 0}
    assert report.line() == "lost 0  duplicated 0  partial 0  corrupted 0  unseen 0"


def test_an_untrained_prompt_is_unseen_while_the_broker_has_a_backlog(tmp_path):
    issued = [("1", 0, "1a"), ("2", 0, "2a"), ("3", 0, "3a"), ("4", 0, "4a")]
    kwargs = {"trained": ["1a"], "dead": {"3a": "expired", "4a": "filtered"}, "prompts": ["1", "2", "3", "4", "5"]}
    waiting = prompt_run(tmp_path / "waiting", issued, broker_backlog=2, **kwargs)
    # 2a may still be delivered and 5 still issued; 3a is dead-lettered, so 3 can no longer come.
    assert (waiting.prompts_unseen, waiting.prompts_skipped) == (["2", "5"], ["3"])
    assert not waiting.ok(["expired", "filtered"])
    drained = prompt_run(tmp_path / "drained", issued, **kwargs)
    assert (drained.prompts_unseen, drained.prompts_skipped) == ([], ["2", "3", "5"])


def test_a_prompt_trained_only_by_an_abandoned_lineage_is_skipped(tmp_path):
    """L1 trains p's only trajectory at step 2 and q's at step 1, and dies; L2 resumes from checkpoint 1."""
    prompt, records = sent(EXAMPLE_6)
    good = expected(prompt, records).digest

    def commit(tid, lineage, step):
        return {"id": tid, "digest": good, "gap": None, "run": "R", "lineage": lineage, "step": step, "position": 0}

    records_ = ledger_records(
        tmp_path,
        issued=[{"prompt": "p", "sample": 0, "id": "p0", "producer": "x"},
                {"prompt": "q", "sample": 0, "id": "q0", "producer": "x"}],
        sent=[{"id": tid, "prompt": prompt, "turns": [list(r) for r in records]} for tid in ("p0", "q0")],
        acked=[{"id": tid, "applied": True} for tid in ("p0", "q0")],
        committed=[commit("q0", "L1", 1), commit("p0", "L1", 2), commit("x0", "L2", 2)],
        resumed=[{"run": "R", "lineage": "L2", "parent": "L1", "from_step": 1}],
    )
    report = check(records_)
    assert report.lost == ["p0"]
    assert report.prompts_skipped == ["p"] and report.prompts_duplicated == []
