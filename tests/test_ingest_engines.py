"""Engine replies as the engines send them today, from the stand-ins of
tests/engines.py: SGLang's /generate and chat with return_meta_info (the
full log-probs, weight-version spans and support overflows of its sampling
mask contract), vLLM's output objects and its /inference/v1/generate JSON
(the mask as id lists, CSR or bitset, and its paired per-support log-probs).
Supports come out byte-equal to the engine's CSR; what a turn does not carry
is refused with the rule."""
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from engines import FakeSGLang, FakeVLLM

from rollstream.common import ProtocolError, SamplingMask
from rollstream.common.errors import InvalidInput, SupportOverflow
from rollstream.common.ingest import (
    engine_spans,
    overflow_from_error,
    sglang_chat_output,
    turn_from_sglang,
    turn_from_sglang_chat,
    turn_from_vllm,
)

PROMPT = [5, 17, 3, 250, 9, 41]
VOCAB = 1000


def post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def generate(fake, input_ids=PROMPT, n=8, **more):
    return post(fake.url + "/generate", {"input_ids": input_ids, "return_sampling_mask": True,
                                         "sampling_params": {"max_new_tokens": n, "top_k": more.pop("top_k", 20)},
                                         **more})


def chat(fake, input_ids=PROMPT, n=8, **more):
    return post(fake.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": ""}], "input_ids": input_ids, "max_tokens": n,
        "top_k": more.pop("top_k", 20), "return_sampling_mask": True, "return_meta_info": True,
        "return_token_ids": True, **more})


def engine_csr(supports):
    """The engine's supports as CSR bytes: ids in the engine's order, int32, and int64 offsets."""
    flat = [t for s in supports for t in s]
    return np.asarray(flat, "<i4").tobytes(), np.cumsum([0, *map(len, supports)], dtype="<i8").tobytes()


def csr_bytes(mask):
    return mask.ids.tobytes(), mask.offsets.tobytes()


def test_sglang_generate_and_chat_give_the_same_turn_with_supports_byte_equal_to_the_engines():
    with FakeSGLang(VOCAB) as fake:
        _, generated = generate(fake)
        _, chatted = chat(fake)
    (call, _), supports = fake.calls, fake.calls[0]["supports"]
    from_generate = turn_from_sglang(generated["output_ids"], generated["meta_info"], vocab_size=VOCAB)
    from_chat = turn_from_sglang_chat(chatted, vocab_size=VOCAB)
    for turn in (from_generate, from_chat):
        assert csr_bytes(turn.mask) == engine_csr(supports)
        assert turn.tokens.tolist() == call["out"] and turn.log_probs.tobytes() == np.float32(call["log_probs"]).tobytes()
        assert turn.weight_version == "7" and turn.weight_version_spans is None  # one span over the turn is its version
        assert turn.full_log_probs is None  # not asked for
    assert chatted["choices"][0]["prompt_token_ids"] == PROMPT


def test_sglang_full_log_probs_are_carried_when_asked_for_and_must_be_the_sampled_tokens():
    with FakeSGLang(VOCAB) as fake:
        _, generated = generate(fake, return_logprob=True)
        _, chatted = chat(fake, logprobs=True)
    expected = np.float32(fake.calls[0]["full_log_probs"]).tobytes()
    assert turn_from_sglang(generated["output_ids"], generated["meta_info"]).full_log_probs.tobytes() == expected
    assert turn_from_sglang_chat(chatted).full_log_probs.tobytes() == expected
    entries = generated["meta_info"]["output_token_logprobs"]
    wrong = dict(generated["meta_info"], output_token_logprobs=[[entries[0][0], entries[0][1] + 1, None], *entries[1:]])
    with pytest.raises(ProtocolError, match="output_token_logprobs belong to the sampled tokens") as info:
        turn_from_sglang(generated["output_ids"], wrong)
    assert info.value.code == "misaligned"
    above = dict(generated["meta_info"], output_token_logprobs=[[0.5, entries[0][1], None], *entries[1:]])
    with pytest.raises(ProtocolError) as info:
        turn_from_sglang(generated["output_ids"], above)
    assert info.value.code == "invalid_value" and "full_log_probs" in str(info.value)


