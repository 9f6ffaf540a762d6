"""The model in the loop: a torch LM's rollouts replayed by a trainer.

What the sampler reports for each token (its log-prob under the truncated,
renormalised distribution) must be what the trainer recomputes from the
same weights over the transported support, and must differ from the
full-vocabulary log-prob by the support's probability mass."""
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from rollstream.app.model_source import ModelSource, TargetEnvironment, WeightsWatch, generate
from rollstream.app.tiny_lm import TinyLM, TinyLMConfig, load_weights, save_weights
from rollstream.consumer.primitives import masked_log_probs
from rollstream.producer.sampler import SamplingParams
from rollstream.producer.settings import ProducerSettings
from rollstream.producer.source import SourceSettingsError

CONFIG = TinyLMConfig(vocab_size=300, d_model=32, layers=2, heads=4, max_len=64)


def rollout(params, rows=3, prompt=6, steps=10, seed=1):
    model = TinyLM(CONFIG, seed=seed).eval()
    rng = np.random.default_rng(seed)
    contexts = np.tile(rng.integers(0, CONFIG.vocab_size, prompt), (rows, 1))
    return model, contexts, generate(model, contexts, steps, params, rng)


def trainer_view(model, contexts, row, drawn):
    """The rows of one full forward pass that scored the sampled tokens."""
    sequence = torch.as_tensor(np.concatenate([contexts[row], drawn.tokens]), dtype=torch.int64)[None]
    with torch.no_grad():
        logits = model(sequence)[0]
    start = contexts.shape[1] - 1
    return logits[start:start + len(drawn.tokens)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
                                    SamplingParams(temperature=1.3, top_p=0.7, min_p=0.02)])
def test_the_trainer_recomputes_the_rollout_log_probs_over_the_transported_support(params):
    model, contexts, drawn = rollout(params)
    for row, turn in enumerate(drawn):
        logits = trainer_view(model, contexts, row, turn)
        replayed = masked_log_probs(logits, torch.tensor(turn.tokens), torch.tensor(turn.mask.ids),
                                    torch.tensor(turn.mask.offsets), temperature=params.temperature)
        np.testing.assert_allclose(replayed.numpy(), turn.log_probs, atol=1e-4, rtol=0)
        full = torch.log_softmax(logits.double() / params.temperature, dim=-1)[torch.arange(len(turn.tokens)),
                                                                               torch.tensor(turn.tokens).long()]
        sizes = np.diff(turn.mask.offsets)
        assert (sizes < CONFIG.vocab_size).all()  # every support truncated here
        # the full-vocabulary log-prob is lower by the log of the support's mass: visibly so
        assert (full.numpy() < turn.log_probs - 1e-3).all()


def test_rows_of_a_group_get_their_own_supports_in_step_order():
    params = SamplingParams(temperature=1.0, top_k=8)
    model, contexts, drawn = rollout(params, rows=4, steps=6)
    for row, turn in enumerate(drawn):
        sizes = np.diff(turn.mask.offsets)
        assert len(turn.tokens) == len(turn.log_probs) == len(sizes) == 6 and (sizes <= 8).all()
        logits = trainer_view(model, contexts, row, turn)
        for step in range(6):  # each support is that step's own top ids, holding its token
            support = turn.mask.ids[turn.mask.offsets[step]:turn.mask.offsets[step + 1]]
            top = torch.topk(logits[step], 8).indices.numpy()
            assert set(support) <= set(top) and turn.tokens[step] in support
            # each support id's log-prob is the trainer's, renormalised over that support
            scaled = logits[step].double()[torch.tensor(support.tolist())]
            expected = torch.log_softmax(scaled, dim=0).numpy()
            got = turn.mask_log_probs[turn.mask.offsets[step]:turn.mask.offsets[step + 1]]
            np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_generation_is_reproducible_from_the_seeds_and_rejects_bad_input():
    params = SamplingParams(top_k=20)
    first, second = rollout(params)[2], rollout(params)[2]
    assert all((a.tokens == b.tokens).all() and (a.mask.ids == b.mask.ids).all() for a, b in zip(first, second))
    model = TinyLM(CONFIG)
    with pytest.raises(ValueError, match="contexts must be"):
        generate(model, np.zeros(4, np.int64), 2, params, np.random.default_rng(0))
    with pytest.raises(ValueError, match="steps must be at least 1"):
        generate(model, np.zeros((1, 4), np.int64), 0, params, np.random.default_rng(0))
    with pytest.raises(ValueError, match="at most max_len=64"):
        model(torch.zeros(1, 65, dtype=torch.int64))
    with pytest.raises(ValueError, match="d_model must be a multiple of heads"):
        TinyLMConfig(d_model=30, heads=4)


def test_weights_round_trip_with_their_version_and_a_foreign_file_is_refused(tmp_path):
    model = TinyLM(CONFIG, seed=3)
    path = tmp_path / "weights.safetensors"
    save_weights(model, path, "v7")
    loaded, version = load_weights(path)
    tokens = torch.arange(20)[None] % CONFIG.vocab_size
    assert version == "v7" and loaded.config == CONFIG
    assert torch.equal(loaded(tokens), model.eval()(tokens))
    assert not (tmp_path / "weights.safetensors.partial").exists()
    assert not torch.equal(TinyLM(CONFIG, seed=4)(tokens), model(tokens))  # the seed decides the weights
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match="not a TinyLM weights file.*vocab_size"):
        load_weights(foreign)


def test_the_weights_watch_reloads_a_changed_file_and_keeps_its_weights_over_a_bad_one(tmp_path, caplog):
    path = tmp_path / "policy.safetensors"
    watch = WeightsWatch(str(path), seed=5)
    assert watch.version == "seed-5" and not watch.refresh()  # no file yet: the seed's weights
    save_weights(TinyLM(seed=6), path, "step-1")
    assert watch.refresh() and watch.version == "step-1" and not watch.refresh()
    tokens = torch.arange(8)[None]
    assert torch.equal(watch.model(tokens), TinyLM(seed=6).eval()(tokens))
    save_weights(TinyLM(seed=7), path, "step-2")
    os.utime(path, ns=(1, 1))  # a new stamp even on a coarse clock
    assert watch.refresh() and watch.version == "step-2"
    path.write_bytes(b"not safetensors")
    os.utime(path, ns=(2, 2))
    assert not watch.refresh() and watch.version == "step-2"  # logged, kept
    assert "cannot be loaded, keeping step-2" in caplog.text
    with pytest.raises(SourceSettingsError, match="model_weights must be a TinyLM weights file"):
        WeightsWatch(str(path), seed=5)  # at start the same file is a setting error


def test_the_toy_environment_echoes_the_turn_and_rewards_target_tokens():
    env = TargetEnvironment(tool_tokens=5)
    assert env.answer(np.array([3, 4], np.int32)).tolist() == [3, 4, 3, 4, 3]
    assert TargetEnvironment.reward(np.array([0, 8, 3, 5])) == 0.5 and TargetEnvironment.reward(np.array([])) == 0.0


def test_the_model_source_refuses_a_rollout_longer_than_the_model_and_a_narrower_vocabulary():
    too_long = ProducerSettings(source="model", prompt_tokens=1000, turns=2, response_tokens=20, tool_tokens=10)
    with pytest.raises(SourceSettingsError, match="must be at most the model's max_len=1024, got 1050"):
        ModelSource(too_long, "p")
    with pytest.raises(SourceSettingsError, match="vocab_size must be at least the model's 4096, got 1000"):
        ModelSource(ProducerSettings(source="model", vocab_size=1000), "p")
