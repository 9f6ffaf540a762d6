"""miles per-turn samples (each carrying the full token list) as turns:
forced tokens from the prefix relation, miles' merge stop rules and error
conditions. Expected values are written out by hand."""
from types import SimpleNamespace

import numpy as np
import pytest

from rollstream.common import SamplingMask, Trajectory
from rollstream.common.codec import decode
from rollstream.common.messages import BROKER_TO_CONSUMER
from rollstream.common.miles import (
    DEFAULT_FIELDS,
    FIELDS_WITH_MASK,
    MASK_FIELD,
    SessionField,
    decode_session_samples,
    encode_session_samples,
    to_train_data,
)
from rollstream.common.wire import encode_deliver, trajectory_from_deliver
from rollstream.producer.miles_samples import MilesMergeError, turns_from_miles_samples
from rollstream.producer.replay import ReplayError, miles_payload

PROMPT = [1, 2, 3]
R0, S0 = [10, 11], [[10, 4], [11]]
OBS0 = [20, 21]
R1, S1 = [30], [[30, 7, 8]]
OBS1 = [40]
R2, S2 = [50, 51], [[50], [51, 9]]


def sample(tokens, response, supports, status="completed", **overrides):
    base = {
        "tokens": np.array(tokens, np.int64),
        "response": "",
        "response_length": len(response),
        "loss_mask": np.ones(len(response), np.uint8),
        "rollout_log_probs": np.full(len(response), -0.5),
        "rollout_sampling_mask": None if supports is None else SamplingMask.from_supports(supports),
        "rollout_routed_experts": None,
        "rollout_indexer_topk": None,
        "status": status,
        "weight_versions": [[span("7", len(tokens) - len(response), len(tokens))]],  # miles: one span list per call
        "spec_info": {},
        "prefix_cache_info": {},
        "metadata": {},
    }
    base.update(overrides)
    return base


def span(version, start, end):
    """A miles weight-version span as its decoded payloads hold it (absolute token positions)."""
    return {"version": version, "abs_start": start, "abs_end": end}


def three_turns(per_turn=None):
    per_turn = per_turn or {}
    t0 = PROMPT + R0
    t1 = t0 + OBS0 + R1
    t2 = t1 + OBS1 + R2
    return [sample(t0, R0, S0, **per_turn.get(0, {})), sample(t1, R1, S1, **per_turn.get(1, {})),
            sample(t2, R2, S2, **per_turn.get(2, {}))]


def test_forced_tokens_are_the_observation_between_full_token_lists():
    out = turns_from_miles_samples(three_turns())
    assert out.prompt_tokens.tolist() == PROMPT and out.dropped == 0
    assert [t.tokens.tolist() for t in out.turns] == [R0, R1, R2]
    assert [t.forced_tokens.tolist() for t in out.turns] == [OBS0, OBS1, []]
    assert [t.mask.ids.tolist() for t in out.turns] == [[10, 4, 11], [30, 7, 8], [50, 51, 9]]
    assert [t.weight_version for t in out.turns] == ["7", "7", "7"]
    assert out.turns[0].log_probs.tolist() == [-0.5, -0.5]


def test_merged_result_equals_miles_merge():
    """Merged the rollstream way, the turns give what miles' merge_samples
    gives for these samples: tokens = the last sample's tokens, loss 0 and
    singleton supports over observations."""
    out = turns_from_miles_samples(three_turns())
    traj = Trajectory("t", out.prompt_tokens)
    for turn in out.turns:
        assert traj.append_turn(turn).applied
    assert (PROMPT + traj.tokens.tolist()) == PROMPT + R0 + OBS0 + R1 + OBS1 + R2
    assert traj.loss_mask.tolist() == [1, 1, 0, 0, 1, 0, 1, 1]
    assert traj.mask.ids.tolist() == [10, 4, 11, 20, 21, 30, 7, 8, 40, 50, 51, 9]
    assert traj.mask.offsets.tolist() == [0, 2, 3, 4, 5, 8, 9, 10, 12]
    assert traj.log_probs.tolist() == [-0.5, -0.5, 0.0, 0.0, -0.5, 0.0, -0.5, -0.5]