def test_sglang_spans_become_per_token_versions_in_generate_and_chat():
    with FakeSGLang(VOCAB) as fake:
        fake.version_change = ("8", 3)
        _, generated = generate(fake)
        _, chatted = chat(fake)
    assert generated["meta_info"]["weight_version"] == "8"  # SGLang names the newest
    for turn in (turn_from_sglang(generated["output_ids"], generated["meta_info"]), turn_from_sglang_chat(chatted)):
        assert turn.weight_version == "7" and turn.weight_version_spans == (("7", 0, 3), ("8", 3, 8))


def test_engine_spans_take_maps_arrays_and_objects_and_refuse_anything_else():
    class Span:
        version, start, end = "5", 0, 2

    assert engine_spans([{"version": 4, "start": 0, "end": 2}, ["5", 2, 2], Span()], "x") == [("4", 0, 2), ("5", 0, 2)]
    for bad in ({"version": "4"}, [["4", 0]], [{"version": "4", "start": 0.0, "end": 2}], [None]):
        with pytest.raises(ProtocolError, match="rule 'where is a list of {version, start, end}") as info:
            engine_spans(bad, "where")
        assert info.value.code == "schema"


@pytest.mark.parametrize("api", ["generate", "chat"])
@pytest.mark.parametrize("form", ["400", "status"])
def test_an_overflow_as_a_400_or_in_the_reply_names_the_support_and_the_cap(api, form):
    with FakeSGLang(VOCAB, cap=16, overflow_share=1.0, overflow_as=form) as fake:
        status, reply = (generate if api == "generate" else chat)(fake, top_k=20)
        narrowed_status, narrowed = (generate if api == "generate" else chat)(fake, top_k=8)
    (refused,) = fake.refused
    assert narrowed_status == 200 and len(fake.calls) == 1  # a top-k under the cap does not overflow
    if form == "400":
        assert status == 400
        overflow = overflow_from_error(reply)
    else:
        assert status == 200
        with pytest.raises(SupportOverflow) as info:
            if api == "generate":
                turn_from_sglang(reply["output_ids"], reply["meta_info"])
            else:
                turn_from_sglang_chat(reply)
        overflow = info.value
    assert isinstance(overflow, SupportOverflow) and overflow.code == "support_overflow"
    assert (overflow.support, overflow.cap) == (refused["support"], 16)
    assert "cutoff ties" in str(overflow)


def test_other_refusals_are_not_overflows():
    assert overflow_from_error({"error": {"message": "input_ids must not be empty"}}) is None
    assert overflow_from_error({"object": "error", "message": "sampling mask capture failed: invalid", "code": 500}) is None
    assert overflow_from_error({"type": "stop"}) is None and overflow_from_error("length") is None


@pytest.mark.parametrize("key", ["output_top_logprobs", "routed_experts", "hidden_states"])
def test_per_token_fields_a_turn_does_not_carry_are_refused_not_dropped(key):
    fake = FakeSGLang(VOCAB)
    fake.close()
    answer = fake.answer(PROMPT, 4)
    meta = dict(answer["meta_info"], **{key: [[1.0]] * 4})
    with pytest.raises(ProtocolError, match=f"refused, not dropped.*meta_info.{key}") as info:
        turn_from_sglang(answer["output_ids"], meta)
    assert info.value.code == "schema"


def test_a_support_count_that_disagrees_is_refused():
    fake = FakeSGLang(VOCAB)
    fake.close()
    answer = fake.answer(PROMPT, 4)
    with pytest.raises(ProtocolError, match="output_token_sampling_mask_length counts the supports.*expected 4, got 5"):
        turn_from_sglang(answer["output_ids"], dict(answer["meta_info"], output_token_sampling_mask_length=5))


def test_a_chat_response_without_meta_info_is_refused_with_the_rule():
    with FakeSGLang(VOCAB) as fake:
        _, chatted = chat(fake)
    del chatted["choices"][0]["meta_info"]
    with pytest.raises(ProtocolError, match="each chat choice carries meta_info.*return_meta_info"):
        sglang_chat_output(chatted)
    with pytest.raises(ProtocolError, match="has choice 1"):
        sglang_chat_output(chatted, 1)


