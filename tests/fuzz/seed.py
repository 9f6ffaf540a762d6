"""Writes the seed corpus, tests/fuzz/corpus/<target>/<name>: valid inputs
made with rollstream's own encoders (messages, batches, deliveries, spool
and store segments, miles payloads, settings files), plus a few
interesting ones. The fuzzer starts from these and mutates them.

    python tests/fuzz/seed.py            # rewrite every target's corpus
    python tests/fuzz/seed.py spool ...  # only these targets'
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import targets  # noqa: E402  (a sibling module, found through the line above)
from engines import FakeSGLang, FakeVLLM  # noqa: E402  (tests/engines.py, the engines' stand-ins)
from targets import BITSET, engine_reply, framed_input, join_frames, raw_input, turn_frames  # noqa: E402

from rollstream.common.codec import decode, encode, encode_batch  # noqa: E402
from rollstream.common.mask import SamplingMask  # noqa: E402
from rollstream.common.messages import (  # noqa: E402
    ADMIN_REPLIES,
    ADMIN_REQUESTS,
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    CONSUMER_TO_BROKER,
    PRODUCER_TO_BROKER,
)
from rollstream.common.miles import FIELDS_WITH_MASK, FIELDS_WITH_REWARD, encode_session_samples  # noqa: E402
from rollstream.common.segments import SegmentLog  # noqa: E402
from rollstream.common.trajectory import Trajectory, Turn  # noqa: E402
from rollstream.common.wire import encode_deliver, encode_turn  # noqa: E402
from rollstream.producer.spool import Spool  # noqa: E402

CORPUS = HERE / "corpus"
ROOT = HERE.parent.parent


def producer_to_broker() -> dict[str, bytes]:
    p2b = PRODUCER_TO_BROKER
    half, quarter = np.log(np.float32(0.5)), np.log(np.float32(0.25))  # each support's probabilities sum to 1
    full = Turn.build([10, 11, 12], [-0.5, -0.25, 0.0], supports=[[10, 3], [11], [12, 4, 5]], loss_mask=[1, 1, 0],
                      forced_tokens=[20, 21], routed_experts=np.arange(12, dtype=np.int32).reshape(3, 2, 2),
                      indexer_topk=np.zeros((3, 2), np.int32), full_log_probs=[-0.75, -1.5, -0.125],
                      mask_log_probs=[half, half, 0.0, half, quarter, quarter], mask_log_probs_normalized=True,
                      weight_version="v2", weight_version_spans=[("v2", 0, 2), ("v3", 2, 3)])
    seeds = {
        "hello": encode(p2b, "hello", {"producer_id": "p-1", "seq": 0, "batch_acks": True, "batch_frames": True,
                                      "job": "eval"}),
        "turn-0": turn_frames("t", 0, 1, group_id="g", group_size=2, sample_index=0, metadata={"task": "math"}),
        "turn-0-crc": turn_frames("t", 0, 1, crc=True),
        "turn-1-no-mask": turn_frames("t", 1, 2, supports=None, forced=(7, 8)),
        "turn-1-every-array-packed": encode_turn("t", 1, full, seq=3, may_pack=True, crc=True),
        "turn-1-every-array-but-prompt": encode_turn("t", 1, full, seq=3),
        "end": encode(p2b, "end", {"seq": 4, "trajectory_id": "t", "reward": {"acc": 1.0, "len": -0.5},
                                   "metadata": {"k": [1, 2]}, "turns": 2, "job": "eval"}),
        "end-no-reward": encode(p2b, "end", {"seq": 5, "trajectory_id": "t"}),
        "reward": encode(p2b, "reward", {"seq": 6, "trajectory_id": "t", "reward": 0.25}),
        "abort": encode(p2b, "abort", {"seq": 7, "trajectory_id": "t", "reason": "retry"}),
        "ping": encode(p2b, "ping", {"seq": 8}),
        "hello-lists-open": encode(p2b, "hello", {"producer_id": "p-1", "seq": 0, "lists_open": True}),
        "list-open": encode(p2b, "list_open", {"seq": 9}),
        "read-open": encode(p2b, "read_open", {"seq": 10, "trajectory_id": "t"}),
        "abort-again": encode(p2b, "abort", {"seq": 11, "trajectory_id": "t", "reason": "restart", "again": True}),
        "batch": encode_batch([turn_frames("t", 0, 1), encode(p2b, "end", {"seq": 2, "trajectory_id": "t", "reward": 1})]),
    }
    return {name: join_frames(frames) for name, frames in seeds.items()}


def split_batch() -> dict[str, bytes]:
    p2b = PRODUCER_TO_BROKER
    turns = [turn_frames("a", 0, 1), turn_frames("a", 1, 2, tokens=(13,), supports=((13, 1),)),
             turn_frames("b", 0, 3, supports=None, may_pack=True)]
    ends = [encode(p2b, "end", {"seq": 4, "trajectory_id": "a", "reward": 1.0}),
            encode(p2b, "abort", {"seq": 5, "trajectory_id": "b", "reason": "tool failed"}),
            encode(p2b, "reward", {"seq": 6, "trajectory_id": "c", "reward": {"acc": 0}})]
    seeds = {
        "turns": encode_batch(turns),
        "turns-and-ends": encode_batch([turns[0], ends[0], turns[2], ends[1], ends[2]]),
        "ends-only": encode_batch(ends),
        "one-turn": encode_batch(turns[:1]),
        "carries-a-ping": encode_batch([turns[0], encode(p2b, "ping", {"seq": 9})]),
    }
    return {name: join_frames(frames) for name, frames in seeds.items()}


def consumer_to_broker() -> dict[str, bytes]:
    c2b = CONSUMER_TO_BROKER
    seeds = {
        "hello": encode(c2b, "hello", {"consumer_id": "c-1", "seq": 1, "packed_arrays": True, "split_arrays": True,
                                      "queued_counts": True, "run": "r", "lineage": "l", "job": "eval"}),
        "heartbeat": encode(c2b, "heartbeat", {"seq": 2}),
        "credit": encode(c2b, "credit", {"n": 8, "unit": "trajectory", "seq": 3}),
        "credit-groups": encode(c2b, "credit", {"n": 2, "unit": "group"}),
        "revoke": encode(c2b, "revoke", {}),
        "ack": encode(c2b, "ack", {"leases": ["l1", "l2"], "trajectory_ids": ["a", "b"], "step": 3, "positions": [0, 1]}),
        "nack": encode(c2b, "nack", {"leases": ["l1"], "reason": "bad", "requeue": False}),
        "seal": encode(c2b, "seal", {"step": 3, "keep": 2}),
        "policy": encode(c2b, "policy", {"version": 4, "max_staleness": 2, "per_step": 8, "share": 0.5,
                                        "branches": [[0, 0], [1, 3]]}),
        "resume": encode(c2b, "resume", {"step": 3, "keep": 2, "trained": [[1, 0, "a"], [2, 1, "b"]]}),
    }
    return {name: join_frames(frames) for name, frames in seeds.items()}


def broker_to_producer() -> dict[str, bytes]:
    b2p = BROKER_TO_PRODUCER
    seeds = {
        "welcome": encode(b2p, "welcome", {"broker_id": "b", "max_message_bytes": 1 << 26, "window": 256, "seq": 0,
                                          "batch_acks": True, "batch_frames": True, "job": "eval", "admit": 5,
                                          "lineage": [1, 10]}),
        "ack": encode(b2p, "ack", {"seq": 1, "trajectory_id": "t", "applied": True, "turn": 0}),
        "ack-duplicate": encode(b2p, "ack", {"seq": 2, "trajectory_id": "t", "applied": False, "duplicate": True,
                                            "reason": "stale"}),
        "acks": encode(b2p, "acks", {"ranges": [[1, 4], [7, 7]], "window": 64, "admit": 2, "lineage": [0, 0],
                                     "outcomes": [{"seq": 3, "applied": False, "reason": "stale"},
                                                  {"seq": 4, "applied": True, "duplicate": True}]}),
        "nack": encode(b2p, "nack", {"code": "out_of_order", "message": "resend turn 1 first", "seq": 5, "expected": 1}),
        "pong": encode(b2p, "pong", {"seq": 6, "window": 32}),
        "open-list": encode(b2p, "open_list", {"seq": 7, "trajectories": [
            {"trajectory_id": "t", "next_turn": 2, "state": "open", "group_id": "g", "group_size": 2, "sample_index": 1},
            {"trajectory_id": "u", "next_turn": 1, "state": "scoring"}]}),
        "open-trajectory": encode(b2p, "open_trajectory", {
            "seq": 8, "trajectory_id": "t", "next_turn": 2, "state": "open", "status": "completed",
            "forced_spans": [[2, 3]], "weight_version_spans": [["3", 0, 2], ["4", 3, 4]]}, {
            "prompt_tokens": np.array([1, 2], np.int32), "tokens": np.array([5, 6, 7, 8], np.int32),
            "log_probs": np.array([-0.5, -0.25, 0.0, -1.0], np.float32), "loss_mask": np.array([1, 1, 0, 1], np.uint8),
            "mask_ids": np.array([5, 9, 6, 7, 8], np.int32), "mask_offsets": np.array([0, 2, 3, 4, 5], np.int64),
            "full_log_probs": np.array([-0.75, -0.5, 0.0, -1.25], np.float32),
            "mask_log_probs": np.array([-0.25, -1.5, -0.5, 0.0, -0.75], np.float32)}),
    }
    return {name: join_frames(frames) for name, frames in seeds.items()}


def _trajectory() -> Trajectory:
    trajectory = Trajectory("t", np.array([1, 2, 3], np.int32), group_id="g", group_size=2, sample_index=1,
                            metadata={"task": "math"})
    trajectory.append_turn(Turn.build([10, 11], [-0.5, -0.25], supports=[[10, 4], [11]], forced_tokens=[20, 21],
                                      full_log_probs=[-0.75, -0.5], mask_log_probs=[-0.5, -1.25, -0.25],
                                      weight_version="v1"))
    trajectory.append_turn(Turn.build([12], [-1.0], supports=[[12, 5, 6]], full_log_probs=[-1.25],
                                      mask_log_probs=[-1.0, -0.75, -2.5], weight_version="v2"))
    trajectory.reward = {"acc": 1.0}
    return trajectory


def _plain_trajectory() -> Trajectory:
    trajectory = Trajectory("p", np.array([1, 2], np.int32))
    trajectory.append_turn(Turn.build([10, 11], [-0.5, -0.25], supports=[[10, 4], [11]], forced_tokens=[20]))
    trajectory.append_turn(Turn.build([12], [-1.0], supports=[[12, 5, 6]]))
    trajectory.reward = 1.0
    return trajectory


def broker_to_consumer() -> dict[str, bytes]:
    b2c = BROKER_TO_CONSUMER
    trajectory = _trajectory()
    seeds = {
        "welcome": encode(b2c, "welcome", {"broker_id": "b", "lease_timeout": 60.0, "heartbeat_interval": 1.0,
                                          "packed_arrays": True, "split_arrays": True, "queued_counts": True,
                                          "queued": 3, "max_unsealed_bytes": 1 << 30, "job": "eval"}),
        "deliver": encode_deliver(trajectory, "lease-1", group_left=0, delivery_count=1, queued=2),
        "deliver-packed": encode_deliver(trajectory, "lease-2", may_pack=True, replay=True),
        # Without log-probs beside `log_probs`, and with a number for its reward, as most runs send them.
        "deliver-plain": encode_deliver(_plain_trajectory(), "lease-3", may_pack=True),
        "acked": encode(b2c, "acked", {"leases": ["lease-1"]}),
        "nacked": encode(b2c, "nacked", {"leases": ["lease-2"], "seq": 3}),
        "queued": encode(b2c, "queued", {"n": 4}),
        "revoked": encode(b2c, "revoked", {"queued": 1}),
        "sealed": encode(b2c, "sealed", {"step": 3, "reclaimed": 2}),
        "resumed": encode(b2c, "resumed", {"step": 3, "replay": [[1, 0, "a"]], "epoch": 1}),
        "policy": encode(b2c, "policy", {"version": 4, "max_staleness": 2, "held": 3, "waiting": 1}),
        "nack": encode(b2c, "nack", {"code": "stale_lease", "message": "lease expired", "leases": ["lease-1"]}),
    }
    return {name: join_frames(frames) for name, frames in seeds.items()}


def admin() -> dict[str, bytes]:
    requests = {
        "status": encode(ADMIN_REQUESTS, "status", {"seq": 1}),
        "dead-letters": encode(ADMIN_REQUESTS, "dead_letters", {"seq": 2, "limit": 10, "pruned": True}),
        "requeue": encode(ADMIN_REQUESTS, "requeue", {"seq": 3, "trajectory_ids": ["dead", "ready", "unknown"]}),
        "requeue-job": encode(ADMIN_REQUESTS, "requeue", {"trajectory_ids": ["dead"], "job": "eval"}),
        "end-run": encode(ADMIN_REQUESTS, "end_run", {"seq": 4, "run": "R"}),
        "history-step": encode(ADMIN_REQUESTS, "history", {"seq": 5, "step": 1, "run": "R", "job": "default"}),
        "history-trajectory": encode(ADMIN_REQUESTS, "history", {"seq": 6, "trajectory_id": "ready"}),
        "history-dead": encode(ADMIN_REQUESTS, "history", {"trajectory_id": "dead", "job": "default"}),
    }
    seeds = {f"request-{name}": join_frames(frames) for name, frames in requests.items()}
    core = targets.admin_core()
    for name, frames in requests.items():  # the broker's answers, as the admin client receives them
        for reply in targets.drive(core.admin_request(b"admin", [], decode(frames, ADMIN_REQUESTS), None, targets.at(2.0))):
            seeds[f"reply-{name}"] = join_frames(reply.frames)
    seeds["reply-nack"] = join_frames(encode(ADMIN_REPLIES, "nack", {"code": "schema", "message": "unknown type"}))
    seeds["reply-history-let-go"] = join_frames(encode(ADMIN_REPLIES, "history", {
        "rows": [], "held": 2, "steps": [1, 3], "reclaimed": [{"job": "default", "run": "R", "through": 2}],
        "let_go": [{"job": "eval", "trajectory_id": "a", "reason": "refused", "at": 1.5}], "seq": 7}))
    seeds["endpoints-file"] = json.dumps({"producer": "tcp://127.0.0.1:5555", "consumer": "tcp://127.0.0.1:5556",
                                          "admin": "tcp://127.0.0.1:5557"}).encode()
    return seeds


def _miles_sample(tokens, response, supports, **overrides) -> dict:
    sample = {"tokens": np.array(tokens, np.int64), "response": "", "response_length": len(response),
              "loss_mask": np.ones(len(response), np.uint8), "rollout_log_probs": np.full(len(response), -0.5),
              "rollout_sampling_mask": None if supports is None else SamplingMask.from_supports(supports),
              "rollout_routed_experts": None, "rollout_indexer_topk": None, "status": "completed",
              "weight_versions": [[{"version": "7", "abs_start": len(tokens) - len(response), "abs_end": len(tokens)}]],
              "spec_info": {}, "prefix_cache_info": {}, "metadata": {}}
    sample.update(overrides)
    return sample


def miles_session() -> dict[str, bytes]:
    t0 = [1, 2, 3, 10, 11]
    t1 = t0 + [20, 21, 30]
    t2 = t1 + [40, 50, 51]
    turns = [_miles_sample(t0, [10, 11], [[10, 4], [11]]), _miles_sample(t1, [30], [[30, 7, 8]]),
             _miles_sample(t2, [50, 51], [[50], [51, 9]], status="truncated")]
    return {
        "three-turns-with-mask": encode_session_samples(turns, {"sid": "s"}, fields=FIELDS_WITH_MASK),
        "three-turns-with-mask-log-probs": encode_session_samples(
            [{**turn, "mask_log_probs": np.linspace(-2.0, 0.0, len(turn["rollout_sampling_mask"].ids), dtype=np.float32)}
             for turn in turns], {"sid": "s"}, fields=FIELDS_WITH_MASK),
        "three-turns": encode_session_samples(turns, {"sid": "s"}),
        "with-reward": encode_session_samples([{**turns[0], "reward": 1.0}], None, fields=FIELDS_WITH_REWARD),
        "replay-arrays": encode_session_samples(
            [_miles_sample(t0, [10, 11], None, rollout_routed_experts=np.zeros((4, 2), np.int32),
                           rollout_indexer_topk=np.ones((4, 3), np.int32))], {}),
        "no-samples": encode_session_samples([], {"sid": "empty"}, "no tool output"),
    }


def _sglang_request(chat: bool, *, full: bool = False) -> tuple[str, dict]:
    """The path and body the sglang source posts (producer/sglang.py), top-k off."""
    sampler = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}
    if chat:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "input_ids": [1, 2, 3], **sampler,
                                        "max_tokens": 6, "return_sampling_mask": True, "return_meta_info": True,
                                        "return_token_ids": True, "logprobs": full}
    return "/generate", {"input_ids": [1, 2, 3], "sampling_params": {**sampler, "max_new_tokens": 6},
                         "return_sampling_mask": True, "return_logprob": full}


def engine_replies() -> dict[str, bytes]:
    """The stand-ins' replies (tests/engines.py), each as the decoder it goes to takes it."""
    seeds = {}
    with FakeSGLang(targets.VOCAB) as sglang, FakeSGLang(targets.VOCAB, cap=4, overflow_share=1.0) as refusing, \
            FakeSGLang(targets.VOCAB, cap=4, overflow_share=1.0, overflow_as="status") as aborting, \
            FakeVLLM(targets.VOCAB) as vllm, FakeVLLM(targets.VOCAB, sampling_mask_logprobs=True) as paired:
        seeds["generate"] = engine_reply("sglang_generate", sglang.answer([1, 2, 3], 6))
        seeds["generate-full-log-probs"] = engine_reply("sglang_generate", sglang.serve(*_sglang_request(False, full=True))[1])
        seeds["generate-overflow-abort"] = engine_reply("sglang_generate", aborting.serve(*_sglang_request(False))[1])
        seeds["chat"] = engine_reply("sglang_chat", sglang.serve(*_sglang_request(True))[1])
        seeds["chat-full-log-probs"] = engine_reply("sglang_chat", sglang.serve(*_sglang_request(True, full=True))[1])
        seeds["generate-support-log-probs"] = engine_reply(
            "sglang_generate", sglang.answer([1, 2, 3], 6, sampling_logprobs_mode="support"))
        seeds["chat-overflow-abort"] = engine_reply("sglang_chat", aborting.serve(*_sglang_request(True))[1])
        seeds["error-generate-overflow"] = engine_reply("engine_error", refusing.serve(*_sglang_request(False))[1])
        seeds["error-chat-overflow"] = engine_reply("engine_error", refusing.serve(*_sglang_request(True))[1])
        seeds["error-other"] = engine_reply("engine_error", {"object": "error", "message": "prompt too long", "code": 400})
        seeds["vllm"] = engine_reply("vllm_choice", vllm.choice(vllm.draw([1, 2, 3], 6, 8)))
        seeds["vllm-support-log-probs"] = engine_reply("vllm_choice", paired.choice(paired.draw([1, 2, 3], 6, 8)))
        sglang.version_change = vllm.version_change = ("8", 2)
        seeds["generate-weights-updated"] = engine_reply("sglang_generate", sglang.answer([4, 5], 5))
        seeds["vllm-weights-updated"] = engine_reply("vllm_choice", vllm.choice(vllm.draw([4, 5], 5, 8)))
        seeds["bitset"] = engine_reply(BITSET, vllm.completion_output([1, 2, 3], 4, mask="bitset").sampling_mask)
    seeds["weight-versions-maps"] = engine_reply("weight_versions", [{"version": "7", "start": 0, "end": 3},
                                                                     {"version": "8", "start": 3, "end": 5}])
    seeds["weight-versions-arrays"] = engine_reply("weight_versions", [["7", 0, 3], ["7", 3, 3], ["8", 3, 5]])
    seeds["bitset-small"] = engine_reply(BITSET, [[0b101, 0], [0, 0x80]])
    return seeds


