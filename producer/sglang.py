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
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from rollstream.common.errors import InvalidInput
from rollstream.common.ingest import status_from_finish_reason

from .client import AsyncProducer, AsyncTrajectoryHandle
from .settings import ProducerSettings
from .source import ABORTED, ENDED, STOPPING, Job, drive, jobs, retrieve, run_id
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
    def __init__(self, settings: ProducerSettings, producer_id: str):
        self.settings = settings
        self.rng = np.random.default_rng(settings.seed)
        self.tool = EchoTool(settings.vocab_size, settings.tool_tokens)
        self.url = settings.sglang_url.rstrip("/") + "/generate"
        self.sampling_params = {
            "temperature": settings.temperature,
            "top_k": settings.top_k,
            "top_p": settings.top_p,
            "min_p": settings.min_p,
            "max_new_tokens": settings.response_tokens,
        }
        self.run_id = run_id(producer_id)

    def prompts(self):
        """Prompts of the `prompts` JSON-lines file (`{"input_ids": [...],
        "metadata": {...}}` per line, read once), else random ones forever."""
        if self.settings.prompts is None:
            while True:
                size = around(self.rng, self.settings.prompt_tokens)
                yield self.rng.integers(0, self.settings.vocab_size - 2, size=size, dtype=np.int32), None
        with Path(self.settings.prompts).open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    record = json.loads(line)
                    if not isinstance(record, dict) or "input_ids" not in record:
                        raise InvalidInput(f"{self.settings.prompts}:{number}: expected an object with input_ids")
                    yield np.asarray(record["input_ids"], dtype=np.int32), record.get("metadata")

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
        status = "completed"
        for index in range(self.settings.turns):
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
        s = self.settings
        await drive(producer, jobs(self.prompts(), self.run_id, s.group_size, s.trajectories), self.episode,
                    concurrency=s.concurrency, rate=s.rate, stopping=stopping)
