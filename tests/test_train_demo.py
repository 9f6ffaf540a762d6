"""The model-in-the-loop training demo: its pieces, then a short run of the
whole loop (real broker and producer daemons on loopback)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from consumer_helpers import delivery, make_rollout, writable

from rollstream.app.tiny_lm import TinyLM, TinyLMConfig
from rollstream.app.train_demo import (
    WeightVersions,
    batch_staleness,
    group_advantages,
    policy_loss,
    replay,
    response_logits,
    run_train_demo,
    staleness_weights,
    summary_table,
    token_staleness,
)
from rollstream.consumer import Batch, Delivery, masked_log_probs

SMALL = TinyLMConfig(vocab_size=50, d_model=8, layers=1, heads=2, max_len=32)


def sampled_batch(models: dict[str, TinyLM], versions: list[tuple[str, ...]]) -> Batch:
    """A batch of one trajectory per entry of `versions` (its turns' weight
    versions), each sampled token's log-prob what its first version's model
    gives over its support, computed the plain way: a forward pass per
    trajectory."""
    rng = np.random.default_rng(7)
    out = []
    for i, names in enumerate(versions):
        d = writable(delivery(make_rollout(rng, f"t{i}", turns=len(names), vocab=SMALL.vocab_size,
                                           sample_index=i).merged()))
        prompt, response = d.arrays["prompt_tokens"], d.arrays["tokens"]
        with torch.no_grad():
            logits = models[names[0]].eval()(torch.as_tensor(np.r_[prompt, response]).long()[None])[0, len(prompt) - 1:-1]
            logp = masked_log_probs(logits, response, torch.as_tensor(d.arrays["mask_ids"]),
                                    torch.as_tensor(d.arrays["mask_offsets"])).numpy()
        d.arrays["log_probs"] = np.where(d.arrays["loss_mask"] == 1, logp, 0).astype(np.float32)
        out.append(Delivery(d.trajectory_id, {**d.fields, "weight_versions": list(names)}, d.arrays, d.broker))
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
    assert [rows for rows, _ in calls] == [2, 1]  # version a's two trajectories together, then b's
    assert (result.replayed, result.skipped) == (3, 2)  # two versions in one trajectory; a version no longer kept
    sampled = int(sum(batch.select([i]).loss_mask.sum() for i in range(3)))
    assert result.support_diffs.size == result.full_diffs.size == result.truncated.size == sampled
    assert result.support_diffs.max() < 1e-6 and result.worst is not None and result.worst[1] in ("a", "b")
    # supports of at most 5 of 50 ids: truncated, so the full vocabulary's log-prob is visibly off
    assert result.truncated.all() and result.full_diffs.min() > 1e-2


def test_the_policy_loss_takes_one_forward_pass_for_the_whole_batch(monkeypatch):
    model = TinyLM(SMALL, seed=1)
    batch = sampled_batch({"a": model}, [("a",), ("a", "a"), ("a",)])
    calls = counted_forwards(monkeypatch)
    loss = policy_loss(model, batch, temperature=1.0, current=0)
    loss.backward()
    assert len(calls) == 1 and torch.isfinite(loss)
    assert all(parameter.grad is not None for parameter in model.parameters())


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
    assert 0.0 <= summary["reward_first"] <= 1.0 and 0.0 <= summary["reward_last"] <= 1.0
    assert summary["staleness_max"] >= 0
    # per token from the spans, per trajectory from its turns' versions: the oldest token is its oldest turn's
    assert summary["token_staleness_max"] == summary["staleness_max"]
    pytest.importorskip("matplotlib")
    assert summary["plot"] == str(plot) and plot.stat().st_size > 1000
    assert "replay max |diff|, over the support" in summary_table(summary)


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
    assert any(line.startswith("the broker says the run starves") for line in lines)
    assert "starved" in summary_table(summary)