def test_the_support_log_probs_go_with_each_turn_from_the_sample_key_or_miles_mask():
    """A decoded sample's `mask_log_probs`, or the `logprobs` miles keeps on
    its mask object, become each turn's; a turn without them after turns
    with them is the gap the broker records, so that turn is sent alone."""
    lp = [np.array([-0.25, -1.5, 0.0], np.float32), np.array([-0.5, -1.0, -2.0], np.float32),
          np.array([0.0, -0.75, -0.125], np.float32)]
    samples = three_turns({i: {"mask_log_probs": lp[i]} for i in range(3)})
    out = turns_from_miles_samples(samples)
    assert [t.mask_log_probs.tobytes() for t in out.turns] == [v.tobytes() for v in lp]
    assert out.unknown_fields == ()
    objects = [SimpleNamespace(**s) for s in three_turns()]
    for s, supports, values in zip(objects, (S0, S1, S2), lp):
        mask = SamplingMask.from_supports(supports)
        s.rollout_sampling_mask = SimpleNamespace(_ids=mask.ids.copy(), _offsets=mask.offsets.copy(), logprobs=values)
    assert [t.mask_log_probs.tobytes() for t in turns_from_miles_samples(objects).turns] == [v.tobytes() for v in lp]
    gap = turns_from_miles_samples(three_turns({0: {"mask_log_probs": lp[0]}, 2: {"mask_log_probs": lp[2]}}))
    assert len(gap.turns) == 2 and gap.turns[1].mask_log_probs is None and gap.dropped == 1


def test_objects_enums_and_miles_masks_are_accepted():
    status = SimpleNamespace(value="completed")  # miles' Sample.Status.COMPLETED
    samples = [SimpleNamespace(**s) for s in three_turns()]
    for s, supports in zip(samples, (S0, S1, S2)):
        mask = SamplingMask.from_supports(supports)
        s.rollout_sampling_mask = SimpleNamespace(_ids=mask.ids.copy(), _offsets=mask.offsets.copy())
        s.status = status
    samples[2].rollout_sampling_mask = S2  # a list of supports works too
    out = turns_from_miles_samples(samples)
    assert [t.forced_tokens.tolist() for t in out.turns] == [OBS0, OBS1, []]
    assert out.turns[2].mask.offsets.tolist() == [0, 1, 3]


def test_weight_versions_are_read_from_miles_per_call_spans_as_dicts_and_as_objects():
    t0, t1, t2 = (len(PROMPT + R0), len(PROMPT + R0 + OBS0 + R1), len(PROMPT + R0 + OBS0 + R1 + OBS1 + R2))
    per_turn = {
        0: {"weight_versions": [[span("5", t0 - 2, t0)]]},
        # two calls recorded on one sample: only the spans over this sample's response count
        1: {"weight_versions": [[span("5", t0 - 2, t0)], [span("6", t1 - 1, t1)]]},
        # the call's weights changed after its first token: the turn is as old as that token
        2: {"weight_versions": [[span("6", t2 - 2, t2 - 1), span("7", t2 - 1, t2)]]},
    }
    out = turns_from_miles_samples(three_turns(per_turn))
    assert [t.weight_version for t in out.turns] == ["5", "6", "6"]
    # per token where the weights changed within a turn, over its sampled tokens
    assert [t.weight_version_spans for t in out.turns] == [None, None, (("6", 0, 1), ("7", 1, 2))]
    objects = [SimpleNamespace(**s) for s in three_turns(per_turn)]
    for s in objects:  # miles' WeightVersionsPerCall objects holding WeightVersionSpan objects
        s.weight_versions = [SimpleNamespace(spans=[SimpleNamespace(**d) for d in call]) for call in s.weight_versions]
    assert [t.weight_version for t in turns_from_miles_samples(objects).turns] == ["5", "6", "6"]


def merged(tid, out):
    """The trajectory the broker merges from `out`'s turns, as a consumer receives it."""
    traj = Trajectory(tid, out.prompt_tokens)
    for turn in out.turns:
        assert traj.append_turn(turn).applied
    traj.reward = 1.0
    return trajectory_from_deliver(decode(encode_deliver(traj, f"lease-{tid}"), BROKER_TO_CONSUMER))


