"""One data-parallel rank of `rollstream demo`'s mock trainer, run as
`python -m rollstream.app.demo_rank` (a process per rank, so nothing
crosses between them but gloo's own messages).

Rank 0 owns the `Consumer`; every rank takes its shard through
`DistributedConsumer` (gloo), takes a mock training step
(`masked_log_probs` over random logits on each token's support, then
backward) and commits collectively, keeping a ledger for the end-to-end
checker. With `--device cuda` the source validates each batch on the GPU
and every rank steps there; the shards still cross through host memory
(gloo), so any number of ranks share one GPU. Every `--checkpoint-every`
steps the ranks save a checkpoint (the step and the consumer's
`state_dict()`, as a real trainer saves them with its weights) and seal
it; a rank group started where a checkpoint exists resumes from it. Rank 0
closes its consumer once the stop file appears, which stops every rank;
`--die-before-commit K` SIGKILLs rank 0 just before its K-th commit,
`--die-after-commit K` just after it and `--die-before-seal K` between
saving checkpoint K and sealing it (the injected trainer faults). After
every step the source publishes its policy version (the step) to the
brokers and, with `--version-file`, writes it where the synthetic
producers read the version their trajectories are sampled at.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rollstream.consumer.batch import Batch
from rollstream.consumer.client import Consumer, ConsumerClosed
from rollstream.consumer.distributed import DistributedConsumer, decode_shard, encode_shard
from rollstream.consumer.primitives import masked_log_probs


def mock_step(shard: Batch, generator: torch.Generator) -> float:
    """A training step's shape without a model, in one pass over the shard:
    random logits over each token's own support (row r's vocabulary is its
    support, column j its j-th id, so memory stays rows x the largest
    support), the masked log-prob of every response token, a loss and its
    backward. The mean loss per trained token."""
    rows = len(shard.response_tokens)
    if shard.mask_ids is None or shard.mask_offsets is None or not rows:
        return 0.0
    device = shard.response_tokens.device
    sizes, ids = shard.support_sizes(), len(shard.mask_ids)
    owner = torch.repeat_interleave(torch.arange(rows, device=device), sizes, output_size=ids)
    column = torch.arange(ids, device=device) - shard.mask_offsets[owner]
    # Each token's column in its row: where its support holds it (inside it: validated).
    hit = torch.where(shard.mask_ids == shard.response_tokens[owner], column, 0)
    tokens = torch.zeros(rows, dtype=torch.int64, device=device).scatter_reduce(0, owner, hit, "amax")
    logits = torch.randn(rows, int(sizes.max()), generator=generator, device=device, requires_grad=True)
    logp = masked_log_probs(logits, tokens, column, shard.mask_offsets)
    loss_mask = shard.loss_mask.float()
    loss = -(logp * loss_mask).sum()
    loss.backward()
    return float(loss.detach()) / max(int(loss_mask.sum()), 1)


def on_device(shard: Batch, device: torch.device) -> Batch:
    """`shard` on `device`, as one copy of its packed tensors: a shard
    arrives where gloo put it (host memory), the source's own stays on its
    batch's device."""
    if shard.device.type == device.type:
        return shard
    header, payload = encode_shard(shard)
    return decode_shard(header, payload.to(device))


def load_checkpoint(directory: Path) -> dict | None:
    """The latest checkpoint saved in `directory`, if any."""
    latest = directory / "latest.json"
    return json.loads(latest.read_text()) if latest.exists() else None


def save_checkpoint(directory: Path, step: int, data: dict) -> None:
    """A checkpoint (here only the step: the mock trainer has no weights) with
    the data position, written whole or not at all."""
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f"step-{step}.json.partial"
    with open(partial, "w") as f:
        json.dump({"step": step, "data": data}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, directory / "latest.json")


def publish(client: Consumer | None, step: int, version_file: str | None) -> None:
    """The source's policy version after `step`: to the brokers, and to the producers' file (replaced whole)
    as the label its weights carry (naming the lineage epoch after a resume)."""
    assert client is not None  # the source rank owns it
    client.set_policy_version(step)
    if version_file is not None:
        partial = Path(f"{version_file}.partial")
        partial.write_text(client.version_label(step))
        os.replace(partial, version_file)


