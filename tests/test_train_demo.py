"""The model-in-the-loop training demo: its pieces, then a short run of the
whole loop (real broker and producer daemons on loopback)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from consumer_helpers import delivery, make_rollout, writable

from rollstream.app.demo import discarded_on_purpose
from rollstream.app.tiny_lm import TinyLM, TinyLMConfig
from rollstream.app.train_demo import (
    LEARNING_STEPS,
    Replay,
    WeightVersions,
    batch_staleness,
    failures,
    group_advantages,
    policy_loss,
    progress_line,
    replay,
    response_logits,
    run_train_demo,
    staleness_weights,
    summary_table,
    token_staleness,
)
from rollstream.consumer import Batch, Delivery, masked_log_probs

SMALL = TinyLMConfig(vocab_size=50, d_model=8, layers=1, heads=2, max_len=32)
# A short run's summary, as `run_train_demo` returns it without a plot (the short run below holds it to
# the real one's keys).
PASSING = {
    "steps": 3, "reward_first": 0.0625, "reward_last": 0.0677, "replay_max_abs_diff_support": 9.5e-07,
    "replay_mean_abs_diff_full": 3.99, "replay_max_support_kl": 2.1e-12, "replay_tokens": 576, "truncated_share": 1.0,
    "full_diff_min_where_truncated": 3.83, "staleness_mean": 0.583, "staleness_max": 1, "token_staleness_mean": 0.583,
    "token_staleness_max": 1, "skipped_trajectories": 0, "replay_worst": {"diff": 9.5e-07, "version": "step-0", "step": 1},
    "acked": 13, "committed": 12, "lost": 0, "duplicated": 0, "partial": 0, "corrupted": 0, "unseen": 1,
    "dead_lettered": {}, "given_up": {}, "redelivered": 0, "unacked_committed": 0, "lineage_lost": 0,
    "lineage_duplicated": 0, "replayed": 0, "resumed_from_step": None, "replayed_batches_identical": None, "left_at_broker": 1,
    "max_staleness": None, "group_filter": None, "stale_dropped": 0, "filtered": 0, "abandoned": 0,
    "discarded_share": 0.0, "starved": None, "seconds": 3.3, "failed": [], "ok": True,
}
# A run whose broker said it starved before the first batch: no figure of the steps has a value.
STARVED = {**PASSING, **dict.fromkeys(("reward_first", "reward_last", "replay_max_abs_diff_support",
                                       "replay_mean_abs_diff_full", "replay_max_support_kl", "truncated_share",
                                       "full_diff_min_where_truncated",
                                       "staleness_mean", "staleness_max", "token_staleness_mean",
                                       "token_staleness_max", "replay_worst")),
           "steps": 0, "replay_tokens": 0, "group_filter": "min_members:3", "starved": "filtered",
           "dead_lettered": {"filtered:min_members": 8}, "filtered": 8, "discarded_share": 1.0}


def sampled_batch(models: dict[str, TinyLM], versions: list[tuple[str, ...]], spans: bool = True) -> Batch:
    """A batch of one trajectory per entry of `versions` (the weight versions
    that sampled it, in order): its response cut into that many equal spans,
    each sampled token's log-prob what its span's model gives over its
    support, computed the plain way: a forward pass per trajectory and
    version. Without `spans` the deliveries name the versions alone (a
    broker older than spans)."""
    rng = np.random.default_rng(7)
    out = []
    for i, names in enumerate(versions):
        d = writable(delivery(make_rollout(rng, f"t{i}", turns=len(names), vocab=SMALL.vocab_size,
                                           sample_index=i).merged()))
        prompt, response = d.arrays["prompt_tokens"], d.arrays["tokens"]
        bounds = np.linspace(0, len(response), len(names) + 1).astype(int).tolist()
        logp = np.zeros(len(response), np.float32)
        for name, start, end in zip(names, bounds, bounds[1:]):
            with torch.no_grad():
                logits = models[name].eval()(torch.as_tensor(np.r_[prompt, response]).long()[None])[0, len(prompt) - 1:-1]
                logp[start:end] = masked_log_probs(logits, response, torch.as_tensor(d.arrays["mask_ids"]),
                                                   torch.as_tensor(d.arrays["mask_offsets"])).numpy()[start:end]
        d.arrays["log_probs"] = np.where(d.arrays["loss_mask"] == 1, logp, 0).astype(np.float32)
        fields = {**d.fields, "weight_versions": list(names)}
        fields.pop("weight_version_spans", None)
        if spans:
            fields["weight_version_spans"] = [[[name, start, end]] for name, start, end in zip(names, bounds, bounds[1:])]
        out.append(Delivery(d.trajectory_id, fields, d.arrays, d.broker))
    return Batch.from_deliveries(out, device="cpu")


def counted_forwards(monkeypatch) -> list[tuple[int, ...]]:
    """The shape of every `TinyLM` forward pass from now on."""
    calls: list[tuple[int, ...]] = []
    forward = TinyLM.forward
    monkeypatch.setattr(TinyLM, "forward", lambda self, tokens, **kw: calls.append(tuple(tokens.shape)) or forward(
        self, tokens, **kw))
    return calls


def test_group_advantages_are_rewards_normalised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    advantages = group_advantages(rewards, groups)
    # group 0: mean 0.5, std 0.5 -> +1, -1; group 1 and the lone group 2: no spread -> 0
    np.testing.assert_allclose(advantages.numpy(), [1.0, -1.0, 0.0, 0.0, 0.0], atol=1e-5)


def test_staleness_is_counted_from_each_trajectorys_oldest_turn():
    batch = SimpleNamespace(weight_versions=(("step-3", "step-5"), ("opaque",), ("7",), ()))
    assert batch_staleness(batch, 7) == [4, 0]  # the versions without an order are not counted


def test_token_staleness_counts_each_tokens_own_version_and_weights_the_loss_by_it():
    """Versions 5 5 -1 6 7 9 against the trainer's 7: two steps behind, unknown
    (a forced token), one, none, and ahead (a lineage a resume abandoned) as none;
    each halves a token's weight per step, an unknown one keeps weight 1."""
    batch = SimpleNamespace(token_versions=torch.tensor([5, 5, -1, 6, 7, 9]))
    assert token_staleness(batch, 7).tolist() == [2, 2, -1, 1, 0, 0]
    assert staleness_weights(batch, 7).tolist() == [0.25, 0.25, 1.0, 0.5, 1.0, 1.0]


