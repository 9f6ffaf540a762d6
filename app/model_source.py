"""The `model` source: rollouts from a torch language model
(`rollstream.app.tiny_lm`), registered with the producer daemon by the
`rollstream` command (`rollstream.producer.sources`). Each step's next-token logits go through the
producer's top-k/top-p/min-p sampler, so every sampled token comes with
the support the sampler could have drawn it from and its log-prob under
that truncated, renormalised distribution, as an engine reporting its
sampling mask does."""
from __future__ import annotations

import asyncio
import logging
import os

import numpy as np
import torch

from rollstream.common.errors import InvalidInput
from rollstream.common.mask import SamplingMask
from rollstream.producer.client import AsyncProducer, AsyncTrajectoryHandle
from rollstream.producer.resume import SCORING, TERMINAL
from rollstream.producer.sampler import Sampled, SamplingParams, sample
from rollstream.producer.settings import ProducerSettings
from rollstream.producer.source import (
    ABORTED,
    ENDED,
    PREFIX,
    STOPPING,
    Job,
    Prompts,
    SourceSettingsError,
    drive,
    job_rng,
    retrieve,
)

from .tiny_lm import TinyLM, load_weights

log = logging.getLogger("rollstream.producer")


@torch.no_grad()
def generate(model: TinyLM, contexts: np.ndarray, steps: int, params: SamplingParams,
             rng: np.random.Generator) -> list[Sampled]:
    """`steps` tokens after each row of `contexts` (`[rows, length]`, rows
    of one length: a group's members, which share a prompt and grow in
    step), one `Sampled` per row with its `steps` tokens, log-probs and
    supports."""
    contexts = np.asarray(contexts)
    if contexts.ndim != 2 or contexts.shape[1] == 0:
        raise InvalidInput(f"contexts must be [rows, length] with length >= 1, got shape {contexts.shape}")
    if steps < 1:
        raise InvalidInput(f"steps must be at least 1, got {steps}")
    sequence = torch.as_tensor(contexts, dtype=torch.int64)
    drawn = []
    for _ in range(steps):
        logits = model(sequence, last_only=True)[:, -1, :].double().numpy()
        step = sample(logits, params, rng)
        drawn.append(step)
        sequence = torch.cat([sequence, torch.as_tensor(step.tokens, dtype=torch.int64)[:, None]], dim=1)
    return _by_row(drawn, len(contexts))


def _by_row(drawn: list[Sampled], rows: int) -> list[Sampled]:
    """Per-step samples (one entry per row each) regrouped per row: the
    support ids reordered from (step, row) to (row, step) in one stable sort."""
    sizes = np.stack([np.diff(step.mask.offsets) for step in drawn], axis=1)  # [rows, steps]
    owner = np.concatenate([np.repeat(np.arange(rows), sizes[:, i]) for i in range(len(drawn))])
    by_row = np.argsort(owner, kind="stable")  # within a row the steps stay in order
    ids = np.concatenate([step.mask.ids for step in drawn])[by_row]
    support_log_probs = np.concatenate([step.mask_log_probs for step in drawn])[by_row]
    bounds = np.concatenate([[0], np.cumsum(sizes.sum(axis=1))])
    tokens = np.stack([step.tokens for step in drawn], axis=1)
    log_probs = np.stack([step.log_probs for step in drawn], axis=1)
    return [Sampled(tokens[r], log_probs[r], SamplingMask.from_lengths(ids[bounds[r]:bounds[r + 1]], sizes[r]),
                    support_log_probs[bounds[r]:bounds[r + 1]])
            for r in range(rows)]


class TargetEnvironment:
    """A toy environment: between turns a tool answers by echoing the
    first `tool_tokens` tokens of the turn (forced tokens), and the reward
    is the share of sampled tokens in a target set (every `TARGET_EVERY`-th
    id), which a policy-gradient step can raise within a minute."""

    TARGET_EVERY = 8

    def __init__(self, tool_tokens: int):
        self.tool_tokens = tool_tokens

    def answer(self, tokens: np.ndarray) -> np.ndarray:
        return np.resize(tokens, self.tool_tokens).astype(np.int32)

    @classmethod
    def reward(cls, sampled: np.ndarray) -> float:
        return float(np.mean(sampled % cls.TARGET_EVERY == 0)) if len(sampled) else 0.0


