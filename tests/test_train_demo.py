"""The model-in-the-loop training demo: its pieces, then a short run of the
whole loop (real broker and producer daemons on loopback)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollstream.app.tiny_lm import TinyLM, TinyLMConfig
from rollstream.app.train_demo import (
    WeightVersions,
    batch_staleness,
    group_advantages,
    run_train_demo,
    staleness_weights,
    summary_table,
    token_staleness,
)


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
def test_a_run_whose_filter_drops_every_group_stops_cleanly_and_says_it_starved():
    lines = []
    summary = run_train_demo(steps=50, producers=1, group_size=2, batch_groups=2, plot=None,
                             group_filter="min_members:3", starvation_after=3.0, progress=lines.append)
    assert summary["steps"] == 0 and summary["filtered"] > 0 and summary["discarded_share"] == 1.0
    assert summary["starved"] in ("filtered", "filtered,idle", "idle")
    assert any(line.startswith("the broker says the run starves") for line in lines)
    assert "starved" in summary_table(summary)