def test_weight_versions_hand_back_the_weights_of_a_kept_version_only():
    config = TinyLMConfig(vocab_size=50, d_model=8, layers=1, heads=2, max_len=16)
    versions = WeightVersions(config, keep=2)
    models = {name: TinyLM(config, seed=seed) for seed, name in enumerate(("a", "b", "c"))}
    for name, model in models.items():
        versions.add(name, model)
    tokens = torch.arange(6)[None]
    assert versions.model("a") is None  # only the last two are kept
    assert torch.equal(versions.model("b")(tokens), models["b"].eval()(tokens))
    assert torch.equal(versions.model("c")(tokens), models["c"].eval()(tokens))


def test_response_logits_score_every_response_token_in_one_padded_forward_pass(monkeypatch):
    """Sequences of different lengths, right-padded into one forward pass,
    get the logits a forward pass over each sequence alone gives them."""
    model = TinyLM(SMALL, seed=1).eval()
    batch = sampled_batch({"a": model}, [("a",), ("a", "a"), ("a", "a", "a")])
    assert len(set(batch.lengths["sequence"].tolist())) > 1
    alone = [model(batch.tokens[int(start):int(end)].long()[None])[0, int(prompt) - 1:-1]
             for start, end, prompt in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], batch.lengths["prompt"])]
    calls = counted_forwards(monkeypatch)
    logits = response_logits(model, batch)
    assert calls == [(3, int(batch.lengths["sequence"].max()))]
    torch.testing.assert_close(logits, torch.cat(alone), rtol=0, atol=1e-5)


