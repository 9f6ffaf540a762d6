"""What the engine sources (`sglang`, `vllm`) share: a small tool
environment, blocking HTTP calls on daemon threads, and the multi-turn
episode that drives an engine over them.

Multi-turn comes from a built-in toy tool (`EchoTool`): after each completed
turn but the last, the tool answers with an observation that becomes the
turn's forced tokens and is appended to the context of the next request. A
turn that is not `completed` ends the episode.

A request the engine refuses because a sampled token's support outgrew its
cap (`SupportOverflow`) is asked again with half the top-k, at most
`overflow_retries` times; then the trajectory is given up with the reason
`support_overflow`. Both are counted (`support_overflows{action}`) and
logged with the support size and the cap.
"""
from __future__ import annotations

import abc
import asyncio
import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from rollstream.common.errors import SupportOverflow
from rollstream.common.ingest import overflow_from_error
from rollstream.common.trajectory import Turn

from .client import AsyncProducer, AsyncTrajectoryHandle, retrieve
from .resume import SCORING, TERMINAL
from .settings import ProducerSettings
from .source import ABORTED, ENDED, PREFIX, STOPPING, Job, Prompts, drive
from .synthetic import around

log = logging.getLogger("rollstream.producer")

SUPPORT_OVERFLOW = "support_overflow"  # the abort reason of a trajectory given up at an overflow


class EchoTool:
    """A deterministic toy tool: its observation is `open_id`, the last
    `tokens` ids of the response in reverse order, then `close_id`
    (`open_id`/`close_id` default to the two highest ids of the vocabulary).
    The reward is 1.0 when the episode's last turn completed, else 0.0."""

    def __init__(self, vocab_size: int, tokens: int):
        self.open_id, self.close_id = vocab_size - 2, vocab_size - 1
        self.tokens = tokens

    def observe(self, response: np.ndarray) -> np.ndarray:
        echoed = response[::-1][: self.tokens]
        return np.concatenate([[self.open_id], echoed, [self.close_id]]).astype(np.int32)

    @staticmethod
    def reward(last_status: str) -> float:
        return 1.0 if last_status == "completed" else 0.0


async def in_daemon_thread(fn, *args):
    """`fn(*args)` on a daemon thread: a request still in flight at shutdown
    must not hold the process (the default executor's threads are joined)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def resolve(result, error):
        if future.done():  # the episode was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def work():
        try:
            result, error = fn(*args), None
        except Exception as exc:  # handed to the awaiting coroutine
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(resolve, result, error)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=work, name="rollstream-engine-request", daemon=True).start()
    return await future


def post_json(url: str, body: dict[str, Any], timeout: float) -> Any:
    """One blocking JSON POST. An HTTP 400 that reports a support overflow
    raises `SupportOverflow`; any other HTTP error an `HTTPError` whose
    message holds the body the server sent."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            overflow = overflow_from_error(json.loads(text)) if exc.code == 400 else None
        except ValueError:
            overflow = None
        if overflow is not None:
            raise overflow from None
        raise urllib.error.HTTPError(url, exc.code, f"{exc.reason}: {text[:300]}", exc.headers, None) from None


