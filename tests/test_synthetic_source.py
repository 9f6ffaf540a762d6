"""The synthetic source's policy versions and rewards: the version its
trainer last wrote, rewards in levels whose top grows likelier as that
version rises (so groups tie more and more, as a learning policy's do)."""
import numpy as np

from rollstream.producer.settings import ProducerSettings
from rollstream.producer.synthetic import SyntheticSource


def source(tmp_path, **settings) -> SyntheticSource:
    return SyntheticSource(ProducerSettings(vocab_size=1000, **settings), "p")


def test_the_version_is_the_label_the_trainer_last_wrote(tmp_path):
    assert source(tmp_path).version() is None  # no version file: unversioned turns, as before
    path = tmp_path / "policy.version"
    versioned = source(tmp_path, version_file=str(path))
    assert versioned.version() == "0"  # not written yet: the initial weights
    path.write_text("7")
    assert versioned.version() == "7"
    path.write_text("e1:9")  # after a resume the label names the lineage epoch
    assert versioned.version() == "e1:9"
    path.write_text("")  # being replaced
    assert versioned.version() == "0"


def test_rewards_in_levels_reach_the_top_more_often_as_the_version_rises(tmp_path):
    levels, rng = source(tmp_path, reward_levels=3, seed=1), np.random.default_rng(1)
    early = [levels.reward(rng, "step-0") for _ in range(4000)]
    late = [levels.reward(rng, "step-4") for _ in range(4000)]
    assert set(early) == {0.0, 0.5, 1.0}
    # the top level with chance 1 - 2^-(v+1): 0.5 at version 0, 0.97 at version 4
    assert abs(np.mean(np.array(early) == 1.0) - 0.5) < 0.03
    assert abs(np.mean(np.array(late) == 1.0) - 0.96875) < 0.01
    continuous = source(tmp_path).reward(rng, None)
    assert 0.0 <= continuous < 1.0 and continuous not in (0.0, 0.5, 1.0)