def test_replay_takes_one_forward_pass_per_weight_version_and_matches_the_sampler(monkeypatch):
    models = {"a": TinyLM(SMALL, seed=1), "b": TinyLM(SMALL, seed=2), "gone": TinyLM(SMALL, seed=3)}
    versions = WeightVersions(SMALL)
    for name in ("a", "b"):
        versions.add(name, models[name])
    batch = sampled_batch(models, [("a",), ("b", "b"), ("a", "a"), ("a", "b"), ("gone",)])
    calls = counted_forwards(monkeypatch)
    result = replay(batch, versions, temperature=1.0)
    # version a's three trajectories together (the last sampled partly by b, as one continued after its producer
    # restarted), then b's two; the version no longer kept is skipped
    assert [rows for rows, _ in calls] == [3, 2]
    assert (result.replayed, result.skipped) == (4, 1)
    sampled = int(sum(batch.select([i]).loss_mask.sum() for i in range(4)))
    assert result.support_diffs.size == result.full_diffs.size == result.truncated.size == sampled
    assert result.support_diffs.max() < 1e-6 and result.worst is not None and result.worst[1] in ("a", "b")
    # supports of at most 5 of 50 ids: truncated, so the full vocabulary's log-prob is visibly off
    assert result.truncated.all() and result.full_diffs.min() > 1e-2


def test_a_trajectory_of_several_versions_without_spans_cannot_be_replayed_and_is_skipped():
    models = {"a": TinyLM(SMALL, seed=1), "b": TinyLM(SMALL, seed=2)}
    versions = WeightVersions(SMALL)
    for name in ("a", "b"):
        versions.add(name, models[name])
    batch = sampled_batch(models, [("a",), ("a", "b")], spans=False)
    result = replay(batch, versions, temperature=1.0)
    assert (result.replayed, result.skipped) == (1, 1)
    assert result.support_diffs.size == int(batch.select([0]).loss_mask.sum()) and result.support_diffs.max() < 1e-6


def test_the_policy_loss_takes_one_forward_pass_for_the_whole_batch(monkeypatch):
    model = TinyLM(SMALL, seed=1)
    batch = sampled_batch({"a": model}, [("a",), ("a", "a"), ("a",)])
    calls = counted_forwards(monkeypatch)
    loss = policy_loss(model, batch, temperature=1.0, current=0)
    loss.backward()
    assert len(calls) == 1 and torch.isfinite(loss)
    assert all(parameter.grad is not None for parameter in model.parameters())


def test_a_run_with_nothing_broken_passes_whatever_it_was_asked_to_throw_away_or_left_at_the_broker():
    assert failures(PASSING, set()) == []
    assert failures({**PASSING, "unseen": 7, "left_at_broker": 7}, set()) == []  # stopped after its steps
    assert failures(STARVED, discarded_on_purpose(None, "min_members:3", chaos=False)) == []
    assert failures({**PASSING, "steps": 40, "reward_first": 0.1, "reward_last": 0.9}, set()) == []
    # too short to tell learning from noise: a reward that fell is no failure
    assert failures({**PASSING, "steps": LEARNING_STEPS - 1, "reward_last": 0.01}, set()) == []


@pytest.mark.parametrize("changes, reason", [
    ({"lost": 2}, "checker: expected 0 lost, got 2"),
    ({"duplicated": 1}, "checker: expected 0 duplicated, got 1"),
    ({"partial": 1}, "checker: expected 0 partial, got 1"),
    ({"corrupted": 3}, "checker: expected 0 corrupted, got 3"),
    ({"dead_lettered": {"expired": 1}},
     "checker: expected acked trajectories dead-lettered only for [], got ['expired']"),
    ({"replayed_batches_identical": False},
     "resume: expected the batches trained again to be the ones trained first, got others"),
    ({"replay_max_abs_diff_support": 0.25},
     "replay bound: expected every sampled token's log-prob replayed over its support within 0.0001 of the "
     "sampler's, got 0.25 (replay_worst {'diff': 9.5e-07, 'version': 'step-0', 'step': 1})"),
    ({"replay_max_abs_diff_support": float("nan")}, "replay bound: expected every sampled token's log-prob"),
    ({"replay_max_support_kl": 0.03},
     "replay bound: expected the KL from the sampler's distribution over each support to the replay's within 0.0001, "
     "got 0.03"),
    ({"replay_max_support_kl": float("nan")}, "replay bound: expected the KL from the sampler's distribution"),
    ({"replay_tokens": 0, "replay_max_abs_diff_support": None},
     "replay bound: expected sampled tokens replayed in 3 steps, got none"),
    ({"reward_last": float("nan")}, "reward: expected a share of sampled tokens in [0, 1], got 0.0625 first and nan last"),
    ({"steps": LEARNING_STEPS, "reward_first": 0.4, "reward_last": 0.4},
     f"reward: expected the last steps' mean reward above the first steps' after {LEARNING_STEPS} steps (at least "
     f"{LEARNING_STEPS}), got 0.4 first and 0.4 last"),
])
def test_each_rule_a_run_breaks_is_named_with_what_it_expected_and_what_it_got(changes, reason):
    got = failures({**PASSING, **changes}, set())
    assert len(got) == 1 and got[0].startswith(reason), got