def _spool_files() -> tuple[list[bytes], list[bytes]]:
    """A real spool's segment files (frames appended, some settled) and its records' payloads."""
    with tempfile.TemporaryDirectory() as directory:
        spool = Spool(directory, targets.SPOOL_OWNER, max_bytes=1 << 16, segment_bytes=1 << 9)
        frames = [turn_frames("t", 0, 1), encode(PRODUCER_TO_BROKER, "end", {"seq": 2, "trajectory_id": "t", "reward": 1}),
                  turn_frames("u", 0, 3, supports=None), encode(PRODUCER_TO_BROKER, "ping", {"seq": 4})]
        for seq, message in enumerate(frames, 1):
            spool.append(seq, message, handed_out=True)
        spool.settle(2)
        log = SegmentLog(Path(directory), 1 << 30)
        files = [log.path(number).read_bytes() for number in log.existing()]
        payloads = [bytes(payload) for number in log.existing() for _, payload in log.scan(number).records]
        spool.close()
    return files, payloads


def spool() -> dict[str, bytes]:
    files, payloads = _spool_files()
    return {
        **{f"raw-segment-{i}": raw_input(content) for i, content in enumerate(files, 1)},
        "framed": framed_input(payloads),
        "framed-torn": framed_input(payloads, 1 | 2 | 3 << 4),
        "framed-two-segments": framed_input(payloads, 1 | 4),
        "framed-settled-only": framed_input([payload for payload in payloads if payload[:1] == b"S"]),
        "empty": raw_input(b""),
    }


