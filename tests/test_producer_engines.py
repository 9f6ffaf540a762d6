"""The producer daemon's engine sources end to end against the stand-ins of
tests/engines.py: `--source vllm`, `--source sglang --sglang-api chat`, each
with and without every support id's log-prob (`--mask-log-probs`), and
support overflows (a 400 or an abort in the reply) that give a trajectory
up or narrow its sampler; a broker and a consumer in between, and the
end-to-end checker reading the producer's and the consumer's ledgers."""
import subprocess
import sys

import numpy as np
import pytest
from broker_process import BrokerProcess
from engines import FakeSGLang, FakeVLLM, episode_turns

from rollstream.common.checker import check, read_records
from rollstream.consumer import Consumer

VOCAB = 1000
TRAJECTORIES = 6


def run_daemon(broker, work, *source):
    command = [sys.executable, "-m", "rollstream.app.cli", "producer", *source, "--broker-endpoint", broker.producer,
               "--metrics-port", "0", "--producer-id", "engine", "--ledger", str(work / "producer.jsonl"),
               "--trajectories", str(TRAJECTORIES), "--group-size", "2", "--turns", "3", "--response-tokens", "4",
               "--tool-tokens", "2", "--prompt-tokens", "6", "--vocab-size", str(VOCAB), "--concurrency", "2"]
    with open(work / "producer.log", "wb") as log:
        assert subprocess.run(command, stdout=subprocess.DEVNULL, stderr=log, timeout=180).returncode == 0, \
            (work / "producer.log").read_text()
    return (work / "producer.log").read_text()


def consume_all(broker, work):
    """Every trajectory the broker holds, consumed and committed one at a
    time with a ledger; then the checker's report."""
    delivered = []
    with Consumer(broker.consumer, batch_size=1, vocab_size=VOCAB, ledger=work / "consumer.jsonl") as consumer:
        for _ in range(broker.status()["queued"]):
            batch = consumer.next_batch(timeout=60)
            delivered.append(batch)
            consumer.commit(batch)
        consumer.flush(60)
    status = broker.status()
    return delivered, check(read_records([work]), broker.dead_letters(), broker_backlog=status["queued"])


def expected_arrays(fake, batch):
    """A delivered one-trajectory batch's mask ids, full log-probs and
    per-support log-probs (when the engine sent them) as the engine's calls
    give them: each turn's supports and log-probs, then singletons and 0.0
    for the tool's forced tokens."""
    prompt_length = int(batch.prompt_lengths[0])
    prompt = batch.tokens[:prompt_length].tolist()
    turns = episode_turns(fake.calls, prompt, prompt + batch.response_tokens.tolist())
    ids = [t for turn in turns for t in [*(i for s in turn["supports"] for i in s), *turn["forced"]]]
    full = [x for turn in turns for x in [*turn["full_log_probs"], *[0.0] * len(turn["forced"])]]
    paired = [x for turn in turns for x in [*(x for row in turn["support_log_probs"] or () for x in row),
                                            *[0.0] * len(turn["forced"])]]
    return turns, np.asarray(ids, "<i4").tobytes(), np.asarray(full, "<f4").tobytes(), np.asarray(paired, "<f4").tobytes()


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "vllm-support", "sglang-chat", "sglang-support"])
def test_an_engine_source_runs_end_to_end_and_the_checker_reads_zero(tmp_path, engine):
    """`-support`: the engine also sent every support id's log-prob
    (`--mask-log-probs`; vLLM started with `--return-sampling-mask-logprobs`),
    which the turns carry said renormalised, so the broker holds each to the
    sum rule, and the trainer gets them byte-equal to the engine's."""
    work = tmp_path / "work"
    work.mkdir()
    vllm, support = engine.startswith("vllm"), engine.endswith("-support")
    fake = FakeVLLM(VOCAB, seed=20, sampling_mask_logprobs=support) if vllm else FakeSGLang(VOCAB, seed=20)
    flag = ["--mask-log-probs", str(support).lower()]
    source = (["--source", "vllm", "--vllm-url", fake.url, *flag] if vllm else
              ["--source", "sglang", "--sglang-api", "chat", "--sglang-url", fake.url, "--full-log-probs", "true", *flag])
    with fake, BrokerProcess(tmp_path / "broker", vocab_size=VOCAB) as broker:
        run_daemon(broker, work, *source)
        delivered, report = consume_all(broker, work)
    assert report.ok(), report
    assert report.committed == len(delivered) == TRAJECTORIES and not fake.refused
    assert {call["support_log_probs"] is not None for call in fake.calls} == {support}
    used = 0
    for batch in delivered:
        turns, ids, full, paired = expected_arrays(fake, batch)
        used += len(turns)
        assert turns and batch.mask_ids.numpy().tobytes() == ids  # the supports, byte-equal to the engine's
        if vllm:
            assert batch.full_log_probs is None
        else:
            assert batch.full_log_probs.numpy().tobytes() == full
        if support:  # the engine's rows, byte-equal, then 0.0 for each forced token's singleton
            assert batch.mask_log_probs.numpy().tobytes() == paired
        else:
            assert batch.mask_log_probs is None
    assert used == len(fake.calls)  # every engine call became a turn


@pytest.mark.slow
@pytest.mark.parametrize("form", ["400", "status"])
def test_an_overflow_gives_the_trajectory_up_as_support_overflow_and_the_checker_reads_zero(tmp_path, form):
    work = tmp_path / "work"
    work.mkdir()
    with FakeSGLang(VOCAB, seed=20, cap=16, overflow_share=0.3, overflow_as=form) as fake, \
            BrokerProcess(tmp_path / "broker", vocab_size=VOCAB) as broker:
        log = run_daemon(broker, work, "--source", "sglang", "--sglang-url", fake.url, "--top-k", "20",
                         "--sampling-mask-cap", "16")
        delivered, report = consume_all(broker, work)
    assert fake.refused, "the seed was chosen so that some requests overflow"
    assert report.ok(), report
    assert len(delivered) == TRAJECTORIES - len(fake.refused)  # each overflow gave its trajectory up
    given_up = [r for r in read_records([work / "producer.jsonl"]) if r["kind"] == "given_up"]
    assert len(given_up) == len(fake.refused) and {r["reason"] for r in given_up} == {"support_overflow"}
    for refused in fake.refused:
        assert f"support of {refused['support']} ids outgrew the cap of 16; giving the trajectory up" in log


@pytest.mark.slow
def test_with_retries_an_overflowing_turn_is_asked_again_narrower_and_nothing_is_given_up(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    with FakeSGLang(VOCAB, seed=20, cap=16, overflow_share=0.3) as fake, \
            BrokerProcess(tmp_path / "broker", vocab_size=VOCAB) as broker:
        log = run_daemon(broker, work, "--source", "sglang", "--sglang-url", fake.url, "--top-k", "20",
                         "--overflow-retries", "1")
        delivered, report = consume_all(broker, work)
    assert fake.refused and report.ok(), report
    assert len(delivered) == TRAJECTORIES and "asking again with top_k 8" in log
    assert not [r for r in read_records([work / "producer.jsonl"]) if r["kind"] == "given_up"]