@pytest.mark.parametrize("form", ["lists", "csr"])
def test_vllm_output_objects_give_supports_byte_equal_to_the_engines_csr(form):
    fake = FakeVLLM(VOCAB)
    fake.close()
    output = fake.completion_output(PROMPT, 8, form)
    turn = turn_from_vllm(output, vocab_size=VOCAB)
    answer = fake.draw(PROMPT, 8)
    assert csr_bytes(turn.mask) == engine_csr(answer.supports)
    assert turn.tokens.tolist() == answer.out and turn.log_probs.tobytes() == np.float32(answer.log_probs).tobytes()
    assert turn.status == {"stop": "completed", "length": "truncated"}[answer.finish]


def test_a_vllm_bitset_gives_each_support_as_a_set_in_id_order():
    fake = FakeVLLM(VOCAB)
    fake.close()
    turn = turn_from_vllm(fake.completion_output(PROMPT, 8, "bitset"), vocab_size=VOCAB)
    assert csr_bytes(turn.mask) == engine_csr([sorted(s) for s in fake.draw(PROMPT, 8).supports])


def test_vllm_server_json_gives_supports_byte_equal_and_its_spans():
    with FakeVLLM(VOCAB) as fake:
        fake.version_change = ("v2", 5)
        status, reply = post(fake.url + "/inference/v1/generate", {
            "token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "logprobs": 0, "top_k": 20}})
    assert status == 200
    turn = turn_from_vllm(reply["choices"][0], vocab_size=VOCAB)
    (call,) = fake.calls
    assert csr_bytes(turn.mask) == engine_csr(call["supports"]) and turn.tokens.tolist() == call["out"]
    assert turn.weight_version == "7" and turn.weight_version_spans == (("7", 0, 5), ("v2", 5, 8))


def test_vllm_refusals_name_the_rule():
    fake = FakeVLLM(VOCAB)
    fake.close()
    choice = fake.choice(fake.draw(PROMPT, 4))
    content = choice["logprobs"]["content"]
    cases = [
        (dict(choice, logprobs={"content": [dict(content[0], token_id=content[0]["token_id"] + 1), *content[1:]]}),
         "misaligned", "logprobs belong to the sampled tokens' not met at position 0: expected id"),
        (dict(choice, logprobs=None), "misaligned", "no logprobs for its 4 sampled tokens.*logprobs=0"),
        (dict(choice, sampling_mask=None), "mask_invalid", "--return-sampling-mask"),
        (dict(choice, sampling_mask=choice["sampling_mask"][:3]), "misaligned", "mask covers 3 tokens, tokens has 4"),
        (dict(choice, routed_experts="AAAA"), "schema", "refused, not dropped.*routed_experts"),
        (dict(choice, sampling_mask="bits"), "schema", "id lists, CSR .* or uint8 bitset rows"),
    ]
    for bad, code, message in cases:
        with pytest.raises(ProtocolError, match=message) as info:
            turn_from_vllm(bad, vocab_size=VOCAB)
        assert info.value.code == code, (code, info.value)
    with pytest.raises(InvalidInput, match=r"finish_reason is one of .* got 'error': the engine failed the request "
                                           r"\(vLLM does so when a top-k boundary tie keeps more than top_k tokens"):
        turn_from_vllm(dict(choice, finish_reason="error"))
    aborted = turn_from_vllm(dict(choice, finish_reason="abort", sampling_mask=None))
    assert aborted.status == "aborted" and aborted.mask is None


def test_a_bitset_mask_is_uint8_rows():
    rows = np.packbits(np.eye(3, 16, dtype=np.uint8), axis=1, bitorder="little")
    assert SamplingMask.from_bitset(rows) == SamplingMask.from_supports([[0], [1], [2]])
    with pytest.raises(ProtocolError, match="a bitset mask is uint8 \\[tokens, bytes\\]") as info:
        SamplingMask.from_bitset(rows.astype(np.int32))
    assert info.value.code == "shape"
    with pytest.raises(ProtocolError, match="non-empty support"):
        SamplingMask.from_bitset(np.zeros((2, 2), np.uint8))


def flat_f32(rows):
    return np.asarray([x for row in rows for x in row], "<f4").tobytes()


def test_sglang_support_log_probs_become_the_turns_mask_log_probs_said_renormalised():
    """Asked with `sampling_logprobs_mode` `support`, SGLang's
    `output_token_sampling_logprobs` hold one list per token, every support
    id's log-prob renormalised over the support: they become the turn's
    `mask_log_probs` in the mask's order, the turn says they sum to 1, and
    each token's log-prob is its sampled id's entry."""
    with FakeSGLang(VOCAB) as fake:
        _, generated = generate(fake, sampling_logprobs_mode="support")
        _, chatted = chat(fake, sampling_logprobs_mode="support")
        _, plain = generate(fake, input_ids=[*PROMPT, 1])
    call = fake.calls[0]
    assert any(len(s) > 1 for s in call["supports"]) and any(len(s) == 1 for s in call["supports"])
    for turn in (turn_from_sglang(generated["output_ids"], generated["meta_info"], vocab_size=VOCAB),
                 turn_from_sglang_chat(chatted, vocab_size=VOCAB)):
        assert csr_bytes(turn.mask) == engine_csr(call["supports"])
        assert turn.mask_log_probs.dtype == np.float32 and turn.mask_log_probs.tobytes() == flat_f32(
            call["support_log_probs"])
        assert turn.mask_log_probs_normalized
        assert turn.log_probs.tobytes() == np.float32([row[0] for row in call["support_log_probs"]]).tobytes()
        assert turn.log_probs.tobytes() == np.float32(call["log_probs"]).tobytes()
    selected = turn_from_sglang(plain["output_ids"], plain["meta_info"])  # the default mode: a number per token
    assert selected.mask_log_probs is None and not selected.mask_log_probs_normalized


def test_a_miles_forks_support_log_probs_beside_the_per_token_ones_become_the_turns_mask_log_probs():
    """One miles fork's SGLang keeps `output_token_sampling_logprobs` a
    number per token and sends each support's renormalised log-probs as
    `output_token_sampling_mask_logprobs`: carried, said renormalised,
    checked against the supports like support mode's."""
    fake = FakeSGLang(VOCAB)
    fake.close()
    answer = fake.answer(PROMPT, 8, sampling_logprobs_mode="support")
    ids, meta = answer["output_ids"], dict(answer["meta_info"])
    rows = meta["output_token_sampling_logprobs"]
    per_token = [float(np.float32(row[0])) for row in rows]  # the fake puts the sampled id first
    fork = dict(meta, output_token_sampling_logprobs=per_token, output_token_sampling_mask_logprobs=rows)
    turn = turn_from_sglang(ids, fork, vocab_size=VOCAB)
    assert turn.mask_log_probs.tobytes() == flat_f32(rows) and turn.mask_log_probs_normalized
    assert turn.log_probs.tobytes() == np.float32(per_token).tobytes()
    with pytest.raises(ProtocolError, match="output_token_sampling_mask_logprobs has 7 entries, 8 tokens were sampled"):
        turn_from_sglang(ids, dict(fork, output_token_sampling_mask_logprobs=rows[1:]))
    wide = next(i for i, s in enumerate(meta["output_token_sampling_mask"]) if len(s) > 1)
    short = [*rows[:wide], rows[wide][:-1], *rows[wide + 1:]]
    with pytest.raises(ProtocolError, match=rf"output_token_sampling_mask_logprobs\[{wide}\] has") as info:
        turn_from_sglang(ids, dict(fork, output_token_sampling_mask_logprobs=short))
    assert info.value.code == "misaligned"


def test_support_log_probs_that_break_a_rule_are_refused_with_it():
    fake = FakeSGLang(VOCAB)
    fake.close()
    answer = fake.answer(PROMPT, 8, sampling_logprobs_mode="support")
    ids, meta = answer["output_ids"], answer["meta_info"]
    rows = meta["output_token_sampling_logprobs"]
    wide = next(i for i, s in enumerate(meta["output_token_sampling_mask"]) if len(s) > 1)
    short = [*rows[:wide], rows[wide][:-1], *rows[wide + 1:]]
    with pytest.raises(ProtocolError, match=(
            rf"rule 'per-support-id fields aligned with mask_ids \(one entry per support id\)' violated at token "
            rf"{wide}: output_token_sampling_logprobs\[{wide}\] has {len(rows[wide]) - 1} entries, expected "
            rf"{len(rows[wide])}")) as info:
        turn_from_sglang(ids, dict(meta, output_token_sampling_logprobs=short))
    assert info.value.code == "misaligned"
    halved = [*rows[:wide], [x - 0.7 for x in rows[wide]], *rows[wide + 1:]]  # half the probability: no longer sums to 1
    with pytest.raises(ProtocolError, match=rf"each support's probabilities sum to 1 .* at token {wide}") as info:
        turn_from_sglang(ids, dict(meta, output_token_sampling_logprobs=halved))
    assert info.value.code == "invalid_value"
    cut = turn_from_sglang(ids, dict(meta, output_token_sampling_logprobs=halved,
                                     output_token_sampling_mask_truncated=True))  # SGLang's bounded mode cut a support
    assert not cut.mask_log_probs_normalized and cut.mask_log_probs.tobytes() == flat_f32(halved)
    mixed = [rows[0][0], *rows[1:]]
    with pytest.raises(ProtocolError, match="a number per token, or a list per token .* 7 of 8 entries are lists") as info:
        turn_from_sglang(ids, dict(meta, output_token_sampling_logprobs=mixed))
    assert info.value.code == "schema"
    with pytest.raises(ProtocolError, match="log-probs is a number' not met: got None") as info:
        turn_from_sglang(ids, dict(meta, output_token_sampling_logprobs=[[None] * len(rows[0]), *rows[1:]]))
    assert info.value.code == "schema"
    without = {k: v for k, v in meta.items() if k != "output_token_sampling_mask"}
    with pytest.raises(ProtocolError, match="per-support log-probs come with their supports") as info:
        turn_from_sglang(ids, without, require_mask=False)
    assert info.value.code == "mask_invalid"
    above = [*rows[:wide], [rows[wide][0], 0.5, *rows[wide][2:]], *rows[wide + 1:]]  # an id the token is not
    with pytest.raises(ProtocolError, match="mask_log_probs are finite and <= 0") as info:
        turn_from_sglang(ids, dict(meta, output_token_sampling_logprobs=above))
    assert info.value.code == "invalid_value"


def test_vllm_paired_log_probs_become_the_turns_mask_log_probs_said_renormalised():
    """Started with `--return-sampling-mask-logprobs`, vLLM's choice pairs
    each support with `sampling_mask_logprobs`: they become the turn's
    `mask_log_probs` in the mask's order, said to sum to 1; without
    `logprobs` the sampled ids' entries are the tokens' log-probs."""
    with FakeVLLM(VOCAB, sampling_mask_logprobs=True) as fake, FakeVLLM(VOCAB) as plain:
        replies = [post(engine.url + "/inference/v1/generate", {
            "token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "logprobs": 0, "top_k": 20}})[1]
            for engine in (fake, plain)]
    (call,) = fake.calls
    assert any(len(s) > 1 for s in call["supports"]) and any(len(s) == 1 for s in call["supports"])
    choice = replies[0]["choices"][0]
    for turn in (turn_from_vllm(choice, vocab_size=VOCAB), turn_from_vllm(dict(choice, logprobs=None), vocab_size=VOCAB)):
        assert csr_bytes(turn.mask) == engine_csr(call["supports"])
        assert turn.mask_log_probs.dtype == np.float32 and turn.mask_log_probs.tobytes() == flat_f32(
            call["support_log_probs"])
        assert turn.mask_log_probs_normalized
        assert turn.log_probs.tobytes() == np.float32(call["log_probs"]).tobytes()
        assert turn.log_probs.tobytes() == np.float32([row[0] for row in call["support_log_probs"]]).tobytes()
    sums = np.add.reduceat(np.exp(turn.mask_log_probs.astype(np.float64)), turn.mask.offsets[:-1])
    assert np.allclose(sums, 1.0, atol=1e-5), sums
    without = turn_from_vllm(replies[1]["choices"][0], vocab_size=VOCAB)  # a server started without the flag
    assert without.mask_log_probs is None and not without.mask_log_probs_normalized


@pytest.mark.parametrize("form", ["lists", "csr", "bitset"])
def test_vllm_output_objects_pair_log_probs_aligned_with_the_masks_ids(form):
    """Beside id lists, one list per token; beside CSR or a bitset, one
    array aligned with the mask's ids (a bitset's in id order)."""
    fake = FakeVLLM(VOCAB, sampling_mask_logprobs=True)
    fake.close()
    output = fake.completion_output(PROMPT, 8, form)
    assert isinstance(output.sampling_mask_logprobs, list if form == "lists" else np.ndarray)
    answer = fake.draw(PROMPT, 8)
    order = [np.argsort(s) if form == "bitset" else range(len(s)) for s in answer.supports]
    supports = [[s[i] for i in at] for s, at in zip(answer.supports, order)]
    rows = [[row[i] for i in at] for row, at in zip(answer.support_log_probs, order)]
    turn = turn_from_vllm(output, vocab_size=VOCAB)
    assert csr_bytes(turn.mask) == engine_csr(supports)
    assert turn.mask_log_probs.tobytes() == flat_f32(rows) and turn.mask_log_probs_normalized
    assert turn.log_probs.tobytes() == np.float32(answer.log_probs).tobytes()


def test_vllm_paired_log_probs_that_break_a_rule_are_refused_with_it():
    fake = FakeVLLM(VOCAB, sampling_mask_logprobs=True)
    fake.close()
    choice = fake.choice(fake.draw(PROMPT, 8))
    rows, supports = choice["sampling_mask_logprobs"], choice["sampling_mask"]
    wide = next(i for i, s in enumerate(supports) if len(s) > 1)
    short = [*rows[:wide], rows[wide][:-1], *rows[wide + 1:]]
    halved = [*rows[:wide], [x - 0.7 for x in rows[wide]], *rows[wide + 1:]]
    csr = fake.completion_output(PROMPT, 8, "csr")
    flat = csr.sampling_mask_logprobs
    cases = [
        (dict(choice, sampling_mask_logprobs=short), "misaligned",
         rf"rule 'per-support-id fields aligned with mask_ids \(one entry per support id\)' violated at token {wide}: "
         rf"sampling_mask_logprobs\[{wide}\] has {len(rows[wide]) - 1} entries, expected {len(rows[wide])}"),
        (dict(choice, sampling_mask_logprobs=rows[1:]), "misaligned",
         r"rule 'per-token fields aligned .*' violated: sampling_mask_logprobs has 7 entries, 8 tokens were sampled"),
        (dict(choice, sampling_mask_logprobs=[[None] * len(rows[0]), *rows[1:]]), "schema",
         "rule 'each of sampling_mask_logprobs's log-probs is a number' not met: got None"),
        (dict(choice, sampling_mask_logprobs=[rows[0][0], *rows[1:]]), "schema",
         r"rule 'sampling_mask_logprobs is one list per token' not met: sampling_mask_logprobs\[0\] is float"),
        (dict(choice, sampling_mask_logprobs=halved), "invalid_value",  # said renormalised: the sum rule is checked
         rf"each support's probabilities sum to 1 .* at token {wide}"),
        (dict(choice, sampling_mask=None, finish_reason="abort"), "mask_invalid",
         "rule 'per-support log-probs come with their supports' not met: the output holds sampling_mask_logprobs but no "
         "sampling_mask"),
        (dict(choice, sampling_mask=supports[:7], sampling_mask_logprobs=rows[:7]), "misaligned",
         "mask covers 7 tokens, tokens has 8"),
        (dict(vars(csr), sampling_mask_logprobs=flat[:-1]), "misaligned",
         rf"violated: sampling_mask_logprobs has {flat.size - 1} entries, expected {flat.size} \(the mask's ids\)"),
        (dict(vars(csr), sampling_mask_logprobs=flat.reshape(1, -1)), "schema",
         r"sampling_mask_logprobs is one list per token, or one array of numbers aligned with the mask's ids' not met: "
         r"got ndarray of float32 and shape \(1, \d+\)"),
    ]
    for bad, code, message in cases:
        with pytest.raises(ProtocolError, match=message) as info:
            turn_from_vllm(bad, vocab_size=VOCAB)
        assert info.value.code == code, (code, info.value)
