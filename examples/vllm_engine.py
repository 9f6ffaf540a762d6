"""Turns from vLLM started with --return-sampling-mask, without a server: one
JSON choice of its token-in/token-out `/inference/v1/generate` (and one with
the support log-probs --return-sampling-mask-logprobs pairs the mask with),
and an in-process `CompletionOutput` whose mask comes as id lists, as CSR
and as the engine's packed bitset, all three giving the same supports;
merged into one trajectory. The replies are literal, so what each field becomes can be
read off; the checks below hold the printed lines (and the README) to it.
With --url, one real request to that server instead.

    .venv/bin/python examples/vllm_engine.py [--url http://127.0.0.1:8000]
"""
import argparse
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollstream.common import Trajectory, turn_from_vllm
from rollstream.common.ingest import overflow_from_error

VOCAB = 64

# One choice of POST /inference/v1/generate {"token_ids", "sampling_params": {..., "logprobs": 0}}:
CHOICE = {"index": 0, "finish_reason": "stop", "token_ids": [40, 41, 42],
          "logprobs": {"content": [{"token_id": 40, "logprob": -0.4}, {"token_id": 41, "logprob": 0.0},
                                   {"token_id": 42, "logprob": -1.1}]},  # over the processed (truncated) distribution
          "sampling_mask": [[40, 3], [41], [42, 7, 9]],                  # each sampled token's support
          "weight_versions": [{"version": "7", "start": 0, "end": 2}, {"version": "8", "start": 2, "end": 3}]}
# Started also with --return-sampling-mask-logprobs (top_k <= 2048): each support's ids' log-probs, renormalised over it,
# in its order (probabilities 3/4 1/4, 1, 1/2 1/4 1/4); asked without logprobs, the sampled ids' entries are the tokens'.
PAIRED = dict(CHOICE, logprobs=None, sampling_mask_logprobs=[[-0.2877, -1.3863], [0.0], [-0.6931, -1.3863, -1.3863]])


# The fields of vLLM's output objects that a turn is built from.
@dataclass
class Logprob:
    logprob: float


@dataclass
class SupportLists:  # vLLM's SamplingMask: one id list per token
    token_ids: list[list[int]]


@dataclass
class CsrSupports:  # its first release: the ids flat, each token's start offset and the end
    token_ids: list[int]
    offsets: list[int]


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str
    sampling_mask: Any


def bitset(supports: list[list[int]]) -> np.ndarray:
    """The engine's packed form: uint8 rows of ceil(V / 8) bytes, id j at bit j % 8 of byte j // 8."""
    dense = np.zeros((len(supports), -(-VOCAB // 8) * 8), np.uint8)
    for row, support in enumerate(supports):
        dense[row, support] = 1
    return np.packbits(dense, axis=1, bitorder="little")


def from_replies() -> None:
    """The literal replies: what each field of theirs becomes."""
    first = turn_from_vllm(CHOICE, forced_tokens=[60, 61])
    print(first.mask[2], first.weight_version, first.weight_version_spans)  # [42  7  9] 7 (('7', 0, 2), ('8', 2, 3))
    paired = turn_from_vllm(PAIRED)
    print(paired.mask_log_probs, paired.log_probs)  # [-0.2877 -1.3863  0.     -0.6931 -1.3863 -1.3863] [-0.2877  0.     -0.6931]

    supports = [[50, 2], [51, 6, 5]]
    masks = [SupportLists(supports), CsrSupports([50, 2, 51, 6, 5], [0, 2, 5]), bitset(supports)]
    outputs = [CompletionOutput([50, 51], [{50: Logprob(-0.7)}, {51: Logprob(-0.3)}], "length", mask)
               for mask in masks]
    lists, csr, bits = (turn_from_vllm(output, weight_version="8") for output in outputs)  # in process: the caller's version
    print(lists.mask[1], csr.mask[1], bits.mask[1])  # [51  6  5] [51  6  5] [ 5  6 51]: the bitset's in increasing order

    traj = Trajectory("traj-0", prompt_tokens=[1, 2, 3])
    traj.append_turn(first)
    traj.append_turn(bits)
    print(traj.mask.ids, traj.mask.offsets)  # [40  3 41 42  7  9 60 61  2 50  5  6 51] [ 0  2  3  6  7  8 10 13]
    print(traj.log_probs, traj.status)       # [-0.4  0.  -1.1  0.   0.  -0.7 -0.3] truncated
    print(traj.weight_versions, traj.weight_version_spans)  # ['7', '8'] [(('7', 0, 2), ('8', 2, 3)), (('8', 5, 7),)]

    assert first.mask[2].tolist() == [42, 7, 9] and first.weight_version == "7"
    assert first.weight_version_spans == (("7", 0, 2), ("8", 2, 3))
    assert paired.mask_log_probs.tolist() == np.float32([-0.2877, -1.3863, 0, -0.6931, -1.3863, -1.3863]).tolist()
    assert paired.mask_log_probs_normalized and paired.log_probs.tolist() == np.float32([-0.2877, 0, -0.6931]).tolist()
    assert all([set(t.mask[k].tolist()) for k in range(2)] == [set(s) for s in supports] for t in (lists, csr, bits))
    assert bits.mask[1].tolist() == [5, 6, 51]
    assert traj.tokens.tolist() == [40, 41, 42, 60, 61, 50, 51] and traj.status == "truncated"
    # The supports arrive byte-equal, in the engine's order (the bitset's ascending), then the forced tokens' singletons.
    assert traj.mask.ids.tolist() == [40, 3, 41, 42, 7, 9, 60, 61, 2, 50, 5, 6, 51]
    assert traj.mask.offsets.tolist() == [0, 2, 3, 6, 7, 8, 10, 13]
    assert traj.log_probs.tolist() == np.float32([-0.4, 0, -1.1, 0, 0, -0.7, -0.3]).tolist()
    assert traj.weight_versions == ["7", "8"]
    assert traj.weight_version_spans == [(("7", 0, 2), ("8", 2, 3)), (("8", 5, 7),)]
    print(f"ok: {traj.turns} turns, {len(traj.tokens)} response tokens, versions {traj.weight_versions}")


def from_server(url: str) -> None:
    """One real `/inference/v1/generate` request; a support overflow raises `SupportOverflow`."""
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8, "top_k": 20, "logprobs": 0}}
    request = urllib.request.Request(f"{url.rstrip('/')}/inference/v1/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as answer:
            reply = json.load(answer)
    except urllib.error.HTTPError as error:
        overflow = overflow_from_error(json.loads(error.read())) if error.code == 400 else None
        if overflow is None:
            raise
        raise overflow from error
    turn = turn_from_vllm(reply["choices"][0])
    print(turn.tokens, turn.status, turn.weight_version, turn.weight_version_spans)
    print(turn.mask.support_sizes, turn.log_probs)
    print(f"ok: {len(turn.tokens)} tokens from {url}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Turns from vLLM replies, literal or from a server.")
    parser.add_argument("--url", help="a vLLM server's base URL: POST one /inference/v1/generate request to it")
    url = parser.parse_args().url
    if url:
        from_server(url)
    else:
        from_replies()
