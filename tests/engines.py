"""Local stand-ins for inference engines (this file holds no tests): small
HTTP servers on 127.0.0.1 that answer in the engines' reply shapes, so the
producer's engine sources can be driven without an engine or a GPU, and
vLLM's output objects for what runs in process.

Each answer is a function of the request and the stand-in's seed
(`request_rng`), never of call order, so tests are repeatable."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import xxhash


def request_rng(seed: int, input_ids: list[int], max_new_tokens: int) -> np.random.Generator:
    """The generator one request's answer is drawn from: a function of the
    stand-in's seed, the request's `input_ids` (a 64-bit digest of their
    little-endian int32 bytes) and its `max_new_tokens`, never of call order."""
    digest = xxhash.xxh3_64_intdigest(np.asarray(input_ids, dtype="<i4").tobytes())
    return np.random.default_rng([seed, digest, max_new_tokens])


@dataclass
class Answer:
    """What an engine sampled for one request, whatever its reply shape:
    `supports` hold their token (in no particular order), `log_probs` are
    over the truncated distribution and `full_log_probs` (each at most its
    truncated one) over the full one. `overflow` is the support size that
    outgrew the stand-in's cap, or None."""

    out: list[int]
    supports: list[list[int]]
    log_probs: list[float]
    full_log_probs: list[float]
    finish: str
    overflow: int | None = None
    # Asked for every support id's log-prob (SGLang's sampling_logprobs_mode support, vLLM's
    # --return-sampling-mask-logprobs): one list per token aligned with its support, renormalised over it; `log_probs`
    # are then the sampled ids' entries.
    support_log_probs: list[list[float]] | None = None

    def with_support_log_probs(self) -> "Answer":
        """This answer as an engine asked for every support id's log-prob
        gives it: the sampled id (first in its support) keeps its
        probability, the others share what is left evenly; a singleton's one
        entry is 0.0."""
        rows = []
        for support, lp in zip(self.supports, self.log_probs):
            if len(support) == 1:
                rows.append([0.0])
                continue
            p = min(float(np.exp(lp)), 1.0 - 1e-6)
            rest = float(np.log((1.0 - p) / (len(support) - 1)))
            rows.append([float(np.log(p)), *[rest] * (len(support) - 1)])
        return Answer(self.out, self.supports, [row[0] for row in rows], self.full_log_probs, self.finish, self.overflow,
                      rows)