def test_a_sample_holding_two_engine_calls_is_a_turn_per_call_with_miles_per_call_weight_versions():
    """miles' multi-turn generation keeps one sample: prompt 1 2 3, a call
    sampling 10 11 under weights 7, a tool's output 20 21 22 (loss 0,
    log-prob 0.0, singleton supports), a call sampling 30 under weights 7.
    miles' train data holds, per sample, one list of spans per call:
    [[{7, 3, 5}], [{7, 8, 9}]]. The tool's output becomes forced tokens and
    the merged trajectory is the sample again."""
    two_calls = sample([1, 2, 3, 10, 11, 20, 21, 22, 30], [10, 11, 20, 21, 22, 30],
                       [[10, 4], [11], [20], [21], [22], [30, 7]],
                       loss_mask=np.array([1, 1, 0, 0, 0, 1], np.uint8),
                       rollout_log_probs=np.array([-0.5, -0.5, 0.0, 0.0, 0.0, -0.25]),
                       weight_versions=[[span("7", 3, 5)], [span("7", 8, 9)]])
    out = turns_from_miles_samples([two_calls])
    assert out.prompt_tokens.tolist() == [1, 2, 3] and out.dropped == 0
    assert [(t.tokens.tolist(), t.forced_tokens.tolist(), t.weight_version) for t in out.turns] == [
        ([10, 11], [20, 21, 22], "7"), ([30], [], "7")]
    traj = merged("two-calls", out)
    assert traj.tokens.tolist() == [10, 11, 20, 21, 22, 30] and traj.loss_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert traj.log_probs.tolist() == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.25]
    assert traj.mask.ids.tolist() == [10, 4, 11, 20, 21, 22, 30, 7]
    assert traj.mask.offsets.tolist() == [0, 2, 3, 4, 5, 6, 8]
    # one call whose weights changed after its first token: one list of two spans
    changed = sample([1, 2, 40, 41, 42], [40, 41, 42], [[40], [41], [42]],
                     weight_versions=[[span("6", 2, 3), span("7", 3, 5)]])
    assert to_train_data([traj, merged("changed", turns_from_miles_samples([changed]))])["weight_versions"] == [
        [[{"version": "7", "abs_start": 3, "abs_end": 5}], [{"version": "7", "abs_start": 8, "abs_end": 9}]],
        [[{"version": "6", "abs_start": 2, "abs_end": 3}, {"version": "7", "abs_start": 3, "abs_end": 5}]],
    ]


def test_two_calls_of_a_sample_with_nothing_between_them_are_two_turns_without_forced_tokens():
    """A generation resumed by a second call (miles' partial rollout) appends to the sample at once."""
    resumed = sample([1, 2, 10, 11, 12], [10, 11, 12], [[10], [11], [12]], status="truncated",
                     weight_versions=[[span("6", 2, 4)], [span("7", 4, 5)]])
    out = turns_from_miles_samples([resumed])
    assert [(t.tokens.tolist(), t.forced_tokens.tolist(), t.status) for t in out.turns] == [
        ([10, 11], [], "completed"), ([12], [], "truncated")]
    assert to_train_data([merged("resumed", out)])["weight_versions"] == [
        [[{"version": "6", "abs_start": 2, "abs_end": 4}], [{"version": "7", "abs_start": 4, "abs_end": 5}]]]


