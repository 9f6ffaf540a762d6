"""Local stand-ins for inference engines (this file holds no tests): small
HTTP servers on 127.0.0.1 that answer in the engines' reply shapes, so the
producer's engine sources can be driven without an engine or a GPU."""
from __future__ import annotations

import json
import threading
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


class FakeSGLang:
    """A local stand-in for SGLang's /generate: answers in its response shape
    (output_ids, meta_info with the sampling mask and log-probs) and records
    every call in `calls`. Each answer is drawn from `request_rng`, so the same
    request to stand-ins of the same seed gets the same answer: `max_new_tokens`
    tokens, each inside its support, log-probs <= 0, and a finish reason of
    "length" for about one answer in five ("stop" otherwise). `weight_version`
    is read at each answer, so a test may change it between calls."""

    LENGTH_SHARE = 0.2  # the share of answers that stop at the length limit

    def __init__(self, vocab_size: int, *, seed: int = 11, weight_version: str = "7"):
        self.vocab_size = vocab_size
        self.seed = seed
        self.weight_version = weight_version
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.held_from: int | None = None  # with `hold`: requests after this many answers wait for `release`
        self.holding = threading.Event()  # set once a request waits
        self.released = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                reply = json.dumps(fake.serve(self.path, body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)  # quick to shut down
        self.thread.start()

    def answer(self, input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        """The /generate response to `input_ids` with `max_new_tokens`,
        without recording a call."""
        rng = request_rng(self.seed, input_ids, max_new_tokens)
        top = self.vocab_size - 2  # the last two ids are the echo tool's markers
        out = rng.integers(0, top, size=max_new_tokens).tolist()
        supports = [list(dict.fromkeys([t, *rng.integers(0, top, size=int(rng.integers(0, 4))).tolist()])) for t in out]
        log_probs = (-rng.random(max_new_tokens)).tolist()
        finish = "length" if rng.random() < self.LENGTH_SHARE else "stop"
        return {"text": "", "output_ids": out,
                "meta_info": {"finish_reason": {"type": finish}, "output_token_sampling_mask": supports,
                              "output_token_sampling_logprobs": log_probs, "weight_version": self.weight_version,
                              "prompt_tokens": len(input_ids), "completion_tokens": max_new_tokens}}

    def serve(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One POST: checks it is a /generate asking for the sampling mask,
        answers it and records the call (input, tokens, supports, log-probs,
        finish reason)."""
        assert path == "/generate" and body["return_sampling_mask"] is True
        with self.lock:
            held = self.held_from is not None and len(self.calls) >= self.held_from
        if held:  # an engine that is slow to answer: its client waits mid-trajectory meanwhile
            self.holding.set()
            self.released.wait()
            return {"error": "released unanswered"}
        response = self.answer(body["input_ids"], body["sampling_params"]["max_new_tokens"])
        meta = response["meta_info"]
        with self.lock:
            self.calls.append({"input_ids": body["input_ids"], "out": response["output_ids"],
                               "supports": meta["output_token_sampling_mask"],
                               "log_probs": meta["output_token_sampling_logprobs"],
                               "finish": meta["finish_reason"]["type"]})
        return response

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

    def __enter__(self) -> FakeSGLang:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
                      "finish": call["finish"], "forced": []})
        context = context + call["out"]
        following = [c["input_ids"] for c in calls if len(c["input_ids"]) > len(context)
                     and c["input_ids"][:len(context)] == context and full[:len(c["input_ids"])] == c["input_ids"]]
        if following:
            turns[-1]["forced"] = following[0][len(context):]
            context = following[0]