class FakeEngine:
    """The HTTP plumbing of a stand-in: every POST goes to `serve(path,
    body)`, which returns the status and the JSON reply; answered calls are
    recorded in `calls` (input, tokens, supports, log-probs, finish) and
    refused ones in `refused`. `weight_version` is read at each answer, so a
    test may change it between calls; with `version_change = (version, at)`
    the tokens from position `at` on were sampled by `version` (weights
    updated mid-request), and the reply's spans say so.

    With `cap`, a request whose top-k is off or at least `cap` overflows
    (one in `1 / overflow_share`, drawn from the request): a cutoff tie
    pushed a support past the cap."""

    LENGTH_SHARE = 0.2  # the share of answers that stop at the length limit

    def __init__(self, vocab_size: int, *, seed: int = 11, weight_version: str = "7", cap: int | None = None,
                 overflow_share: float = 0.5):
        self.vocab_size = vocab_size
        self.seed = seed
        self.weight_version = weight_version
        self.version_change: tuple[str, int] | None = None
        self.cap, self.overflow_share = cap, overflow_share
        self.calls: list[dict[str, Any]] = []
        self.refused: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.held_from: int | None = None  # with `hold`: requests after this many answers wait for `release`
        self.holding = threading.Event()  # set once a request waits
        self.released = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = fake.handle(self.path, body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)  # quick to shut down
        self.thread.start()

    def draw(self, input_ids: list[int], max_new_tokens: int, top_k: int = 0) -> Answer:
        """The answer to `input_ids` with `max_new_tokens` and `top_k`."""
        rng = request_rng(self.seed, input_ids, max_new_tokens)
        top = self.vocab_size - 2  # the last two ids are the echo tool's markers
        out = rng.integers(0, top, size=max_new_tokens).tolist()
        supports = [list(dict.fromkeys([t, *rng.integers(0, top, size=int(rng.integers(0, 4))).tolist()])) for t in out]
        log_probs = (-rng.random(max_new_tokens)).tolist()
        finish = "length" if rng.random() < self.LENGTH_SHARE else "stop"
        full = [lp - float(d) for lp, d in zip(log_probs, rng.random(max_new_tokens))]
        overflows = rng.random() < self.overflow_share
        wide = self.cap is not None and (top_k <= 0 or top_k >= self.cap)
        return Answer(out, supports, log_probs, full, finish,
                      self.cap + 1 + int(rng.integers(0, 50)) if wide and overflows else None)

    def spans(self, n: int) -> list[dict[str, Any]]:
        """The reply's per-token weight versions over its `n` output tokens."""
        if self.version_change is None or not 0 < self.version_change[1] < n:
            return [{"version": self.weight_version, "start": 0, "end": n}]
        version, at = self.version_change
        return [{"version": self.weight_version, "start": 0, "end": at}, {"version": version, "start": at, "end": n}]

    def overflow_message(self, answer: Answer) -> str:
        return (f"sampling mask overflow: a sampled token's support of {answer.overflow} ids exceeds "
                f"--sampling-mask-max-tokens={self.cap}; set top_k below the limit to leave headroom for cutoff ties")

    def handle(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        with self.lock:
            held = self.held_from is not None and len(self.calls) >= self.held_from
        if held:  # an engine that is slow to answer: its client waits mid-trajectory meanwhile
            self.holding.set()
            self.released.wait()
            return 200, {"error": "released unanswered"}
        return self.serve(path, body)

    def serve(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        raise NotImplementedError

    def record(self, input_ids: list[int], answer: Answer) -> None:
        with self.lock:
            if answer.overflow is not None:
                self.refused.append({"input_ids": input_ids, "support": answer.overflow})
            else:
                self.calls.append({"input_ids": input_ids, "out": answer.out, "supports": answer.supports,
                                   "log_probs": answer.log_probs, "full_log_probs": answer.full_log_probs,
                                   "support_log_probs": answer.support_log_probs, "finish": answer.finish})

    def hold(self, after: int) -> None:
        """Answer `after` requests in all, then keep the next ones waiting
        (unanswered, unrecorded) until `release`."""
        self.held_from = after

    def release(self) -> None:
        """Stop holding: the waiting requests get an unusable answer, later ones a real one."""
        with self.lock:
            self.held_from = None
        self.released.set()

    def close(self) -> None:
        """Stops serving and closes the listening socket."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FakeSGLang(FakeEngine):
    """SGLang with `return_sampling_mask`: `/generate` answers `output_ids`
    and `meta_info` (the supports, their log-probs and count, the finish
    reason, the weight version and its spans, token counts; with
    `return_logprob` also `output_token_logprobs`; with
    `sampling_logprobs_mode` `support` the log-probs are one list per token,
    every support id's); `/v1/chat/completions`
    with `return_meta_info` puts that meta_info in its choice, with
    `response_token_ids` and `prompt_token_ids`. An overflow is a 400 or,
    with `overflow_as = "status"`, an abort in the reply's finish reason."""

    def __init__(self, vocab_size: int, *, overflow_as: str = "400", **options):
        super().__init__(vocab_size, **options)
        self.overflow_as = overflow_as

    def meta_info(self, input_ids: list[int], answer: Answer, *, full: bool, text: bool) -> dict[str, Any]:
        n = len(answer.out)
        sampling_log_probs = answer.log_probs if answer.support_log_probs is None else answer.support_log_probs
        meta = {"finish_reason": {"type": answer.finish}, "output_token_sampling_mask": answer.supports,
                "output_token_sampling_logprobs": sampling_log_probs, "output_token_sampling_mask_length": n,
                "weight_version": self.spans(n)[-1]["version"], "weight_versions": self.spans(n),
                "prompt_tokens": len(input_ids), "completion_tokens": n, "cached_tokens": 0}
        if full:
            meta["output_token_logprobs"] = [[lp, t, "" if text else None]
                                             for lp, t in zip(answer.full_log_probs, answer.out)]
        return meta

    def answer(self, input_ids: list[int], max_new_tokens: int, sampling_logprobs_mode: str = "selected") -> dict[str, Any]:
        """The /generate response to `input_ids` with `max_new_tokens`,
        without recording a call."""
        answer = self.draw(input_ids, max_new_tokens)
        if sampling_logprobs_mode == "support":
            answer = answer.with_support_log_probs()
        return {"text": "", "output_ids": answer.out,
                "meta_info": self.meta_info(input_ids, answer, full=False, text=False)}

    def serve(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        assert body["return_sampling_mask"] is True
        chat = path == "/v1/chat/completions"
        assert chat or path == "/generate", path
        if chat:
            assert body["return_meta_info"] is True and body["messages"]
            sampler, max_new_tokens, full = body, body["max_tokens"], bool(body.get("logprobs"))
        else:
            sampler, full = body["sampling_params"], bool(body.get("return_logprob"))
            max_new_tokens = sampler["max_new_tokens"]
        input_ids = body["input_ids"]
        answer = self.draw(input_ids, max_new_tokens, sampler.get("top_k", -1))
        mode = body.get("sampling_logprobs_mode", "selected")
        assert mode in ("selected", "support"), mode
        if mode == "support":
            answer = answer.with_support_log_probs()
        self.record(input_ids, answer)
        if answer.overflow is not None:
            message = self.overflow_message(answer)
            if self.overflow_as == "400":
                return 400, ({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                              "code": 400} if chat else {"error": {"message": message}})
            meta = {"finish_reason": {"type": "abort", "message": message, "status_code": 400,
                                      "err_type": "BadRequestError"}, "prompt_tokens": len(input_ids),
                    "completion_tokens": 0, "weight_version": self.weight_version}
            answer = Answer([], [], [], [], "abort")
        else:
            meta = self.meta_info(input_ids, answer, full=full, text=chat)
        if not chat:
            return 200, {"text": "", "output_ids": answer.out, "meta_info": meta}
        finish = meta["finish_reason"]["type"]
        return 200, {"id": "chatcmpl-fake", "object": "chat.completion", "model": "fake",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                                  "finish_reason": finish, "matched_stop": None, "meta_info": meta,
                                  "response_token_ids": answer.out, "prompt_token_ids": input_ids}],
                     "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(answer.out)},
                     "metadata": {"weight_version": meta["weight_version"]}}


@dataclass
class VLLMLogprob:
    """vLLM's `Logprob`: one candidate's log-prob at a position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class VLLMSamplingMask:
    """vLLM's `SamplingMask` as it ships: one id list per generated token."""

    token_ids: list[list[int]]


@dataclass
class VLLMCsrSamplingMask:
    """vLLM's first `SamplingMask`: flat ids with start offsets (one more
    than there are tokens, the last the end)."""

    token_ids: list[int]
    offsets: list[int]


@dataclass
class VLLMCompletionOutput:
    """The fields of vLLM's `CompletionOutput` a turn is built from."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, VLLMLogprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sampling_mask: Any = None
    weight_versions: list[Any] | None = field(default=None)
    sampling_mask_logprobs: Any = None


class FakeVLLM(FakeEngine):
    """vLLM started with `--return-sampling-mask`: its token-in/token-out
    `/inference/v1/generate` answers choices with `token_ids`, `logprobs`
    (`content`: the sampled token's log-prob over the processed
    distribution), `sampling_mask` (one id list per token) and
    `weight_versions`; `completion_output` gives the same answer as the
    engine's output object, its mask as id lists, CSR or packed bits.

    With `sampling_mask_logprobs` (the server's
    `--return-sampling-mask-logprobs`) each answer also pairs every support
    with its ids' log-probs renormalised over it (SGLang's support mode's,
    `Answer.with_support_log_probs`), whose sampled ids' entries are then
    its `logprobs`."""

    def __init__(self, vocab_size: int, *, sampling_mask_logprobs: bool = False, **options):
        super().__init__(vocab_size, **options)
        self.sampling_mask_logprobs = sampling_mask_logprobs

    def draw(self, input_ids: list[int], max_new_tokens: int, top_k: int = 0) -> Answer:
        answer = super().draw(input_ids, max_new_tokens, top_k)
        return answer.with_support_log_probs() if self.sampling_mask_logprobs else answer

    def serve(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        assert path == "/inference/v1/generate", path
        params = body["sampling_params"]
        assert params["logprobs"] == 0 and params["top_k"] > 0  # vLLM's mask replay refuses top_k <= 0
        input_ids = body["token_ids"]
        answer = self.draw(input_ids, params["max_tokens"], params["top_k"])
        self.record(input_ids, answer)
        return 200, {"request_id": "fake", "model": "fake", "choices": [self.choice(answer)],
                     "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(answer.out)}}

    def choice(self, answer: Answer) -> dict[str, Any]:
        content = [{"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
                   for t, lp in zip(answer.out, answer.log_probs)]
        choice = {"index": 0, "finish_reason": answer.finish, "token_ids": answer.out, "routed_experts": None,
                  "logprobs": {"content": content}, "sampling_mask": answer.supports,
                  "weight_versions": self.spans(len(answer.out))}
        if answer.support_log_probs is not None:
            choice["sampling_mask_logprobs"] = answer.support_log_probs
        return choice

    def completion_output(self, input_ids: list[int], max_tokens: int, mask: str = "lists") -> VLLMCompletionOutput:
        """The engine's output object for the request, its mask as `lists`,
        `csr` or `bitset` (uint8 rows of ceil(V/8) bytes, bit j % 8 of byte
        j // 8 for id j). Its `sampling_mask_logprobs`, when asked for, are
        one list per token beside lists, else one float32 array aligned with
        the mask's ids (a bitset's in id order)."""
        answer = self.draw(input_ids, max_tokens)
        rows = answer.support_log_probs
        if mask == "lists":
            sampling_mask: Any = VLLMSamplingMask(answer.supports)
        elif mask == "csr":
            sampling_mask = VLLMCsrSamplingMask([t for s in answer.supports for t in s],
                                                np.cumsum([0, *map(len, answer.supports)]).tolist())
        else:
            dense = np.zeros((len(answer.out), -(-self.vocab_size // 8) * 8), np.uint8)
            for row, support in enumerate(answer.supports):
                dense[row, support] = 1
            sampling_mask = np.packbits(dense, axis=1, bitorder="little")
            if rows is not None:
                rows = [np.asarray(row)[np.argsort(support)].tolist() for row, support in zip(rows, answer.supports)]
        paired = rows if rows is None or mask == "lists" else np.asarray([x for row in rows for x in row], np.float32)
        logprobs = [{t: VLLMLogprob(lp, 1), (t + 1) % self.vocab_size: VLLMLogprob(lp - 1.0, 2)}
                    for t, lp in zip(answer.out, answer.log_probs)]
        return VLLMCompletionOutput(0, "", answer.out, float(sum(answer.log_probs)), logprobs, answer.finish,
                                    sampling_mask=sampling_mask, sampling_mask_logprobs=paired)


def episode_turns(calls: list[dict[str, Any]], prompt: list[int], full: list[int]) -> list[dict[str, Any]]:
    """The turns of one delivered trajectory, rebuilt from a stand-in's
    recorded calls: each next call's input is the previous input, its output,
    then the forced tool tokens."""
    turns: list[dict[str, Any]] = []
    context = list(prompt)
    while True:
        step = [c for c in calls if c["input_ids"] == context and full[len(context):len(context) + len(c["out"])] == c["out"]]
        if not step:
            return turns
        call = step[0]
        turns.append({"tokens": call["out"], "supports": call["supports"], "log_probs": call["log_probs"],
                      "full_log_probs": call["full_log_probs"], "support_log_probs": call.get("support_log_probs"),
                      "finish": call["finish"], "forced": []})
        context = context + call["out"]
        following = [c["input_ids"] for c in calls if len(c["input_ids"]) > len(context)
                     and c["input_ids"][:len(context)] == context and full[:len(c["input_ids"])] == c["input_ids"]]
        if following:
            turns[-1]["forced"] = following[0][len(context):]
            context = following[0]