def _close_on(stop_file: Path, consumer: Consumer) -> None:
    """Close the source's consumer once `stop_file` exists: its next batch
    then raises `ConsumerClosed` and every rank's iteration ends."""
    while not stop_file.exists():
        time.sleep(0.1)
    consumer.close()


def main(argv: list[str] | None = None) -> None:
    """One rank's run, from its command line (`argv`, default `sys.argv[1:]`: a Ray actor passes its own)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init-file", required=True, help="gloo's rendezvous file (a fresh path per group)")
    parser.add_argument("--endpoint", required=True, action="append",
                        help="a broker's consumer endpoint (repeated: the consumer fans in from every broker)")
    parser.add_argument("--batch-size", type=int, required=True, help="groups per batch")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--partial-after", type=float, default=1.0, help="seconds before a smaller tail batch")
    parser.add_argument("--die-before-commit", type=int, default=0, help="rank 0 SIGKILLs itself before this commit (1-based)")
    parser.add_argument("--die-after-commit", type=int, default=0,
                        help="rank 0 SIGKILLs itself right after this commit (1-based): between a commit and a checkpoint")
    parser.add_argument("--die-before-seal", type=int, default=0,
                        help="rank 0 SIGKILLs itself once the checkpoint of this step is saved, before it is sealed")
    parser.add_argument("--checkpoint-dir", required=True, help="where rank 0 saves checkpoints (and resumes from)")
    parser.add_argument("--checkpoint-every", type=int, default=1, help="steps between checkpoints")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="a slow trainer: each step takes at least this long")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="the trainer's own staleness bound, in policy versions (lowers the brokers')")
    parser.add_argument("--version-file", help="where the source writes its policy version after every step")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the source validates batches and every rank takes its step")
    parser.add_argument("--curve-secret-key", help="the trainer's own .key_secret: CURVE to the brokers")
    parser.add_argument("--curve-server-key", help="the brokers' public .key")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dist.init_process_group("gloo", init_method=f"file://{args.init_file}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=60))
    client = None
    checkpoints = Path(args.checkpoint_dir)
    if args.rank == 0:
        checkpoint = load_checkpoint(checkpoints)
        client = Consumer(args.endpoint, batch_size=args.batch_size, unit="group", vocab_size=args.vocab_size,
                          device=device, on_invalid="quarantine", world_size=args.world,
                          resume=None if checkpoint is None else checkpoint["data"], max_staleness=args.max_staleness,
                          curve_secret_key=args.curve_secret_key, curve_server_key=args.curve_server_key)
        threading.Thread(target=_close_on, args=(Path(args.stop_file), client), daemon=True).start()
    shards = DistributedConsumer(client, strategy="group", device="cpu", partial_after=args.partial_after,
                                 ledger=args.ledger)
    state = shards.state_dict()
    if args.rank == 0:
        publish(client, state["step"], args.version_file)
        if state["step"] == 0:  # the first checkpoint: a restart before the next starts from here
            save_checkpoint(checkpoints, 0, state)
    generator = torch.Generator(device=device).manual_seed(args.rank)
    commits = 0
    try:
        for shard in shards:
            mock_step(on_device(shard, device), generator)
            time.sleep(args.step_seconds)
            if args.rank == 0 and commits + 1 == args.die_before_commit:
                os.kill(os.getpid(), signal.SIGKILL)
            shards.commit(shard)
            commits += 1
            if args.rank == 0 and commits == args.die_after_commit:
                assert client is not None  # the source rank owns it
                # The commit is durable (a broker restarting meanwhile answers once it is back, however long that
                # takes): the kill lands between it and the next checkpoint.
                client.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            state = shards.state_dict()
            if args.rank == 0:
                publish(client, state["step"], args.version_file)
            if state["step"] % args.checkpoint_every == 0:
                if args.rank == 0:
                    save_checkpoint(checkpoints, state["step"], state)
                    if state["step"] == args.die_before_seal:
                        os.kill(os.getpid(), signal.SIGKILL)
                shards.sealed(state["step"])
    except ConsumerClosed:  # the source stopped between batches
        pass
    finally:
        shards.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
