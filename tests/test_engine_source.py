"""The engine sources' overflow policy in process: a turn refused for a
support overflow is asked again with half the top-k (half the cap when
top-k was off or above it), `overflow_retries` times, then the trajectory is
given up as `support_overflow`; each is counted and the give-up written to
the ledger."""
import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from rollstream.common.errors import SupportOverflow
from rollstream.producer.engine import EngineSource
from rollstream.producer.metrics import ProducerMetrics
from rollstream.producer.settings import ProducerSettings
from rollstream.producer.source import ABORTED


class Refusing(EngineSource):
    """An engine that refuses its first `refusals` requests for an overflow
    (saying the cap when `says_cap`), then answers."""

    def __init__(self, settings, refusals, says_cap=None):
        super().__init__(settings, "p")
        self.refusals, self.says_cap, self.asked = refusals, says_cap, []

    def request(self, context, top_k):
        self.asked.append(top_k)
        if len(self.asked) <= self.refusals:
            raise SupportOverflow("too wide", support=5000, cap=self.says_cap)
        return "reply"

    def sampled(self, reply):
        return [], "completed"

    def turn(self, reply, forced_tokens):
        return None


class Ledger:
    def __init__(self):
        self.records = []

    def write(self, kind, **fields):
        self.records.append({"kind": kind, **fields})


def handle():
    """A trajectory handle that records its aborts (returned) and its sent turns (`sent`)."""
    aborts, sent = [], []

    def done():
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def abort(reason):
        aborts.append(reason)
        return done()

    async def send(turn):
        sent.append(turn)
        return done()

    producer = SimpleNamespace(metrics=ProducerMetrics(), ledger=Ledger(), producer_id="p")
    return SimpleNamespace(producer=producer, trajectory_id="t-1", abort=abort, send=send, sent=sent), aborts


def counted(traj, action):
    return traj.producer.metrics.support_overflows.values.get((action,), 0)


@pytest.mark.parametrize("top_k, says_cap, asked", [
    (20, None, [20, 8, 4]),   # above the settings' cap of 16: half the cap, then halves
    (-1, None, [-1, 8, 4]),   # top-k off: half the cap
    (12, None, [12, 6, 3]),   # under the cap: half of it
    (-1, 64, [-1, 32, 16]),   # the engine's own cap, when it says it, over the setting
])
def test_an_overflow_is_asked_again_with_half_the_top_k_until_it_fits(top_k, says_cap, asked):
    settings = ProducerSettings(top_k=top_k, overflow_retries=3, sampling_mask_cap=16, vocab_size=100)
    source = Refusing(settings, refusals=2, says_cap=says_cap)
    traj, aborts = handle()
    assert asyncio.run(source.call(traj, [1, 2])) == "reply"
    assert source.asked == asked and not aborts
    assert (counted(traj, "narrowed"), counted(traj, "gave_up")) == (2, 0)
    assert not traj.producer.ledger.records


@pytest.mark.parametrize("retries", [0, 2])
def test_past_its_retries_the_trajectory_is_given_up_as_support_overflow(retries, caplog):
    settings = ProducerSettings(top_k=20, overflow_retries=retries, sampling_mask_cap=16, vocab_size=100)
    source = Refusing(settings, refusals=retries + 1)
    traj, aborts = handle()
    assert asyncio.run(source.call(traj, [1, 2])) is None
    assert len(source.asked) == retries + 1 and aborts == ["support_overflow"]
    assert (counted(traj, "narrowed"), counted(traj, "gave_up")) == (retries, 1)
    assert traj.producer.ledger.records == [{"kind": "given_up", "id": "t-1", "reason": "support_overflow",
                                             "producer": "p"}]
    assert "support of 5000 ids outgrew the cap of 16; giving the trajectory up" in caplog.text


@pytest.mark.parametrize("asked, rule", [
    (dict(top_k=0), "vLLM's sampling mask needs top_k > 0 and temperature > 0"),
    (dict(full_log_probs=True), "full_log_probs comes from an engine that reports them"),
    (dict(mask_log_probs=True, top_k=2049), r"vLLM's paired sampling-mask log-probs need top_k <= 2048' not met: got "
                                            r"top_k 2049 with mask_log_probs"),
])
def test_the_vllm_source_refuses_at_start_what_vllm_cannot_report(asked, rule):
    from rollstream.producer.source import SourceSettingsError
    from rollstream.producer.vllm import VLLMSource

    settings = ProducerSettings(**{"top_k": 20, "vocab_size": 100, **asked})
    with pytest.raises(SourceSettingsError, match=f"rule '{rule}"):
        VLLMSource(settings, "p")
    VLLMSource(ProducerSettings(mask_log_probs=True, top_k=2048, vocab_size=100), "p")  # the largest top_k it takes


def test_a_vllm_reply_without_the_paired_log_probs_asked_for_aborts_its_trajectory(caplog):
    """With `mask_log_probs`, a reply from a server started without
    `--return-sampling-mask-logprobs` is refused naming the flag, and the
    episode aborts the trajectory and logs it, rather than sending turns
    without them."""
    from engines import FakeVLLM

    from rollstream.producer.source import Job
    from rollstream.producer.vllm import VLLMSource

    with FakeVLLM(100) as fake:
        settings = ProducerSettings(mask_log_probs=True, top_k=20, vocab_size=100, response_tokens=4, turns=2,
                                    vllm_url=fake.url)
        source = VLLMSource(settings, "p")
        traj, aborts = handle()
        job = Job("t-1", np.arange(6, dtype=np.int32), 0)
        assert asyncio.run(source.episode(traj, job, asyncio.Event())) == ABORTED
    assert len(fake.calls) == 1 and len(aborts) == 1 and not traj.sent
    flag = "start vLLM with --return-sampling-mask-logprobs"
    assert aborts[0].startswith("vLLM call failed: schema: rule 'with mask_log_probs a reply's sampling_mask comes with its "
                                "sampling_mask_logprobs' not met: expected them, got none") and flag in aborts[0]
    assert "the vLLM call failed; aborting the trajectory" in caplog.text