@pytest.mark.parametrize("overrides, message", [
    ({"loss_mask": np.array([1, 1, 1, 0, 0, 1], np.uint8)},
     r"sample 0: rule 'the tokens between two engine calls of a sample are an observation \(loss_mask 0, log-prob 0.0, "
     r"each token its own support\)' violated at response positions \[2, 5\): expected loss_mask \[0, 0, 0\], "
     r"log-probs \[0.0, 0.0, 0.0\], supports \[\[20\], \[21\], \[22\]\], got loss_mask \[1, 0, 0\]"),
    ({"weight_versions": [[span("7", 3, 6)], [span("7", 5, 9)]]},
     r"sample 0: rule 'the engine calls of a sample follow one another' violated: expected a call to begin at response "
     r"position 3 or later, got 2"),
])
def test_two_calls_of_a_sample_that_cannot_be_split_into_turns_are_refused_naming_the_rule(overrides, message):
    """What lies between two calls would become forced tokens: sampled
    tokens there (loss 1) would lose their loss; calls that overlap cannot
    be told apart."""
    two_calls = sample([1, 2, 3, 10, 11, 20, 21, 22, 30], [10, 11, 20, 21, 22, 30],
                       [[10, 4], [11], [20], [21], [22], [30, 7]],
                       loss_mask=np.array([1, 1, 0, 0, 0, 1], np.uint8),
                       rollout_log_probs=np.array([-0.5, -0.5, 0.0, 0.0, 0.0, -0.25]),
                       weight_versions=[[span("7", 3, 5)], [span("7", 8, 9)]])
    with pytest.raises(MilesMergeError, match=message):
        turns_from_miles_samples([{**two_calls, **overrides}])


def test_fields_a_newer_miles_adds_are_counted_where_samples_become_turns_and_not_sent():
    newer = {"lineage_note": SessionField("json"), "draft_hidden": SessionField("tensor", np.dtype("<f2"), strict=True)}
    samples = three_turns({1: {"draft_hidden": np.zeros(2, np.float16), "lineage_note": "x"}})
    payload = encode_session_samples(samples, fields=(*DEFAULT_FIELDS, *newer, MASK_FIELD), unknown=newer)
    decoded = decode_session_samples(payload)
    assert sorted(decoded.unknown) == ["draft_hidden", "lineage_note"]
    out = turns_from_miles_samples(decoded.samples)
    assert out.unknown_fields == ("draft_hidden", "lineage_note")
    assert [t.tokens.tolist() for t in out.turns] == [R0, R1, R2]


def test_an_unversioned_call_has_no_version_and_a_legacy_sample_its_version_string():
    unversioned = turns_from_miles_samples(three_turns({0: {"weight_versions": [[]]}, 1: {"weight_versions": []},
                                                        2: {"weight_versions": ["3", "4"]}}))
    assert [t.weight_version for t in unversioned.turns] == [None, None, "4"]


def test_the_merge_stops_after_a_turn_that_did_not_complete():
    out = turns_from_miles_samples(three_turns({1: {"status": "truncated"}}))
    assert [t.status for t in out.turns] == ["completed", "truncated"]
    assert [t.forced_tokens.tolist() for t in out.turns] == [OBS0, []]
    assert out.dropped == 1


def test_a_replay_gap_turn_is_sent_and_the_rest_dropped():
    """The gap turn goes (the broker records the gap); the turn before it
    carries no forced tokens (a gap would cut them anyway)."""
    out = turns_from_miles_samples(three_turns({1: {"rollout_sampling_mask": None, "status": "aborted"}}))
    assert [t.mask is not None for t in out.turns] == [True, False]
    assert [t.forced_tokens.tolist() for t in out.turns] == [[], []]
    assert out.dropped == 1
    traj = Trajectory("t", out.prompt_tokens)
    assert [traj.append_turn(t).reason for t in out.turns] == [None, "replay_gap"]
    assert traj.tokens.tolist() == R0 and traj.gap.turn == 1


def test_a_single_sample_is_one_turn():
    out = turns_from_miles_samples([sample(PROMPT + R0, R0, S0, rollout_log_probs=None)])
    assert out.prompt_tokens.tolist() == PROMPT and len(out.turns) == 1
    assert out.turns[0].log_probs.tolist() == [0.0, 0.0]  # miles fills missing log-probs with 0.0