def test_what_a_demo_throws_away_on_purpose_is_what_it_was_asked_for():
    assert discarded_on_purpose(None, None, chaos=False) == set()
    assert discarded_on_purpose(1, "all_equal_rewards,min_members:3", chaos=True) == {
        "stale", "filtered:all_equal_rewards", "filtered:min_members", "abandoned"}
    assert discarded_on_purpose(None, None, chaos=True, rewards_expire=True) == {"abandoned", "reward_expired"}


@pytest.mark.parametrize("summary", [
    PASSING, STARVED, {**PASSING, "plot": None},
    {**PASSING, "resumed_from_step": 4, "replayed": 4, "replayed_batches_identical": True},
    {**PASSING, "resumed_from_step": 4, "replayed": 4, "replayed_batches_identical": False, "ok": False,
     "failed": ["resume: expected the batches trained again to be the ones trained first, got others"]},
], ids=["passing", "starved", "plot-not-written", "resumed", "resumed-differently"])
def test_the_table_shows_no_raw_none_and_its_verdict_last(summary):
    table = summary_table(summary)
    assert "None" not in table, table
    verdict = table.splitlines()[-1].split(maxsplit=1)
    assert verdict == ["verdict", "ok" if summary["ok"] else f"FAILED: {summary['failed'][0]}"], table
    assert "lost 0  duplicated 0  partial 0  corrupted 0  unseen 1" in table


def test_a_progress_line_fits_80_columns():
    extreme = Replay(support_diffs=np.array([1.2345e-12]), full_diffs=np.array([12.3456]), support_kls=np.array([3e-9]),
                     truncated=np.array([True]), replayed=1, skipped=0)
    line = progress_line(9999, 9999, 0.999, -99.9999, extreme)
    assert len(line) <= 80 and line.startswith("step 9999/9999  reward 0.999"), (len(line), line)
    nothing = Replay(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0, bool), 0, 3)  # every trajectory skipped
    assert progress_line(1, 3, 0.5, 0.0, nothing).endswith("|diff| support nan, full nan")


@pytest.mark.slow
def test_a_short_training_run_replays_exactly_over_the_support_and_not_over_the_vocabulary(tmp_path):
    plot = tmp_path / "train.png"
    lines = []
    summary = run_train_demo(steps=3, producers=1, group_size=2, batch_groups=2, plot=str(plot), progress=lines.append)
    assert summary["steps"] == 3 and len(lines) == 3 and lines[0].startswith("step   1/3")
    assert summary["replay_tokens"] > 0 and summary["skipped_trajectories"] == 0
    assert summary["replay_max_abs_diff_support"] < 1e-4  # the same weights over the same support
    assert summary["truncated_share"] == 1.0  # top-k 20 of 4,096 ids truncates every support
    # the full-vocabulary log-prob is off by the log of the support's mass, wherever it was truncated
    assert summary["full_diff_min_where_truncated"] > 1e-3
    assert summary["replay_mean_abs_diff_full"] > 100 * summary["replay_max_abs_diff_support"]
    # the producers sent every support id's log-prob: the replay's distribution over each support is the sampler's
    assert -1e-6 < summary["replay_max_support_kl"] < 1e-4  # KL is >= 0 up to float32 rounding
    assert 0.0 <= summary["reward_first"] <= 1.0 and 0.0 <= summary["reward_last"] <= 1.0
    assert summary["staleness_max"] >= 0
    # per token from the spans, per trajectory from its turns' versions: the oldest token is its oldest turn's
    assert summary["token_staleness_max"] == summary["staleness_max"]
    assert summary["ok"] and summary["failed"] == [] and set(PASSING) <= set(summary), set(PASSING) - set(summary)
    assert (summary["lost"], summary["duplicated"], summary["partial"], summary["corrupted"]) == (0, 0, 0, 0)
    assert summary["unseen"] == summary["left_at_broker"]
    pytest.importorskip("matplotlib")
    assert summary["plot"] == str(plot) and plot.stat().st_size > 1000
    assert "replay max |diff|, over the support" in summary_table(summary)
    assert "replay max KL from the sampler, over the support" in summary_table(summary)