class EngineSource(abc.ABC):
    """A source driving an inference engine's HTTP API, one request per turn.
    An engine's source says how to ask (`request`) and how to read the
    reply (`sampled`, `turn`); the episode, the tool, the overflow policy
    and continuing after a restart are shared."""

    continues = PREFIX  # from the prompt and every token so far, which the next request's input is anyway
    engine = "engine"

    def __init__(self, settings: ProducerSettings, producer_id: str):
        self.settings = settings
        self.tool = EchoTool(settings.vocab_size, settings.tool_tokens)
        s = settings
        self.prompts = (Prompts.from_file(s.prompts) if s.prompts is not None else Prompts.drawn(
            lambda rng: rng.integers(0, s.vocab_size - 2, size=around(rng, s.prompt_tokens), dtype=np.int32), s.seed,
            f"{s.prompt_tokens} tokens over {s.vocab_size - 2} ids"))

    @abc.abstractmethod
    def request(self, context: list[int], top_k: int) -> Any:
        """One blocking engine call on `context` with the settings' sampler
        and `top_k`; returns the reply."""

    @abc.abstractmethod
    def sampled(self, reply: Any) -> tuple[list[int], str]:
        """The reply's sampled ids and turn status."""

    @abc.abstractmethod
    def turn(self, reply: Any, forced_tokens: np.ndarray | None) -> Turn:
        """The checked turn of the reply, followed by `forced_tokens`."""

    @staticmethod
    def narrower(top_k: int, cap: int) -> int:
        """The top-k of the next try after an overflow: half the one that
        overflowed, or half the cap when it was off or above the cap."""
        return max(1, (top_k if 0 < top_k <= cap else cap) // 2)

    async def call(self, traj: AsyncTrajectoryHandle, context: list[int]) -> Any | None:
        """The reply to one turn's request, asked again narrower after an
        overflow (`overflow_retries` times); None once the trajectory was
        given up for an overflow."""
        metrics, top_k = traj.producer.metrics, self.settings.top_k
        for attempt in range(self.settings.overflow_retries + 1):
            try:
                return await in_daemon_thread(self.request, context, top_k)
            except SupportOverflow as overflow:
                retry = attempt < self.settings.overflow_retries
                action = "narrowed" if retry else "gave_up"
                metrics.inc(metrics.support_overflows, action=action)
                cap = overflow.cap or self.settings.sampling_mask_cap  # the engine's, where its refusal says it
                narrowed = self.narrower(top_k, cap) if retry else None
                log.warning(f"support overflow: a sampled token's support of {overflow.support or 'unknown'} ids "
                            f"outgrew the cap of {cap}; "
                            + (f"asking again with top_k {narrowed}" if retry else "giving the trajectory up"),
                            extra={"trajectory_id": traj.trajectory_id, "support": overflow.support, "cap": cap,
                                   "top_k": top_k, "action": action})
                if narrowed is None:
                    break
                top_k = narrowed
        retrieve(await traj.abort(SUPPORT_OVERFLOW))
        producer = traj.producer
        if producer.ledger is not None:  # the run's choice: the checker does not count its prompt skipped
            producer.ledger.write("given_up", id=traj.trajectory_id, reason=SUPPORT_OVERFLOW, producer=producer.producer_id)
        return None

    async def episode(self, traj: AsyncTrajectoryHandle, job: Job, stopping: asyncio.Event) -> str:
        context = [int(t) for t in job.prompt_tokens]
        status, start = "completed", 0
        if job.resumable is not None and job.prefix is not None:  # the tool's state is the transcript: the context
            context, start, status = job.prefix.context.tolist(), job.resumable.next_turn, job.prefix.status or status
            if job.resumable.state == SCORING:
                retrieve(await traj.reward(self.tool.reward(status)))
                return ENDED
            if job.resumable.state == TERMINAL:
                start = self.settings.turns
        for index in range(start, self.settings.turns):
            if stopping.is_set():
                retrieve(await traj.abort(STOPPING))
                return ABORTED
            try:
                reply = await self.call(traj, context)
                if reply is None:
                    return ABORTED
                ids, status = self.sampled(reply)
                last = status != "completed" or index == self.settings.turns - 1
                forced = None if last else self.tool.observe(np.asarray(ids, dtype=np.int32))
                retrieve(await traj.send(self.turn(reply, forced)))
            except (OSError, ValueError, KeyError, TypeError) as exc:  # unreachable server or unusable reply
                log.warning(f"the {self.engine} call failed; aborting the trajectory",
                            extra={"trajectory_id": traj.trajectory_id, "error": str(exc)})
                retrieve(await traj.abort(f"{self.engine} call failed: {exc}"))
                return ABORTED
            if forced is None:  # the last turn
                break
            context += list(ids) + forced.tolist()
        retrieve(await traj.end(self.tool.reward(status)))
        return ENDED

    async def run(self, producer: AsyncProducer, stopping: asyncio.Event) -> None:
        await drive(producer, self.settings, self.prompts, self.episode, stopping=stopping, continues=self.continues)
