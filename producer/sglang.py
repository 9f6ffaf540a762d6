"""The `sglang` source: drive an SGLang server with `return_sampling_mask`
and stream its replies as turns, over `/generate` or, with
`sglang_api = chat`, over `/v1/chat/completions` with `return_meta_info`
(token in, token out: the context goes as `input_ids`, so the trajectory is
exactly the tokens the engine saw). With `full_log_probs` it also asks for
`return_logprob` (`logprobs` in chat) and carries each sampled token's
log-prob under the full distribution; with `mask_log_probs` it asks for
`sampling_logprobs_mode = support` and carries every support id's log-prob.
The episode is `EngineSource`'s."""
from __future__ import annotations

from typing import Any

import numpy as np

from rollstream.common.errors import InvalidInput
from rollstream.common.ingest import (
    overflow_from_error,
    sampled_ids,
    sglang_chat_output,
    status_from_finish_reason,
    turn_from_sglang,
)
from rollstream.common.trajectory import Turn

from .engine import EngineSource, post_json
from .settings import ProducerSettings

# What a prompt's chat turn says when the context goes as input_ids: SGLang's chat request needs messages, which
# input_ids supersede for the model's input.
PROMPT_MESSAGE = {"role": "user", "content": ""}


class SGLangSource(EngineSource):
    engine = "SGLang"

    def __init__(self, settings: ProducerSettings, producer_id: str):
        super().__init__(settings, producer_id)
        self.chat = settings.sglang_api == "chat"
        self.url = settings.sglang_url.rstrip("/") + ("/v1/chat/completions" if self.chat else "/generate")

    def request(self, context: list[int], top_k: int) -> Any:
        s = self.settings
        sampler = {"temperature": s.temperature, "top_k": top_k, "top_p": s.top_p, "min_p": s.min_p}
        if self.chat:
            body = {"messages": [PROMPT_MESSAGE], "input_ids": context, **sampler, "max_tokens": s.response_tokens,
                    "return_sampling_mask": True, "return_meta_info": True, "return_token_ids": True}
            if s.full_log_probs:
                body["logprobs"] = True
        else:
            body = {"input_ids": context, "sampling_params": {**sampler, "max_new_tokens": s.response_tokens},
                    "return_sampling_mask": True}
            if s.full_log_probs:
                body["return_logprob"] = True
        if s.mask_log_probs:
            body["sampling_logprobs_mode"] = "support"  # a list of log-probs per token, one per support id
        reply = post_json(self.url, body, s.sglang_timeout)
        reply = reply[0] if isinstance(reply, list) else reply
        if self.chat:
            prompt = reply["choices"][0].get("prompt_token_ids")
            if prompt is not None and prompt != context:
                raise InvalidInput("rule 'the engine's input is the context sent as input_ids' not met: expected "
                                   f"{len(context)} tokens ending {context[-8:]}, got {len(prompt)} ending {prompt[-8:]}")
        ids, meta_info = sglang_chat_output(reply) if self.chat else (sampled_ids(reply), reply["meta_info"])
        overflow = overflow_from_error(meta_info.get("finish_reason"))
        if overflow is not None:  # refused in a reply rather than with a 400
            raise overflow
        return ids, meta_info

    def sampled(self, reply: Any) -> tuple[list[int], str]:
        ids, meta_info = reply
        return ids, status_from_finish_reason(meta_info)

    def turn(self, reply: Any, forced_tokens: np.ndarray | None) -> Turn:
        ids, meta_info = reply
        return turn_from_sglang(ids, meta_info, forced_tokens=forced_tokens, vocab_size=self.settings.vocab_size)