@pytest.mark.slow
def test_a_trainer_crashed_between_a_commit_and_its_checkpoint_resumes_and_replays_every_trajectory_exactly():
    """Checkpoints every 2 steps, a crash after step 5: the resume from step
    4 trains step 5 again on the same batch (its weights, restored with the
    checkpoint, replay every trajectory), and the checker finds nothing
    missing or twice in the surviving lineage."""
    lines = []
    summary = run_train_demo(steps=8, producers=1, group_size=2, batch_groups=2, plot=None, chaos=True,
                             checkpoint_every=2, progress=lines.append)
    assert "trainer crashed after step 5; resuming from its checkpoint of step 4" in lines
    assert summary["ok"], summary["failed"]  # what the abandoned lineage sampled is thrown away on purpose
    assert sum(line.startswith("step   5/8") for line in lines) == 2
    assert summary["resumed_from_step"] == 4 and summary["replayed"] == 4 and summary["replayed_batches_identical"]
    assert (summary["lineage_lost"], summary["lineage_duplicated"], summary["skipped_trajectories"]) == (0, 0, 0)
    assert summary["replay_max_abs_diff_support"] < 1e-4, summary["replay_worst"]  # which version replayed worst
    assert "resumed from the checkpoint of step" in summary_table(summary)


@pytest.mark.slow
def test_a_run_bounded_at_staleness_1_trains_nothing_older_and_reports_what_it_dropped():
    summary = run_train_demo(steps=6, producers=1, group_size=2, batch_groups=2, plot=None, max_staleness=1,
                             progress=lambda line: None)
    assert summary["steps"] == 6 and summary["staleness_max"] <= 1 and summary["max_staleness"] == 1
    assert summary["stale_dropped"] >= 0 and 0.0 <= summary["discarded_share"] <= 1.0 and summary["starved"] is None
    assert summary["ok"], summary["failed"]
    assert (summary["lineage_lost"], summary["lineage_duplicated"]) == (0, 0)
    assert summary["replay_max_abs_diff_support"] < 1e-4


@pytest.mark.slow
def test_a_run_stopped_with_a_group_half_produced_counts_its_ended_members_at_the_broker_not_lost():
    """A batch of one group of 8 from one producer: the trainer waits on the
    producer, which is stopped mid-group. The group's ended members are
    acked and durable but neither ready nor leased; the broker's status
    counts them (`awaiting_group`), so the checker reads them as still at the
    broker. Read as ready + leased they were counted lost."""
    summary = run_train_demo(steps=4, producers=1, group_size=8, batch_groups=1, plot=None,
                             progress=lambda line: None)
    assert summary["steps"] == 4
    assert (summary["lineage_lost"], summary["lineage_duplicated"]) == (0, 0)
    assert summary["left_at_broker"] > 0, "the producer was stopped between groups: nothing shows the case"
    assert "still at the broker" in summary_table(summary)


@pytest.mark.slow
def test_a_run_whose_filter_drops_every_group_stops_cleanly_and_says_it_starved():
    lines = []
    summary = run_train_demo(steps=50, producers=1, group_size=2, batch_groups=2, plot=None,
                             group_filter="min_members:3", starvation_after=3.0, progress=lines.append)
    assert summary["steps"] == 0 and summary["filtered"] > 0 and summary["discarded_share"] == 1.0
    assert summary["starved"] in ("filtered", "filtered,idle", "idle")
    assert summary["ok"], summary["failed"]  # a clean stop, judged on what it trained: nothing
    assert any(line.startswith("the broker says the run starves") for line in lines)
    assert "starved" in summary_table(summary)
