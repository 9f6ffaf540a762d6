"""The `sglang` source: drive an SGLang-compatible HTTP `/generate` endpoint
with `return_sampling_mask` and stream its responses as turns.

Multi-turn comes from a small built-in tool environment (`EchoTool`): after
each completed turn but the last, the tool answers with an observation that
becomes the turn's forced tokens and is appended to the context of the next
request. A turn that is not `completed` ends the episode. Requests go out on
daemon threads (stdlib `urllib`), `concurrency` episodes at a time.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import urllib.request
from typing import Any, Mapping

import numpy as np

from rollstream.common.errors import InvalidInput
from rollstream.common.ingest import status_from_finish_reason

from .client import AsyncProducer, AsyncTrajectoryHandle
from .resume import SCORING, TERMINAL
from .settings import ProducerSettings
from .source import ABORTED, ENDED, PREFIX, STOPPING, Job, Prompts, drive, retrieve
from .synthetic import around

log = logging.getLogger("rollstream.producer")


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

    threading.Thread(target=work, name="rollstream-sglang-request", daemon=True).start()
    return await future


def output_ids(response: Mapping[str, Any]) -> list[int]:
    """The generated ids: `output_ids`, or the ids in
    `meta_info.output_token_logprobs` (`[logprob, id, text]` entries)."""
    if "output_ids" in response:
        return response["output_ids"]
    entries = response.get("meta_info", {}).get("output_token_logprobs")
    if entries is None:
        raise InvalidInput("SGLang response has neither output_ids nor meta_info.output_token_logprobs")
    return [entry[1] for entry in entries]


class SGLangSource:
    continues = PREFIX  # from the prompt and every token so far, which the next request's input is anyway

    def __init__(self, settings: ProducerSettings, producer_id: str):
        self.settings = settings
        self.tool = EchoTool(settings.vocab_size, settings.tool_tokens)
        self.url = settings.sglang_url.rstrip("/") + "/generate"
        self.sampling_params = {
            "temperature": settings.temperature,
            "top_k": settings.top_k,
            "top_p": settings.top_p,
            "min_p": settings.min_p,
            "max_new_tokens": settings.response_tokens,
        }
        s = settings
        self.prompts = (Prompts.from_file(s.prompts) if s.prompts is not None else Prompts.drawn(
            lambda rng: rng.integers(0, s.vocab_size - 2, size=around(rng, s.prompt_tokens), dtype=np.int32), s.seed,
            f"{s.prompt_tokens} tokens over {s.vocab_size - 2} ids"))

    def generate(self, input_ids: list[int]) -> dict:
        """One blocking `/generate` call."""
        body = json.dumps({"input_ids": input_ids, "sampling_params": self.sampling_params,
                           "return_sampling_mask": True}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.settings.sglang_timeout) as reply:
            response = json.loads(reply.read())
        return response[0] if isinstance(response, list) else response

    async def episode(self, traj: AsyncTrajectoryHandle, job: Job, stopping: asyncio.Event) -> str:
        context = [int(t) for t in job.prompt_tokens]
        status, start, forced = "completed", 0, None
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
                response = await in_daemon_thread(self.generate, context)
                ids, meta_info = output_ids(response), response["meta_info"]
                status = status_from_finish_reason(meta_info)
                last = status != "completed" or index == self.settings.turns - 1
                forced = None if last else self.tool.observe(np.asarray(ids, dtype=np.int32))
                retrieve(await traj.sglang(ids, meta_info, forced_tokens=forced))
            except (OSError, ValueError, KeyError, TypeError) as exc:  # unreachable server or unusable response
                log.warning("generate failed; aborting the trajectory",
                            extra={"trajectory_id": traj.trajectory_id, "url": self.url, "error": str(exc)})
                retrieve(await traj.abort(f"generate failed: {exc}"))
                return ABORTED
            if forced is None:  # the last turn
                break
            context += list(ids) + forced.tolist()
        retrieve(await traj.end(self.tool.reward(status)))
        return ENDED

    async def run(self, producer: AsyncProducer, stopping: asyncio.Event) -> None:
        await drive(producer, self.settings, self.prompts, self.episode, stopping=stopping, continues=self.continues)
