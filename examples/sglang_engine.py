"""Turns from SGLang's replies, without a server: a `/generate` reply asked
with return_sampling_mask and return_logprob whose weights changed
mid-request, and a `/v1/chat/completions` reply asked with return_meta_info,
merged into one trajectory; then the 400 SGLang answers when a support
outgrows its cap. The replies are literal, so what each field becomes can
be read off; the checks below hold the printed lines (and the README) to it.
With --url, one real request to that server instead.

    .venv/bin/python examples/sglang_engine.py [--url http://127.0.0.1:30000]
"""
import argparse
import json
import urllib.error
import urllib.request

import numpy as np

from rollstream.common import Trajectory, turn_from_sglang, turn_from_sglang_chat
from rollstream.common.errors import SupportOverflow
from rollstream.common.ingest import overflow_from_error

# POST /generate {"input_ids", "sampling_params", "return_sampling_mask": true, "return_logprob": true}:
GENERATE = {"text": " Paris", "output_ids": [40, 41, 42], "meta_info": {
    "output_token_sampling_mask": [[40, 3], [41], [42, 7, 9]],             # each sampled token's support
    "output_token_sampling_logprobs": [-0.4, 0.0, -1.1],                   # over that support
    "output_token_sampling_mask_length": 3,
    "output_token_logprobs": [[-0.9, 40, None], [-0.2, 41, None], [-1.6, 42, None]],  # over the whole vocabulary
    "finish_reason": {"type": "stop"},
    "weight_version": "8",                                                 # SGLang's newest
    "weight_versions": [{"version": "7", "start": 0, "end": 2}, {"version": "8", "start": 2, "end": 3}],
}}
# POST /v1/chat/completions with "return_meta_info": true, "return_sampling_mask": true, "logprobs": true:
CHAT = {"object": "chat.completion", "choices": [{
    "index": 0, "message": {"role": "assistant", "content": "!?"}, "finish_reason": "length",
    "response_token_ids": [50, 51],
    "meta_info": {"output_token_sampling_mask": [[50, 2], [51, 6]], "output_token_sampling_logprobs": [-0.7, -0.3],
                  "output_token_logprobs": [[-1.2, 50, "!"], [-0.5, 51, "?"]]},
}], "metadata": {"weight_version": "8"}}
# HTTP 400: a sampled token's support outgrew --sampling-mask-max-tokens before the token was committed.
REFUSAL = {"error": {"message": "sampling mask overflow: a sampled token's support of 1031 ids exceeds "
                                "--sampling-mask-max-tokens=1024; set top_k below the limit"}}


def from_replies() -> None:
    """The literal replies: what each field of theirs becomes."""
    first = turn_from_sglang(GENERATE["output_ids"], GENERATE["meta_info"], forced_tokens=[60, 61])
    print(first.weight_version, first.weight_version_spans)  # 7 (('7', 0, 2), ('8', 2, 3)): the first span's version
    print(first.full_log_probs)                               # [-0.9 -0.2 -1.6]
    chat = turn_from_sglang_chat(CHAT)                       # choices[0]: meta_info, response_token_ids; metadata
    print(chat.tokens, chat.status, chat.weight_version)      # [50 51] truncated 8

    traj = Trajectory("traj-0", prompt_tokens=[1, 2, 3])
    traj.append_turn(first)
    traj.append_turn(chat)
    print(traj.mask.ids, traj.mask.offsets)  # [40  3 41 42  7  9 60 61 50  2 51  6] [ 0  2  3  6  7  8 10 12]
    print(traj.full_log_probs)               # [-0.9 -0.2 -1.6  0.   0.  -1.2 -0.5]: 0 at the forced tokens
    print(traj.weight_versions, traj.weight_version_spans)  # ['7', '8'] [(('7', 0, 2), ('8', 2, 3)), (('8', 5, 7),)]

    overflow = overflow_from_error(REFUSAL)
    print(type(overflow).__name__, overflow.support, overflow.cap)  # SupportOverflow 1031 1024

    assert first.weight_version == "7" and first.weight_version_spans == (("7", 0, 2), ("8", 2, 3))
    assert first.full_log_probs.tolist() == np.float32([-0.9, -0.2, -1.6]).tolist()
    assert chat.tokens.tolist() == [50, 51] and chat.status == "truncated" and chat.weight_version == "8"
    assert traj.tokens.tolist() == [40, 41, 42, 60, 61, 50, 51] and traj.status == "truncated"
    # The supports arrive byte-equal: the engine's ids in its order, then the forced tokens' singletons.
    assert traj.mask.ids.tolist() == [40, 3, 41, 42, 7, 9, 60, 61, 50, 2, 51, 6]
    assert traj.mask.offsets.tolist() == [0, 2, 3, 6, 7, 8, 10, 12]
    assert traj.full_log_probs.tolist() == np.float32([-0.9, -0.2, -1.6, 0, 0, -1.2, -0.5]).tolist()
    assert traj.weight_versions == ["7", "8"]
    assert traj.weight_version_spans == [(("7", 0, 2), ("8", 2, 3)), (("8", 5, 7),)]
    assert isinstance(overflow, SupportOverflow) and (overflow.support, overflow.cap) == (1031, 1024)
    print(f"ok: {traj.turns} turns, {len(traj.tokens)} response tokens, versions {traj.weight_versions}")


def from_server(url: str) -> None:
    """One real `/generate` request; a support overflow raises `SupportOverflow`."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "top_k": 20},
            "return_sampling_mask": True, "return_logprob": True}
    request = urllib.request.Request(f"{url.rstrip('/')}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            reply = json.load(answer)
    except urllib.error.HTTPError as error:
        overflow = overflow_from_error(json.loads(error.read())) if error.code == 400 else None
        if overflow is None:
            raise
        raise overflow from error
    turn = turn_from_sglang(reply["output_ids"], reply["meta_info"])
    print(turn.tokens, turn.status, turn.weight_version, turn.weight_version_spans)
    print(turn.mask.support_sizes, turn.log_probs, turn.full_log_probs)
    print(f"ok: {len(turn.tokens)} tokens from {url}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Turns from SGLang replies, literal or from a server.")
    parser.add_argument("--url", help="an SGLang server's base URL: POST one /generate request to it")
    url = parser.parse_args().url
    if url:
        from_server(url)
    else:
        from_replies()
