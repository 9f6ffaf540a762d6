"""The data model on its own (no broker): a sampling mask in CSR form, and a
trajectory merged from a turn with forced tokens and a turn taken from an
SGLang reply. Each printed line says what it shows; the checks below hold
the README to it.

    .venv/bin/python examples/data_model.py
"""
import numpy as np

from rollstream.common import SamplingMask, Trajectory, Turn, turn_from_sglang

# One support per sampled token (ids int32, offsets int64, CSR).
mask = SamplingMask.from_supports([[5, 9], [2], [7, 8, 11]])
print(mask.ids, mask.offsets)           # [ 5  9  2  7  8 11] [0 2 3 6]
print(mask.prefix(2), mask[-1])         # SamplingMask(tokens=2, ids=3) [ 7  8 11]

traj = Trajectory("traj-0", prompt_tokens=[1, 2, 3], sample_index=0)
# A turn: sampled tokens, their log-probs and supports, then forced tokens
# the environment appended (singleton support, loss 0).
traj.append_turn(Turn.build([10], [-0.1], supports=[[10, 4]], forced_tokens=[20, 21]))
# Straight from an SGLang /generate response asked with return_sampling_mask:
traj.append_turn(turn_from_sglang([30], {
    "output_token_sampling_mask": [[30, 7, 8]],
    "output_token_sampling_logprobs": [-0.2],
    "finish_reason": {"type": "stop"},
}))
print(traj.mask.offsets, traj.loss_mask)  # [0 2 3 4 7] [1 0 0 1]

assert mask.ids.dtype == np.int32 and mask.offsets.dtype == np.int64
assert mask.ids.tolist() == [5, 9, 2, 7, 8, 11] and mask.offsets.tolist() == [0, 2, 3, 6]
assert len(mask.prefix(2)) == 2 and mask[-1].tolist() == [7, 8, 11]
assert traj.tokens.tolist() == [10, 20, 21, 30]  # the response: each turn's sampled, then forced tokens
assert traj.mask.offsets.tolist() == [0, 2, 3, 4, 7] and traj.loss_mask.tolist() == [1, 0, 0, 1]
print(f"ok: {traj.turns} turns, {len(traj.loss_mask)} response tokens, {int(traj.loss_mask.sum())} in the loss")
