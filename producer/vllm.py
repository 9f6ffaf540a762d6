"""The `vllm` source: drive a vLLM server started with
`--return-sampling-mask` through its token-in/token-out
`POST /inference/v1/generate` (the one endpoint that returns the sampling
mask; its OpenAI-compatible chat and completions replies carry none), and
stream its choices as turns. The episode is `EngineSource`'s.

vLLM's mask replay needs a bounded sampler: it refuses `top_k <= 0` and
`temperature <= 0`, so the source refuses them at start. Its log-probs are
over the processed (truncated) distribution, so `full_log_probs` has
nothing to carry here and is refused too. With `mask_log_probs` the server
must pair each support with its ids' log-probs
(`--return-sampling-mask-logprobs`, which takes `top_k <= 2048`, so a
larger one is refused at start); a reply without them aborts its
trajectory, as an unusable reply does."""
from __future__ import annotations

from typing import Any

import numpy as np

from rollstream.common.errors import InvalidInput, LocalProtocolError
from rollstream.common.ingest import VLLM_SUPPORT_LOG_PROBS_KEY, status_from_finish_reason, turn_from_vllm
from rollstream.common.trajectory import Turn

from .engine import EngineSource, post_json
from .settings import ProducerSettings
from .source import SourceSettingsError

GENERATE_PATH = "/inference/v1/generate"
MASK_LOG_PROBS_TOP_K = 2048  # the largest top_k vLLM takes with --return-sampling-mask-logprobs


class VLLMSource(EngineSource):
    engine = "vLLM"

    def __init__(self, settings: ProducerSettings, producer_id: str):
        if settings.top_k <= 0 or settings.temperature <= 0:
            raise SourceSettingsError(f"rule 'vLLM's sampling mask needs top_k > 0 and temperature > 0' not met: got "
                                      f"top_k {settings.top_k}, temperature {settings.temperature}")
        if settings.full_log_probs:
            raise SourceSettingsError("rule 'full_log_probs comes from an engine that reports them' not met: vLLM's "
                                      "mask replay reports log-probs over the processed distribution only "
                                      "(leave full_log_probs off with --source vllm)")
        if settings.mask_log_probs and settings.top_k > MASK_LOG_PROBS_TOP_K:
            raise SourceSettingsError(f"rule 'vLLM's paired sampling-mask log-probs need top_k <= {MASK_LOG_PROBS_TOP_K}' "
                                      f"not met: got top_k {settings.top_k} with mask_log_probs")
        super().__init__(settings, producer_id)
        self.url = settings.vllm_url.rstrip("/") + GENERATE_PATH

    def request(self, context: list[int], top_k: int) -> Any:
        s = self.settings
        body = {"token_ids": context, "sampling_params": {
            "temperature": s.temperature, "top_k": top_k, "top_p": s.top_p, "min_p": s.min_p,
            "max_tokens": s.response_tokens, "logprobs": 0}}  # logprobs 0: the sampled token's alone
        reply = post_json(self.url, body, s.vllm_timeout)
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise InvalidInput(f"rule 'a generate reply has choices' not met: got {reply!r:.200}")
        return choices[0]

    def sampled(self, reply: Any) -> tuple[list[int], str]:
        return reply["token_ids"], status_from_finish_reason(reply)

    def turn(self, reply: Any, forced_tokens: np.ndarray | None) -> Turn:
        if self.settings.mask_log_probs and reply.get("sampling_mask") is not None and \
                reply.get(VLLM_SUPPORT_LOG_PROBS_KEY) is None:  # else the turn would go without them, unnoticed
            raise LocalProtocolError("schema", f"rule 'with mask_log_probs a reply's sampling_mask comes with its "
                                               f"{VLLM_SUPPORT_LOG_PROBS_KEY}' not met: expected them, got none (start "
                                               f"vLLM with --return-sampling-mask-logprobs)")
        return turn_from_vllm(reply, forced_tokens=forced_tokens, vocab_size=self.settings.vocab_size)
