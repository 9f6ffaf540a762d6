"""The inference-engine stand-ins of tests/engines.py answer as a function of
the request and their seed: repeatable across calls and across stand-ins."""
import json
import urllib.request

from engines import FakeSGLang

PROMPT = [5, 17, 3, 250, 9, 41]


def generate(fake, input_ids, max_new_tokens=8):
    body = json.dumps({"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens},
                       "return_sampling_mask": True}).encode()
    request = urllib.request.Request(fake.url + "/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def test_the_same_request_gets_the_same_answer_in_the_sglang_shape():
    with FakeSGLang(vocab_size=1000) as fake:
        first = generate(fake, PROMPT)
        generate(fake, [1, 2, 3])  # call order does not matter
        again = generate(fake, PROMPT)
        fake.weight_version = "8"
        later = generate(fake, PROMPT)
    assert first == again and len(fake.calls) == 4
    assert fake.calls[0] == fake.calls[2] and fake.calls[0]["input_ids"] == PROMPT
    meta = first["meta_info"]
    assert set(meta) == {"finish_reason", "output_token_sampling_mask", "output_token_sampling_logprobs",
                         "output_token_sampling_mask_length", "weight_version", "weight_versions", "prompt_tokens",
                         "completion_tokens", "cached_tokens"}
    assert meta["weight_version"] == "7" and later["meta_info"]["weight_version"] == "8"
    assert later["output_ids"] == first["output_ids"]
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == len(first["output_ids"]) == 8


def test_stand_ins_of_one_seed_agree_and_other_seeds_or_inputs_differ():
    with FakeSGLang(vocab_size=1000) as a, FakeSGLang(vocab_size=1000) as b, FakeSGLang(vocab_size=1000, seed=12) as c:
        assert generate(a, PROMPT) == generate(b, PROMPT)
        assert generate(a, PROMPT)["output_ids"] != generate(c, PROMPT)["output_ids"]
        assert generate(a, PROMPT)["output_ids"] != generate(a, [*PROMPT, 1])["output_ids"]
        assert generate(a, PROMPT, 8)["output_ids"] != generate(a, PROMPT, 9)["output_ids"][:8]


def test_tokens_lie_in_their_supports_with_log_probs_at_most_zero():
    fake = FakeSGLang(vocab_size=50, seed=3)
    finishes = set()
    for n in range(200):
        answer = fake.answer([n, n % 7], 5)
        meta = answer["meta_info"]
        assert len(answer["output_ids"]) == len(meta["output_token_sampling_mask"]) == 5
        for token, support, log_prob in zip(answer["output_ids"], meta["output_token_sampling_mask"],
                                            meta["output_token_sampling_logprobs"]):
            assert token in support and len(set(support)) == len(support)
            assert all(0 <= t < 48 for t in support) and log_prob <= 0
        finishes.add(meta["finish_reason"]["type"])
    fake.close()
    assert finishes == {"stop", "length"} and not fake.calls