@pytest.mark.parametrize("samples, match", [
    ([sample(PROMPT + R0, R0, S0), sample([1, 2, 9, 10, 11] + OBS0 + R1, R1, S1)],
     r"samples 0 -> 1: rule 'b.tokens must start with a.tokens' violated: .* first difference at position 2"),
    ([sample(PROMPT + R0, R0, S0), sample(PROMPT + R0 + R1, R1, S1)],
     r"rule 'obs_len > 0' violated: expected a non-empty observation between the turns, got obs_len=0"),
    ([sample(PROMPT + R0, R0, None), sample(PROMPT + R0 + OBS0 + R1, R1, S1)],
     r"rule 'both turns carry a complete rollout sampling mask' violated: expected a mask on sample 0 too"),
    ([sample(PROMPT + R0, R0, S0), sample(PROMPT + R0 + OBS0 + R1, R1, S1, loss_mask=np.ones(3, np.uint8))],
     r"sample 1: rule 'len\(loss_mask\) == response_length' violated: expected 1, got 3"),
    ([sample(PROMPT + R0, R0, S0, rollout_indexer_topk=np.zeros((2, 4), np.int32)),
      sample(PROMPT + R0 + OBS0 + R1, R1, S1, rollout_indexer_topk=np.zeros((7, 4), np.int32))],
     r"sample 0: rule 'len\(rollout_indexer_topk\) == len\(tokens\) - 1' violated: expected 4, got 2"),
    ([sample([10], R0, S0)], r"sample 0: rule 'len\(tokens\) >= response_length' violated: expected >= 2, got 1"),
    ([sample(PROMPT + R0, R0, S0, status="failed")], r"sample 0: status must be one of .* got 'failed'"),
    ([sample(PROMPT + R0, R0, S0, weight_versions=[[{"version": "", "abs_start": 3, "abs_end": 5}]])],
     r"sample 0: rule 'a weight-version span is a non-empty version with integer abs_start and abs_end' violated"),
    ([sample(PROMPT + R0, R0, S0, weight_versions=[{"version": "7"}])],
     r"sample 0: rule 'weight_versions holds one list of spans per engine call' violated: expected a list of spans, "
     r"got dict"),
    ([sample(PROMPT + R0, R0, S0, weight_versions={"version": "7"})],
     r"sample 0: rule 'weight_versions holds one list of spans per engine call' violated: expected a list, got dict"),
    ([sample(PROMPT + R0, R0, S0, mask_log_probs=np.zeros(2, np.float32)),
      sample(PROMPT + R0 + OBS0 + R1, R1, S1, mask_log_probs=np.zeros(3, np.float32))],
     r"sample 0: rule 'len\(rollout_sampling_mask.logprobs\) == len\(rollout_sampling_mask.ids\)' violated: "
     r"expected 3, got 2"),
    ([], "no samples"),
])
def test_miles_merge_errors(samples, match):
    with pytest.raises(MilesMergeError, match=match):
        turns_from_miles_samples(samples)


def test_a_session_payload_round_trip_gives_the_same_turns():
    payload = encode_session_samples(three_turns(), fields=FIELDS_WITH_MASK)
    decoded = decode_session_samples(payload, fields=FIELDS_WITH_MASK)
    out = turns_from_miles_samples(decoded.samples, vocab_size=100)
    assert [t.forced_tokens.tolist() for t in out.turns] == [OBS0, OBS1, []]
    assert out.turns[1].mask == SamplingMask.from_supports(S1)


def test_the_replay_source_reads_a_payload_with_or_without_the_mask_as_the_library_detects(tmp_path):
    for fields, masked in ((FIELDS_WITH_MASK, True), (None, False)):
        path = tmp_path / f"masked-{masked}.safetensors"
        samples = three_turns() if masked else three_turns({i: {"rollout_sampling_mask": None} for i in range(3)})
        path.write_bytes(encode_session_samples(samples, {"reward": 1.0}, **({"fields": fields} if fields else {})))
        converted, session = miles_payload(path, vocab_size=100)
        assert [t.forced_tokens.tolist() for t in converted.turns] == [OBS0, OBS1, []] and session == {"reward": 1.0}
        assert [t.mask is not None for t in converted.turns] == [masked] * 3


def test_the_replay_source_names_the_file_of_a_payload_it_cannot_decode(tmp_path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes(encode_session_samples(three_turns(), fields=FIELDS_WITH_MASK)[:-5])
    with pytest.raises(ReplayError, match=rf"^{path}: not a miles session payload: payload is not a valid safetensors"):
        miles_payload(path, vocab_size=None)
