"""A training loop that checkpoints, is killed and resumes.

The script starts a broker on loopback and sends it 24 trajectories from a
stand-in sampler (each token drawn from a support of 4 ids; the reward is
the share of even tokens). It then runs the training loop, a small torch
model taking policy-gradient steps over each token's support, as a child
process, twice. The first run checkpoints every 2 steps (model, optimizer
and the consumer's data position in one file) and is SIGKILLed right after
committing step 5. The second resumes from the checkpoint of step 4: it is
handed the batch of step 5 again, the same trajectories in the same order,
and takes the same step from the same weights (the same loss), then trains
on new data to step 6. Every trajectory is in the surviving model once.

    .venv/bin/python examples/train_resume.py
"""
import json
import math
import os
import signal
import subprocess
import sys
import tempfile

import numpy as np
import torch

from rollstream.app.harness import LoopbackNode
from rollstream.consumer import Consumer, masked_log_probs
from rollstream.producer import Producer

VOCAB = 64
BATCH, STEPS = 4, 6
CHECKPOINT_EVERY = 2
CRASH_AFTER = 5  # the first run dies once this step is committed: after the checkpoint of step 4


def produce(endpoint: str) -> list[str]:
    """Send BATCH * STEPS trajectories and wait until each is durable; their ids."""
    rng = np.random.default_rng(0)
    with Producer(endpoint, "sampler") as producer:
        ends = []
        for i in range(BATCH * STEPS):
            supports = [rng.choice(VOCAB, size=4, replace=False).tolist() for _ in range(6)]
            tokens = [int(rng.choice(support)) for support in supports]
            traj = producer.trajectory(f"t{i}", prompt_tokens=rng.integers(0, VOCAB, size=4).tolist(), sample_index=i)
            traj.turn(tokens, [math.log(1 / 4)] * len(tokens), supports=supports)
            ends.append(traj.end(reward=float(np.mean(np.array(tokens) % 2 == 0))))
        return [end.result(timeout=120).trajectory_id for end in ends]


def train(endpoints: list[str], path: str, log_path: str, run: str, crash_after: int | None = None) -> None:
    """The training loop, from the checkpoint at `path` when there is one."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, VOCAB))  # row t scores token t + 1
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def log(step, batch, loss):
        with open(log_path, "a") as out:
            out.write(json.dumps({"run": run, "step": step, "trajectory_ids": batch.trajectory_ids, "loss": loss.item(),
                                  **batch.metrics()}) + "\n")
        print(f"{run} run, step {step}: {len(batch)} trajectories, loss {loss.item():+.6f}", flush=True)

    ckpt = torch.load(path, weights_only=True) if os.path.exists(path) else None  # model, optimizer, data position
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    with Consumer(endpoints, batch_size=BATCH, vocab_size=VOCAB, on_invalid="quarantine",
                  resume=ckpt and ckpt["data"]) as consumer:
        for batch in consumer:                       # validated, packed, on the GPU when there is one
            logits = model(batch.tokens.long())      # pass batch.cu_seqlens to varlen attention
            rows = batch.response_index() - 1        # the logits that predict each response token
            logp = masked_log_probs(logits[rows], batch.response_tokens, batch.mask_ids,
                                    batch.mask_offsets, temperature=1.0)  # over the sampler's support
            advantage = (batch.rewards - batch.rewards.mean()).repeat_interleave(batch.response_lengths)
            loss = -(torch.exp(logp - batch.log_probs) * advantage * batch.loss_mask).sum() / batch.loss_mask.sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            consumer.commit(batch)                   # trained at this step; uncommitted batches come back
            step = consumer.position.step
            if step % CHECKPOINT_EVERY == 0:         # the data position goes into the model's checkpoint
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "data": consumer.state_dict()}, path)
                consumer.sealed(step)                # durable: brokers may now reclaim what it trained
            log(step, batch, loss)                   # batch.metrics(), or batch.to_train_data() for miles' dict
            if step == crash_after:
                consumer.flush(120)  # the commit is durable: the kill lands between it and the next checkpoint
                os.kill(os.getpid(), signal.SIGKILL)
            if step == STEPS:
                break
        consumer.flush(120)


def run_trainer(**args) -> int:
    """The training loop in a child process, as a job supervisor starts it; its exit status."""
    return subprocess.run([sys.executable, __file__, "--train", json.dumps(args)], timeout=600).returncode


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rollstream-train-") as work, \
            LoopbackNode("rollstream-example-", VOCAB) as node:
        produced = produce(node.endpoints["producer"])
        where = {"endpoints": [node.endpoints["consumer"]], "path": os.path.join(work, "checkpoint.pt"),
                 "log_path": os.path.join(work, "log.jsonl")}
        killed = run_trainer(**where, run="first", crash_after=CRASH_AFTER)
        assert killed == -signal.SIGKILL, f"the first run must be killed, got exit status {killed}"
        assert run_trainer(**where, run="resumed") == 0
        with open(where["log_path"]) as lines:
            records = [json.loads(line) for line in lines]
    first = [r for r in records if r["run"] == "first"]
    resumed = [r for r in records if r["run"] == "resumed"]
    assert [r["step"] for r in first] == list(range(1, CRASH_AFTER + 1))
    assert [r["step"] for r in resumed] == list(range(CRASH_AFTER, STEPS + 1))
    again, lost = resumed[0], first[CRASH_AFTER - 1]
    assert again["trajectory_ids"] == lost["trajectory_ids"], "the batch trained after the checkpoint comes back first"
    assert math.isclose(again["loss"], lost["loss"], rel_tol=1e-5), "the same weights take the same step"
    surviving = [tid for r in first[: CRASH_AFTER - 1] + resumed for tid in r["trajectory_ids"]]
    assert sorted(surviving) == sorted(produced), "every trajectory in the surviving model, once"
    print(f"ok: killed after step {CRASH_AFTER}, resumed from step {CRASH_AFTER - 1}; step {CRASH_AFTER} trained again "
          f"on the same {len(again['trajectory_ids'])} trajectories (loss {again['loss']:+.6f} both times); "
          f"{len(surviving)} trajectories in the surviving model, each once")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        train(**json.loads(sys.argv[2]))
    else:
        main()
