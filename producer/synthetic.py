"""The `synthetic` source: agentic multi-turn rollouts for load and demos.

Each turn's tokens are drawn by the real top-k/top-p/min-p sampler over
Zipf-like logits, so supports have the sizes real truncation gives; tool
output between turns is forced tokens; `group_size` samples share a prompt;
with `abort_rate`, a later turn is sometimes `aborted` without its supports,
as an engine abort returns, which the broker records as a replay gap; with
`retry_rate`, a trajectory outside a group is sometimes discarded (`abort`)
after its first turn and produced again from turn 0, as a rollout retried
after a failure. With `version_file` its turns carry the trainer's policy
version as the trainer labels it (`12`, `e1:12`; read as each trajectory
starts), with `reward_levels`
rewards can tie within a group, and with `late_reward_rate` a trajectory
sometimes ends without its reward, which follows later, as a slow verifier's.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from rollstream.common.versions import ordered_version

from .client import AsyncProducer, AsyncTrajectoryHandle
from .sampler import SamplingParams, ZipfLogits, sample
from .settings import ProducerSettings
from .source import ABORTED, ENDED, STOPPING, Job, drive, jobs, retrieve, run_id

RETRY = "retried by the source"


def around(rng: np.random.Generator, mean: int) -> int:
    """A length uniform in [mean/2, 3*mean/2], at least 1."""
    return max(1, int(rng.integers(mean - mean // 2, mean + mean // 2 + 1)))


class SyntheticSource:
    def __init__(self, settings: ProducerSettings, producer_id: str):
        self.settings = settings
        self.rng = np.random.default_rng(settings.seed)
        self.logits = ZipfLogits(settings.vocab_size, self.rng)
        self.params = SamplingParams(settings.temperature, settings.top_k, settings.top_p, settings.min_p)
        self.run_id = run_id(producer_id)

    def prompts(self):
        s = self.settings
        while True:
            yield self.rng.integers(0, s.vocab_size, size=around(self.rng, s.prompt_tokens), dtype=np.int32), None

    def turn(self, tokens: int):
        """One engine call: `tokens` positions sampled from synthetic logits."""
        logits, ids = self.logits(tokens)
        return sample(logits, self.params, self.rng, ids)

    def version(self) -> str | None:
        """The `weight_version` the trainer labels its weights with now
        (`12`, or `e1:12` after a resume), when a version file is set:
        reading it is how this source reloads the trainer's weights."""
        if self.settings.version_file is None:
            return None
        try:
            label = Path(self.settings.version_file).read_text().strip()
        except FileNotFoundError:  # not written yet: the initial weights
            return "0"
        return label if ordered_version(label) is not None else "0"  # (being replaced: the initial weights)

    def reward(self, version: str | None) -> float:
        """Continuous, or with `reward_levels` one of that many levels over
        [0, 1] whose top (1.0) grows likelier as the policy version rises
        (1 - 2^-(v+1): a policy learning), so more and more groups tie."""
        levels = self.settings.reward_levels
        if levels < 2:
            return float(self.rng.random())
        step = ordered_version(version) or 0
        if self.rng.random() < 1 - 0.5 ** (step + 1):
            return 1.0
        return float(self.rng.integers(levels - 1)) / (levels - 1)

    async def episode(self, traj: AsyncTrajectoryHandle, job: Job, stopping: asyncio.Event) -> str:
        s = self.settings
        version = self.version()  # one version for the whole trajectory, as an engine samples it
        # A rollout retried after its first turn. Not a group member: an `abort` makes
        # a member leave its group (protocol.md, Groups), which may then become deliverable.
        if job.group_id is None and s.turns > 1 and self.rng.random() < s.retry_rate:
            drawn = self.turn(around(self.rng, s.response_tokens))
            retrieve(await traj.turn(drawn.tokens, drawn.log_probs, mask=drawn.mask, weight_version=version))
            retrieve(await traj.abort(RETRY))  # discarded at the broker: the trajectory starts again from turn 0
        for index in range(s.turns):
            if stopping.is_set():
                retrieve(await traj.abort(STOPPING))
                return ABORTED
            drawn = self.turn(around(self.rng, s.response_tokens))
            aborted = index > 0 and self.rng.random() < s.abort_rate
            last = aborted or index == s.turns - 1
            forced = None if last else self.rng.integers(0, s.vocab_size, size=around(self.rng, s.tool_tokens),
                                                         dtype=np.int32)
            retrieve(await traj.turn(drawn.tokens, drawn.log_probs, mask=None if aborted else drawn.mask,
                                     forced_tokens=forced, status="aborted" if aborted else "completed",
                                     weight_version=version))
            if aborted:
                break
            await asyncio.sleep(0 if last else s.tool_seconds)  # the tool's time; replies and other episodes go meanwhile
        reward = self.reward(version)
        if s.late_reward_rate and self.rng.random() < s.late_reward_rate:  # no draw when off: seeded runs unchanged
            retrieve(await traj.end())  # scoring at the broker until the reward follows
            await asyncio.sleep(s.late_reward_seconds)
            retrieve(await traj.reward(reward))
        else:
            retrieve(await traj.end(reward))
        return ENDED

    async def run(self, producer: AsyncProducer, stopping: asyncio.Event) -> None:
        s = self.settings
        await drive(producer, jobs(self.prompts(), self.run_id, s.group_size, s.trajectories), self.episode,
                    concurrency=s.concurrency, rate=s.rate, stopping=stopping)