def cursor() -> dict[str, bytes]:
    header = {"run": "0a1b2c3d", "prompts": targets.CURSOR_PROMPTS, "group_size": 2, "next": [3, 0],
              "outstanding": [[1, 1], [2, 0]]}
    lines = [json.dumps(header), '{"i":[3,0]}', '{"d":[1,1]}', '{"i":[3,1]}', '{"d":[3,0]}']
    return {"header": (lines[0] + "\n").encode(), "records": ("\n".join(lines) + "\n").encode(),
            "torn-last-line": ("\n".join(lines) + "\n" + '{"i":[4').encode()}


def segments() -> dict[str, bytes]:
    files, payloads = _spool_files()
    _, _, store_payloads = targets.store_template()
    return {
        "raw-spool-segment": raw_input(files[0]),
        "framed-spool-records": framed_input(payloads),
        "framed-store-records": framed_input(store_payloads[:4]),
        "framed-torn": framed_input([b"a", b"bb", b"ccc"], 1 | 2),
        "framed-empty-records": framed_input([b"", b"", b"x"]),
    }


def store() -> dict[str, bytes]:
    directory, _, payloads = targets.store_template()
    segment = (directory / "segments" / "seg-00000001.log").read_bytes()
    return {
        "raw-segment": raw_input(segment),
        "raw-segment-salvaged": bytes([2]) + segment,
        "framed": framed_input(payloads),
        "framed-salvaged": framed_input(payloads, 1 | 2),
        "raw-cut-short": raw_input(segment[: len(segment) // 2]),
    }


def archive() -> dict[str, bytes]:
    root, segment_name = targets.archive_template()
    _, _, payloads = targets.store_template()
    segment = (root / segment_name).read_bytes()
    return {
        "raw-segment": raw_input(segment),
        "framed": framed_input(payloads),
        "raw-cut-short": raw_input(segment[: len(segment) // 2]),
    }


def settings_toml() -> dict[str, bytes]:
    systemd = ROOT / "deploy" / "systemd"
    return {
        "broker-deployed": (systemd / "broker.toml").read_bytes(),
        "producer-sglang": (systemd / "producer" / "sglang.toml").read_bytes(),
        "producer-synthetic": (systemd / "producer" / "synthetic.toml").read_bytes(),
        "broker-flat": b'window = 7\nlease_timeout = 12.5\nmax_memory_bytes = "1GiB"\nsync = "full"\n'
                       b'group_filters = "all_equal_rewards:0.01,min_members:2"\nvocab_size = 1000\nmax_staleness = 2\n'
                       b'abandoned_lineage = "keep"\n',
        "broker-unknown-key": b'[broker]\nwindw = 3\nmax_staleness = 2\nabandoned_lineage = "keep"\n',
        "producer-flags": b'[producer]\ncrc = false\ncheck_content = true\nlate_reward_rate = 0.5\n'
                          b'reward_levels = 3\nspool_bytes = 1048576\n',
        "both-tables": b'[broker]\nwindow = 1\n[producer]\nwindow = 2\n',
    }


# The schema each codec target's seeds must decode with (the seeds are valid messages).
SCHEMAS = {"producer_to_broker": PRODUCER_TO_BROKER, "split_batch": PRODUCER_TO_BROKER, "consumer_to_broker": CONSUMER_TO_BROKER,
           "broker_to_producer": BROKER_TO_PRODUCER, "broker_to_consumer": BROKER_TO_CONSUMER}

SEEDS = {"producer_to_broker": producer_to_broker, "split_batch": split_batch, "consumer_to_broker": consumer_to_broker,
         "broker_to_producer": broker_to_producer, "broker_to_consumer": broker_to_consumer, "admin": admin,
         "miles_session": miles_session, "engine_replies": engine_replies, "spool": spool, "cursor": cursor,
         "segments": segments, "store": store, "archive": archive, "settings_toml": settings_toml}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", choices=[[], *SEEDS], help="targets whose corpus to rewrite (default: all)")
    args = parser.parse_args()
    for name in args.targets or SEEDS:
        seeds = SEEDS[name]()
        folder = CORPUS / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for seed_name, data in seeds.items():
            targets.run_target(name, data)  # a seed is a valid input: it must pass its target
            if name in SCHEMAS:
                decode(targets.split_frames(data), SCHEMAS[name], vocab_size=targets.VOCAB)
            (folder / seed_name).write_bytes(data)
        print(f"{name}: {len(seeds)} inputs, {sum(map(len, seeds.values()))} bytes")


if __name__ == "__main__":
    main()