class WeightsWatch:
    """The model to sample with: built from `seed` until `path` exists,
    then loaded from it and reloaded whenever the file changes (the demo's
    stand-in for weight sync: a trainer writes the file, producers pick it
    up before their next trajectory). Checking costs one `stat`. A file that
    cannot be loaded is refused at start; later, it is logged and the
    weights in use are kept."""

    def __init__(self, path: str | None, seed: int):
        self.path = path
        self.model, self.version = TinyLM(seed=seed).eval(), f"seed-{seed}"
        self._seen: int | None = None
        try:
            self.refresh(strict=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same setting error
            raise SourceSettingsError(f"model_weights must be a TinyLM weights file, {path} is not: {exc}") from None

    def refresh(self, *, strict: bool = False) -> bool:
        """Reload if the file changed since last seen; True when it did."""
        if self.path is None:
            return False
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return False
        if stamp == self._seen:
            return False
        self._seen = stamp
        try:
            self.model, self.version = load_weights(self.path)
        except Exception as exc:  # noqa: BLE001 - a bad file must not stop the daemon
            if strict:
                raise
            log.error(f"weights file {self.path} cannot be loaded, keeping {self.version}: {exc}",
                      extra={"weight_version": self.version})
            return False
        log.info(f"weights {self.version} loaded from {self.path}", extra={"weight_version": self.version})
        return True


class ModelSource:
    """The `model` source: multi-turn rollouts sampled from a `TinyLM`,
    each turn tagged with the weight version it was sampled with. A
    trajectory handed back after a restart goes on from its prefix."""

    continues = PREFIX

    def __init__(self, settings: ProducerSettings, producer_id: str):
        # Episodes generate on threads of their own, each with a model this
        # small: one intra-op thread apiece, not a pool per call.
        torch.set_num_threads(1)
        self.settings = settings
        self.params = SamplingParams(settings.temperature, settings.top_k, settings.top_p, settings.min_p)
        self.weights = WeightsWatch(settings.model_weights, settings.seed)
        self.environment = TargetEnvironment(settings.tool_tokens)
        config = self.weights.model.config
        s = settings
        length = s.prompt_tokens + s.turns * s.response_tokens + (s.turns - 1) * s.tool_tokens
        if length > config.max_len:
            raise SourceSettingsError(f"prompt_tokens + turns * response_tokens + (turns - 1) * tool_tokens must be at most "
                             f"the model's max_len={config.max_len}, got {length}")
        if config.vocab_size > s.vocab_size:
            raise SourceSettingsError(f"vocab_size must be at least the model's {config.vocab_size}, got {s.vocab_size}")
        vocab = config.vocab_size
        self.prompts = (Prompts.from_file(s.prompts) if s.prompts is not None else Prompts.drawn(
            lambda rng: rng.integers(0, vocab, size=s.prompt_tokens, dtype=np.int32), s.seed,
            f"{s.prompt_tokens} tokens over {vocab} ids"))

    async def episode(self, traj: AsyncTrajectoryHandle, job: Job, stopping: asyncio.Event) -> str:
        s = self.settings
        rng = job_rng(s.seed, job)  # generation runs on a thread: an episode's own
        context, sampled, start = job.prompt_tokens, [], 0
        if job.resumable is not None and job.prefix is not None:
            context, sampled, start = job.prefix.context, [job.prefix.sampled_tokens()], job.resumable.next_turn
            if job.resumable.state == SCORING:
                retrieve(await traj.reward(self.environment.reward(sampled[0])))
                return ENDED
            if job.resumable.state == TERMINAL:
                start = s.turns
        self.weights.refresh()  # one version for what it samples now: a trainer replays each token with its weights
        model, version = self.weights.model, self.weights.version
        for index in range(start, s.turns):
            if stopping.is_set():
                retrieve(await traj.abort(STOPPING))
                return ABORTED
            drawn = (await asyncio.to_thread(generate, model, context[None], s.response_tokens, self.params, rng))[0]
            forced = None if index == s.turns - 1 else self.environment.answer(drawn.tokens)
            retrieve(await traj.turn(drawn.tokens, drawn.log_probs, mask=drawn.mask, forced_tokens=forced,
                                     mask_log_probs=drawn.mask_log_probs, mask_log_probs_normalized=True,
                                     weight_version=version))
            sampled.append(drawn.tokens)
            context = np.concatenate([context, drawn.tokens, *([] if forced is None else [forced])])
        retrieve(await traj.end(self.environment.reward(np.concatenate(sampled))))
        return ENDED

    async def run(self, producer: AsyncProducer, stopping: asyncio.Event) -> None:
        await drive(producer, self.settings, self.prompts, self.episode, stopping=stopping, continues=self.continues)
