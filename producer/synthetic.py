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

Everything a trajectory draws (lengths, tokens, aborts, its reward) comes
from a stream of its own, seeded by the seed, its prompt and its sample
(`job_rng`): a daemon killed mid-trajectory continues it with the turns it
would have drawn anyway, so kills change no length.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import NamedTuple

import numpy as np

from rollstream.common.trajectory import Turn
from rollstream.common.versions import ordered_version

from .client import AsyncProducer, AsyncTrajectoryHandle, retrieve
from .resume import SCORING
from .sampler import Sampled, SamplingParams, ZipfLogits, sample
from .settings import ProducerSettings
from .source import ABORTED, AGAIN, ENDED, STOPPING, Job, Prompts, drive, job_rng

RETRY = "retried by the source"


def around(rng: np.random.Generator, mean: int) -> int:
    """A length uniform in [mean/2, 3*mean/2], at least 1."""
    return max(1, int(rng.integers(mean - mean // 2, mean + mean // 2 + 1)))


class Scripted(NamedTuple):
    """One turn of a synthetic trajectory, drawn before it is sent."""

    drawn: Sampled
    forced: np.ndarray | None
    aborted: bool

    def options(self) -> dict:
        """Its supports, forced tokens and status, as a turn takes them (an aborted turn comes without supports)."""
        return {"mask": None if self.aborted else self.drawn.mask, "forced_tokens": self.forced,
                "status": "aborted" if self.aborted else "completed"}

    def turn(self) -> Turn:
        return Turn.build(self.drawn.tokens, self.drawn.log_probs, **self.options())


class SyntheticSource:
    continues = AGAIN  # every draw of a trajectory comes from its own stream (`job_rng`)

    def __init__(self, settings: ProducerSettings, producer_id: str):
        self.settings = settings
        self.logits = ZipfLogits(settings.vocab_size, np.random.default_rng(settings.seed))
        self.params = SamplingParams(settings.temperature, settings.top_k, settings.top_p, settings.min_p)
        s = settings
        self.prompts = (Prompts.from_file(s.prompts) if s.prompts is not None else Prompts.drawn(
            lambda rng: rng.integers(0, s.vocab_size, size=around(rng, s.prompt_tokens), dtype=np.int32), s.seed,
            f"{s.prompt_tokens} tokens over {s.vocab_size} ids"))

    def turn(self, rng: np.random.Generator, tokens: int) -> Sampled:
        """One engine call: `tokens` positions sampled from synthetic logits."""
        logits, ids = self.logits(tokens, rng)
        return sample(logits, self.params, rng, ids)

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

    def reward(self, rng: np.random.Generator, version: str | None) -> float:
        """Continuous, or with `reward_levels` one of that many levels over
        [0, 1] whose top (1.0) grows likelier as the policy version rises
        (1 - 2^-(v+1): a policy learning), so more and more groups tie."""
        levels = self.settings.reward_levels
        if levels < 2:
            return float(rng.random())
        step = ordered_version(version) or 0
        if rng.random() < 1 - 0.5 ** (step + 1):
            return 1.0
        return float(rng.integers(levels - 1)) / (levels - 1)

    def script(self, rng: np.random.Generator) -> list[Scripted]:
        """Every turn of a trajectory, drawn in order from its stream: the
        same turns whenever it is produced, continued or not."""
        s = self.settings
        script = []
        for index in range(s.turns):
            drawn = self.turn(rng, around(rng, s.response_tokens))
            aborted = index > 0 and rng.random() < s.abort_rate
            last = aborted or index == s.turns - 1
            forced = None if last else rng.integers(0, s.vocab_size, size=around(rng, s.tool_tokens), dtype=np.int32)
            script.append(Scripted(drawn, forced, aborted))
            if aborted:
                break
        return script

    async def episode(self, traj: AsyncTrajectoryHandle, job: Job, stopping: asyncio.Event) -> str:
        s = self.settings
        rng = job_rng(s.seed, job)
        version = self.version()  # one version for what it samples now, as an engine samples it
        start = 0 if job.resumable is None else job.resumable.next_turn
        # A rollout retried after its first turn. Not a group member: an `abort` makes
        # a member leave its group (protocol.md, Groups), which may then become deliverable.
        if job.group_id is None and s.turns > 1 and rng.random() < s.retry_rate:
            retried = self.turn(rng, around(rng, s.response_tokens))
            if start == 0:
                retrieve(await traj.turn(retried.tokens, retried.log_probs, mask=retried.mask, weight_version=version))
            # discarded at the broker: the trajectory starts again from turn 0 (continued, what it held is discarded too)
            retrieve(await traj.abort(RETRY, again=True))
            start = 0
        script = self.script(rng)
        late = bool(s.late_reward_rate) and rng.random() < s.late_reward_rate  # no draw when off: seeded runs unchanged
        reward = self.reward(rng, version)
        traj.earlier([scripted.turn() for scripted in script[:start]])
        if job.resumable is not None and job.resumable.state == SCORING:
            retrieve(await traj.reward(reward))
            return ENDED
        for index in range(start, len(script)):
            if stopping.is_set():
                retrieve(await traj.abort(STOPPING))
                return ABORTED
            scripted = script[index]
            retrieve(await traj.turn(scripted.drawn.tokens, scripted.drawn.log_probs, weight_version=version,
                                     **scripted.options()))
            if scripted.forced is not None:
                await asyncio.sleep(s.tool_seconds)  # the tool's time; replies and other episodes go meanwhile
        if late:
            retrieve(await traj.end())  # scoring at the broker until the reward follows
            await asyncio.sleep(s.late_reward_seconds)
            retrieve(await traj.reward(reward))
        else:
            retrieve(await traj.end(reward))
        return ENDED

    async def run(self, producer: AsyncProducer, stopping: asyncio.Event) -> None:
        await drive(producer, self.settings, self.prompts, self.episode, stopping=stopping, continues=self.continues)
