"""`rollstream demo --train`: the model in the loop.

Producers sample multi-turn rollouts from `TinyLM` (the `model` source);
this trainer holds the same model, and for every batch recomputes each
sampled token's log-prob from the weights it was sampled with, (a) over the
transported support with `masked_log_probs` and (b) over the whole
vocabulary, and compares both with what the sampler reported: (a) agrees to
float tolerance, (b) is lower by the log of the support's probability mass,
the bias a trainer that ignores the support would carry. The producers also
send every support id's log-prob (`mask_log_probs`), and `support_kl`
measures the divergence of the replayed distribution over each support from
the sampler's: float rounding alone. It then takes a
GRPO-style policy-gradient step (group-normalised advantages, the importance
ratio against the rollout's truncated log-probs, clipped, each token weighted
down by how many versions its weights lag the trainer's: `batch.token_versions`),
writes the new weights for the producers and goes on. A batch costs one
forward pass per weight version it replays and one for the step, its
sequences padded to the longest; with `device="cuda"` (`rollstream demo
--train --device cuda`) the model, the batches, the replay and the step
stay on the GPU, while the producers sample on the CPU.

Every `checkpoint_every` steps it takes a checkpoint (model, optimizer, the
weight versions it replays with, and the consumer's `state_dict()`; kept in
memory here, where a real trainer writes it to disk) and seals it. With
`chaos`, the trainer crashes once between a commit and its next checkpoint
and resumes from the last one: the producers reload its weights, and the
batches trained since come back and are trained again, as they were.
Producers and the consumer keep ledgers, so the end-to-end checker reports
on the lineage the final model descends from.

The trainer publishes its policy version (its step) after every step. With
`max_staleness` the broker bounds how many versions a trajectory's oldest
turn may lag it (admission, dispatch, delivery; docs/consumer.md,
"Staleness"); with `group_filter` it drops groups without a learning signal
before they take a batch slot. A run whose broker says it starves (its
filters drop nearly everything once rewards saturate) stops cleanly and
says why (`starved`).

A run passes (`ok`) when it keeps the rules `failures` names: the
checker's, the replay bound and the reward check; `rollstream demo
--train` exits 1 otherwise.
"""
from __future__ import annotations

import copy
import os
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from rollstream.common.checker import broker_backlog, check, read_records
from rollstream.common.clock import Clock
from rollstream.common.errors import TimedOut
from rollstream.common.versions import oldest_version
from rollstream.consumer.batch import Batch, cumsum0, to_device
from rollstream.consumer.client import Consumer
from rollstream.consumer.primitives import masked_log_probs, support_kl

from .demo import archive_line, archive_summary, batches_again, checker_counts, discarded_on_purpose
from .harness import LoopbackNode, end_runs
from .tiny_lm import TinyLM, TinyLMConfig, save_weights

VOCAB = TinyLMConfig().vocab_size
STALENESS_DECAY = 0.5  # a sampled token's weight in the loss is this to the power of its staleness
# The replay bound: float32 logits against the sampler's float64 stay orders of magnitude inside it,
# while a replay with other weights or another temperature is off by far more.
REPLAY_TOLERANCE = 1e-4
# The bound on the KL over a support between the replay and the sampler: with the same weights it is float32
# rounding of a difference of terms the size of the logits, while another temperature or other weights give
# orders of magnitude more.
REPLAY_KL_TOLERANCE = 1e-4
# From this many steps the reward must have risen: the first and last steps' windows (`TrainingLog.summary`)
# are then five batches each and far apart; in a shorter run they are a batch or two, mostly noise.
LEARNING_STEPS = 20


def _cells(lengths: np.ndarray, first: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) on `device` of `lengths[i]` consecutive cells from
    column `first[i]` in row `i`, row after row: built from host-known
    lengths, so nothing is read back from the device."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    columns = np.arange(int(lengths.sum())) - np.repeat(cumsum0(lengths)[:-1] - first, lengths)
    return to_device(rows, device), to_device(columns, device)


def response_logits(model: TinyLM, batch: Batch) -> torch.Tensor:
    """`[R, V]`: for every response token of the batch (its response axis),
    the logits that scored it, from one forward pass over the whole batch.
    Its sequences are right-padded to the longest: attention is causal, so
    no real position sees the padding."""
    sequence = batch.lengths["sequence"]
    padded = torch.zeros(len(batch), int(sequence.max()), dtype=torch.int64, device=batch.device)
    padded[_cells(sequence, np.zeros(len(batch), np.int64), batch.device)] = batch.tokens.long()
    # The logits that score a sample's first response token sit at its last prompt position.
    return model(padded)[_cells(batch.lengths["response"], batch.lengths["prompt"] - 1, batch.device)]


class WeightVersions:
    """Recent weights the producers were served, by version label, so a
    trajectory sampled with an older one is replayed with exactly those
    weights. It stands for the store the engines load weights from, which
    outlives a trainer crash: a resumed trainer's replayed batches hold
    trajectories sampled by weights its abandoned lineage made after the
    checkpoint, and their labels (`12`, where the resumed ones are `e1:12`)
    still find them."""

    def __init__(self, config: TinyLMConfig, keep: int = 16, device: str | torch.device = "cpu"):
        self.keep = keep
        self._states: OrderedDict[str, dict] = OrderedDict()  # on the trainer's device, as its model
        self._scratch = TinyLM(config).to(device).eval()

    def add(self, version: str, model: TinyLM) -> None:
        self._states[version] = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        while len(self._states) > self.keep:
            self._states.popitem(last=False)

    def model(self, version: str) -> TinyLM | None:
        """A model holding `version`'s weights (one shared scratch model), or None if no longer kept."""
        state = self._states.get(version)
        if state is None:
            return None
        self._scratch.load_state_dict(state)
        return self._scratch


@dataclass
class Replay:
    """One batch replayed with the weights each trajectory was sampled with."""

    support_diffs: np.ndarray  # |masked_log_probs - rollout| per sampled token replayed
    full_diffs: np.ndarray  # |full-vocabulary log-prob - rollout| per sampled token replayed
    support_kls: np.ndarray  # KL(sampler || replay) over each replayed token's support, where the batch carries it
    truncated: np.ndarray  # per sampled token replayed: its support is smaller than the vocabulary
    replayed: int  # trajectories replayed (every weight version that sampled them still kept)
    skipped: int  # trajectories not replayed whole (a version that sampled them no longer kept, or no spans)
    worst: tuple[float, str] | None = None  # the largest support difference and the version replayed with


@torch.no_grad()
def replay(batch: Batch, versions: WeightVersions, temperature: float) -> Replay:
    """Recompute every sampled token's log-prob both ways with the weights
    that sampled it: one forward pass per weight version, over the
    trajectories it sampled tokens of, keeping those tokens (a trajectory
    continued after its producer restarted spans versions), and one copy
    to the host per version."""
    by_version: dict[str, list[int]] = {}
    skipped: set[int] = set()
    for i, (names, spans) in enumerate(zip(batch.weight_versions, batch.weight_version_spans)):
        if len(set(names)) > 1 and not any(spans):  # which token which weights sampled is not known
            skipped.add(i)
            continue
        for name in dict.fromkeys(names):
            by_version.setdefault(name, []).append(i)
    support, full, kls, truncated = [], [], [], []
    worst: tuple[float, str] | None = None
    for version, samples in by_version.items():
        model = versions.model(version)
        if model is None:
            skipped.update(samples)
            continue
        part = batch.select(samples)
        logits = response_logits(model, part)
        masked = masked_log_probs(logits, part.response_tokens, part.mask_ids, part.mask_offsets,
                                  temperature=temperature)
        scaled = logits / temperature  # float32: only the token's log-prob is kept, not a [R, V] log-softmax
        whole = scaled.gather(1, part.response_tokens.long()[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)
        cut = (part.support_sizes() < logits.shape[1]).to(masked.dtype)
        mine = part.loss_mask.bool() & torch.as_tensor(sampled_by(part, version), device=part.loss_mask.device)
        # Differences of float32 values, taken on the host in float64: exact, so a replay that matches reads 0.
        masked_host, whole_host, rollout, cut_host = (
            torch.stack([masked, whole, part.log_probs, cut])[:, mine].cpu().numpy().astype(np.float64))
        support.append(np.abs(masked_host - rollout))
        full.append(np.abs(whole_host - rollout))
        if part.mask_log_probs is not None:
            kls.append(support_kl(logits, part.mask_ids, part.mask_offsets, part.mask_log_probs,
                                  temperature=temperature)[mine].cpu().numpy().astype(np.float64))
        truncated.append(cut_host == 1)
        if support[-1].size and (worst is None or float(support[-1].max()) > worst[0]):
            worst = (float(support[-1].max()), version)
    return Replay(_concat(support, np.float64), _concat(full, np.float64), _concat(kls, np.float64),
                  _concat(truncated, bool), len(batch) - len(skipped), len(skipped), worst)


def sampled_by(batch: Batch, version: str) -> np.ndarray:
    """bool [R] on the host: the response tokens weights `version` sampled,
    by the spans the broker delivered (a trajectory without spans: all of
    it when it names `version` alone)."""
    out = np.zeros(int(batch.lengths["response"].sum()), dtype=bool)
    base = 0
    for names, turns, length in zip(batch.weight_versions, batch.weight_version_spans, batch.lengths["response"].tolist()):
        spans = [span for spans in turns for span in spans]
        if not spans:
            out[base:base + length] = set(names) == {version}
        for text, start, end in spans:
            if text == version:
                out[base + start:base + end] = True
        base += length
    return out


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    """The parts end to end; an empty array of `dtype` when there are none."""
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Each reward minus its group's mean, over the group's standard
    deviation (GRPO); 0 for a group whose rewards are all equal."""
    # One slot per sample holds every group (numbered from 0) without reading the largest number back
    # from the device; the slots no group uses stay 0 (counted 1, so nothing divides by 0).
    slots = rewards.new_zeros(len(group_index))
    count = slots.index_add(0, group_index, torch.ones_like(rewards)).clamp(min=1)
    mean = slots.index_add(0, group_index, rewards) / count
    centred = rewards - mean[group_index]
    spread = (slots.index_add(0, group_index, centred ** 2) / count).sqrt()
    return centred / (spread[group_index] + 1e-6)


def token_staleness(batch: Batch, current: int) -> torch.Tensor:
    """Per response token, the versions between the weights that sampled it
    (`batch.token_versions`) and the trainer's `current` ones; -1 where that
    version is unknown (forced tokens, versions without an order). A version
    ahead of `current` (a lineage a resume abandoned) counts 0."""
    versions = batch.token_versions
    return torch.where(versions >= 0, (current - versions).clamp(min=0), -1)


def staleness_weights(batch: Batch, current: int, decay: float = STALENESS_DECAY) -> torch.Tensor:
    """Per response token, `decay` to the power of its staleness: fresh
    tokens count fully, older ones less; 1 where the version is unknown."""
    return decay ** token_staleness(batch, current).clamp(min=0).to(torch.float32)


def policy_loss(model: TinyLM, batch: Batch, temperature: float, current: int, clip: float = 0.2) -> torch.Tensor:
    """The clipped surrogate over sampled tokens: the importance ratio of the
    current weights' truncated log-prob (over the transported support) to
    the rollout's, times the trajectory's group advantage, averaged with
    each token weighted by its staleness against the `current` version
    (`staleness_weights`)."""
    logits = response_logits(model, batch)
    new = masked_log_probs(logits, batch.response_tokens, batch.mask_ids, batch.mask_offsets, temperature=temperature)
    ratio = torch.exp(new - batch.log_probs)
    advantage = torch.repeat_interleave(group_advantages(batch.rewards, batch.group_index), batch.response_lengths,
                                        output_size=len(batch.response_tokens))
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    sampled = batch.loss_mask.bool()
    weight = staleness_weights(batch, current)[sampled]
    return -(weight * surrogate[sampled]).sum() / weight.sum()


@dataclass
class TrainingLog:
    """What the loop saw, step by step."""

    rewards: list[float] = field(default_factory=list)  # mean reward of each step's batch
    staleness: list[int] = field(default_factory=list)  # per trajectory: trainer steps since its oldest turn's weights
    token_staleness: list[np.ndarray] = field(default_factory=list)  # per sampled token of a known version, the same
    support_diffs: list[np.ndarray] = field(default_factory=list)
    full_diffs: list[np.ndarray] = field(default_factory=list)
    support_kls: list[np.ndarray] = field(default_factory=list)
    truncated: list[np.ndarray] = field(default_factory=list)
    skipped: int = 0
    worst: dict | None = None  # the largest support difference replayed: its step and weight version

    def replayed(self, step: int, replay: Replay) -> None:
        """One batch's replay joins the figures."""
        self.support_diffs.append(replay.support_diffs)
        self.full_diffs.append(replay.full_diffs)
        self.support_kls.append(replay.support_kls)
        self.truncated.append(replay.truncated)
        self.skipped += replay.skipped
        if replay.worst is not None and (self.worst is None or replay.worst[0] > self.worst["diff"]):
            self.worst = {"diff": replay.worst[0], "version": replay.worst[1], "step": step}

    def summary(self, steps: int) -> dict:
        support = np.concatenate(self.support_diffs) if self.support_diffs else np.zeros(0)
        full = np.concatenate(self.full_diffs) if self.full_diffs else np.zeros(0)
        kls = _concat(self.support_kls, np.float64)
        truncated = np.concatenate(self.truncated) if self.truncated else np.zeros(0, bool)
        tokens = _concat(self.token_staleness, np.int64)
        window = max(1, min(5, len(self.rewards) // 4))
        return {
            "steps": steps,
            "reward_first": round(float(np.mean(self.rewards[:window])), 4) if self.rewards else None,
            "reward_last": round(float(np.mean(self.rewards[-window:])), 4) if self.rewards else None,
            "replay_max_abs_diff_support": float(support.max()) if support.size else None,
            "replay_mean_abs_diff_full": float(full.mean()) if full.size else None,
            "replay_max_support_kl": float(kls.max()) if kls.size else None,
            "replay_tokens": int(support.size),
            "truncated_share": round(float(truncated.mean()), 4) if truncated.size else None,
            "full_diff_min_where_truncated": float(full[truncated].min()) if truncated.any() else None,
            "staleness_mean": round(float(np.mean(self.staleness)), 3) if self.staleness else None,
            "staleness_max": int(max(self.staleness)) if self.staleness else None,
            "token_staleness_mean": round(float(tokens.mean()), 3) if tokens.size else None,
            "token_staleness_max": int(tokens.max()) if tokens.size else None,
            "skipped_trajectories": self.skipped,
            "replay_worst": self.worst,
        }


def batch_staleness(batch: Batch, current: int) -> list[int]:
    """Per trajectory, the versions between its oldest turn's weights and the trainer's `current` ones."""
    oldest = (oldest_version(names) for names in batch.weight_versions)
    return [max(0, current - version) for version in oldest if version is not None]


def run_train_demo(*, steps: int = 60, producers: int = 2, group_size: int = 4, batch_groups: int = 4, turns: int = 2,
                   prompt_tokens: int = 8, response_tokens: int = 16, tool_tokens: int = 4, temperature: float = 1.0,
                   top_k: int = 20, top_p: float = 0.95, learning_rate: float = 3e-3, seed: int = 0,
                   plot: str | None = None, progress=print, keep_data: bool = False, chaos: bool = False,
                   checkpoint_every: int = 5, max_staleness: int | None = None, group_filter: str | None = None,
                   endpoints_file: str | None = None, starvation_after: float = 20.0, device: str = "cpu",
                   archive: str | None = None, timeout: float = 180.0) -> dict:
    """Run the loop for `steps` batches (fewer if the broker says the run
    starves); return the summary (and write the plot to `plot` when given).
    Raises if any stage fails. With `chaos` the trainer crashes between its
    second checkpoint and its third and resumes. The trainer (its model,
    batches, replay and steps) runs on `device`; the producers sample on
    the CPU. With `archive` (a directory) the broker archives what it
    deletes there (docs/archive.md); once the trainer stops, its run is
    ended, so the archive holds all it trained, and the broker stops only
    when nothing waits for the archive (within `timeout` seconds)."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # a model this small gains nothing from a thread pool beside the daemons
    model = TinyLM(seed=seed).to(device)
    versions = WeightVersions(model.config, device=device)
    versions.add("step-0", model)  # the initial weights are version 0: versions are the trainer's steps
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    log = TrainingLog()
    # Between a commit and the next checkpoint, past the second checkpoint:
    crash_after = 2 * checkpoint_every + max(1, checkpoint_every // 2) if chaos else None
    broker_args = ("--starvation-window", str(2 * starvation_after), "--starvation-after", str(starvation_after),
                   *(("--max-staleness", str(max_staleness)) if max_staleness is not None else ()),
                   *(("--group-filters", group_filter) if group_filter else ()),
                   *(("--archive", archive) if archive is not None else ()))
    starved = None
    runs: set[str] = set()  # the trainer's run: one, resumed after a crash
    with LoopbackNode("rollstream-train-", VOCAB, keep_data=keep_data, broker_args=broker_args,
                      endpoints_file=endpoints_file) as node:
        started = Clock.monotonic()
        ledgers = node.work / "ledgers"
        weights = node.work / "policy.safetensors"
        save_weights(model, weights, "step-0")  # the producers start from the file, as after every step
        for i in range(producers):
            node.producer("--source", "model", "--model-weights", str(weights), "--producer-id", f"train-producer-{i}",
                          "--trajectories", "0", "--group-size", str(group_size), "--turns", str(turns),
                          "--prompt-tokens", str(prompt_tokens), "--response-tokens", str(response_tokens),
                          "--tool-tokens", str(tool_tokens), "--temperature", str(temperature), "--top-k", str(top_k),
                          "--top-p", str(top_p), "--seed", str(seed + 1 + i), "--concurrency", "2",
                          "--ledger", str(ledgers / f"producer-{i}.jsonl"))

        def connect(resume: dict | None, version: int) -> Consumer:
            consumer = Consumer([node.endpoints["consumer"]], batch_size=batch_groups, unit="group", vocab_size=VOCAB,
                                device=device, on_invalid="raise", resume=resume, ledger=ledgers / "trainer.jsonl")
            consumer.set_policy_version(version)
            runs.add(consumer.position.run)
            return consumer

        def next_batch(consumer: Consumer) -> Batch | None:
            """The next batch, or None once the broker says the run starves (and why)."""
            nonlocal starved
            deadline = Clock.monotonic() + 120.0
            while True:
                try:
                    return consumer.next_batch(timeout=2.0)
                except TimedOut:
                    starving = (node.admin.status().get("starving", {}) if node.admin is not None else {})
                    if starving.get("default"):
                        starved = ",".join(starving["default"])
                        progress(f"the broker says the run starves ({starved}): stopping")
                        return None
                    if Clock.monotonic() > deadline:
                        raise

        consumer = connect(None, 0)
        checkpoint: dict[str, Any] = {  # step 0: a restart before the next checkpoint starts here
            "model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict()),
            "data": consumer.state_dict(), "label": "step-0"}
        step = 0
        try:
            while step < steps:
                batch = next_batch(consumer)
                if batch is None:
                    break
                step += 1
                loss, replayed = train_step(model, optimizer, batch, step, versions, log, temperature)
                consumer.commit(batch, step, policy_version=step)
                label = consumer.version_label(step)  # `e1:12` after a resume: not the abandoned lineage's step 12
                versions.add(label, model)
                save_weights(model, weights, label)
                progress(progress_line(step, steps, log.rewards[-1], loss, replayed))
                if step % checkpoint_every == 0:
                    checkpoint = {"model": copy.deepcopy(model.state_dict()),
                                  "optimizer": copy.deepcopy(optimizer.state_dict()),
                                  "data": consumer.state_dict(), "label": label}
                    consumer.sealed(step)
                if step == crash_after:
                    crash_after = None
                    consumer.flush(30)  # the commit is durable; the crash comes before the next checkpoint
                    consumer.close(timeout=0)
                    crashed = step
                    model.load_state_dict(checkpoint["model"])
                    optimizer.load_state_dict(checkpoint["optimizer"])
                    step = checkpoint["data"]["step"]
                    save_weights(model, weights, checkpoint["label"])  # the producers reload the resumed weights
                    progress(f"trainer crashed after step {crashed}; resuming from its checkpoint of step {step}")
                    consumer = connect(checkpoint["data"], step)
            consumer.flush(30)
        finally:
            consumer.close()
        node.finish_producers(stop=True)
        status: dict[str, Any] = node.admin.status() if node.admin is not None else {"queued": 1, "leased": 0}
        dead = node.dead_letters()
        report = check(read_records([ledgers]), dead, broker_backlog=broker_backlog(status))
        if archive is not None:
            archived = archive_summary(archive, sorted(runs), end_runs(node, runs, timeout))
        kept = node.work if keep_data else None
    summary = log.summary(step)
    summary["weights_digest"] = weights_digest(model)
    summary.update(report.summary())
    summary["left_at_broker"] = len(report.unseen)  # acked, durable, still to deliver when the run stopped
    reasons = Counter(item["reason"].partition(":")[0] for item in dead)
    discarded = reasons["stale"] + reasons["filtered"]
    trained = status["counters"].get("trajectories.delivered", 0) + status.get("unsealed", 0)
    summary.update(max_staleness=max_staleness, group_filter=group_filter, stale_dropped=reasons["stale"],
                   filtered=reasons["filtered"], abandoned=reasons["abandoned"],
                   discarded_share=round(discarded / (discarded + trained), 4) if discarded + trained else 0.0,
                   starved=starved)
    summary["seconds"] = round(Clock.monotonic() - started, 1)
    if archive is not None:
        summary["archive"] = archived
    if kept is not None:
        summary["data_kept_in"] = str(kept)
    if plot:
        summary["plot"] = _plot(log, plot)
    summary["failed"] = failures(summary, discarded_on_purpose(max_staleness, group_filter, chaos=chaos))
    summary["ok"] = not summary["failed"]
    return summary


def train_step(model: TinyLM, optimizer: torch.optim.Optimizer, batch: Batch, step: int, versions: WeightVersions,
               log: TrainingLog, temperature: float) -> tuple[float, Replay]:
    """Step `step` on `batch`: its replay against the weights that sampled
    it joins `log`, then one policy-gradient step (the trainer's version is
    still `step - 1`). Returns the loss and the replay."""
    replayed = replay(batch, versions, temperature)
    log.replayed(step, replayed)
    log.rewards.append(float(batch.rewards.mean()))
    log.staleness += batch_staleness(batch, step - 1)
    staleness = token_staleness(batch, step - 1)
    log.token_staleness.append(staleness[batch.loss_mask.bool() & (staleness >= 0)].cpu().numpy())
    optimizer.zero_grad()
    loss = policy_loss(model, batch, temperature, step - 1)
    loss.backward()
    optimizer.step()
    return loss.item(), replayed


def weights_digest(model: TinyLM) -> str:
    """A digest of the model's weights, bit for bit (two runs that trained alike give the same)."""
    digest = xxhash.xxh3_64()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def retrain_from_archive(source: str, *, steps: int | None = None, learning_rate: float = 3e-3, seed: int = 0,
                         temperature: float = 1.0, device: str = "cpu", progress=print) -> dict:
    """Train a fresh model, as `run_train_demo` does with the same
    arguments, on the batches a demo run trained, from its archive (a
    broker's, exported first) or a dataset `rollstream export` wrote
    (`Consumer.from_archive`, as trained, through `steps` when given): no
    producer or broker. Each step's weights take the label the run gave
    them (its step, and its lineage epoch), so the batches' weight versions
    replay against them. The summary: the steps, the replay's figures and
    `weights_digest`, equal to the run's when both trained alike."""
    import tempfile
    from pathlib import Path

    from rollstream.broker.archive import is_archive
    from rollstream.broker.export import export_archive
    from rollstream.common.versions import version_label

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model = TinyLM(seed=seed).to(device)
    versions = WeightVersions(model.config, device=device)
    versions.add("step-0", model)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    log = TrainingLog()
    step = 0
    with tempfile.TemporaryDirectory(prefix="rollstream-retrain-") as work:
        dataset = Path(source)
        if dataset.is_dir() and is_archive(dataset):
            dataset = Path(work) / "run.parquet"
            export_archive(source, dataset)
        selected = None if steps is None else (1, steps)
        consumer = Consumer.from_archive(dataset, steps=selected, vocab_size=VOCAB, device=device)
        with consumer:
            epochs = consumer.rows.epochs
            for batch in consumer:
                recorded = consumer.step_of(batch)
                assert recorded is not None  # a replay commits at the steps it replays
                step = recorded
                loss, replayed = train_step(model, optimizer, batch, step, versions, log, temperature)
                consumer.commit(batch)
                versions.add(version_label(step, epochs.get(step) or 0), model)
                progress(progress_line(step, steps or step, log.rewards[-1], loss, replayed))
    summary = log.summary(step)
    summary.update(weights_digest=weights_digest(model), source=str(source))
    return summary


def progress_line(step: int, steps: int, reward: float, loss: float, replayed: Replay) -> str:
    """One step's line: its batch's mean reward, the loss, and the replay's
    largest difference over the support and mean one over the vocabulary.
    Short enough for an 80-column terminal up to step 9999 and a loss of
    -99.9999."""
    worst = float(replayed.support_diffs.max()) if replayed.support_diffs.size else float("nan")
    full = float(replayed.full_diffs.mean()) if replayed.full_diffs.size else float("nan")
    return (f"step {step:>3}/{steps}  reward {reward:.3f}  loss {loss:+.4f}  "
            f"|diff| support {worst:.1e}, full {full:.3f}")


def failures(summary: dict, expected_dead: set[str]) -> list[str]:
    """The rules a finished run broke, each naming the rule, the expected
    and the actual value; none when it passes. The checker's `unseen` is
    not one: the trainer stops after its steps while the producers go on,
    so what they sent last is still at the broker (`left_at_broker`)."""
    broken = [f"checker: expected 0 {name}, got {summary[name]}"
              for name in ("lost", "duplicated", "partial", "corrupted") if summary[name]]
    unexpected = sorted(set(summary["dead_lettered"]) - expected_dead)
    if unexpected:
        broken.append(f"checker: expected acked trajectories dead-lettered only for {sorted(expected_dead)}, "
                      f"got {unexpected}")
    if summary["replayed_batches_identical"] is False:
        broken.append("resume: expected the batches trained again to be the ones trained first, got others")
    worst = summary["replay_max_abs_diff_support"]
    if summary["steps"] and not summary["replay_tokens"]:
        broken.append(f"replay bound: expected sampled tokens replayed in {summary['steps']} steps, got none")
    elif worst is not None and not worst <= REPLAY_TOLERANCE:  # NaN breaks it too
        broken.append(f"replay bound: expected every sampled token's log-prob replayed over its support within "
                      f"{REPLAY_TOLERANCE:g} of the sampler's, got {worst:.3g} (replay_worst {summary['replay_worst']})")
    kl = summary["replay_max_support_kl"]
    if kl is not None and not kl <= REPLAY_KL_TOLERANCE:  # NaN breaks it too
        broken.append(f"replay bound: expected the KL from the sampler's distribution over each support to the "
                      f"replay's within {REPLAY_KL_TOLERANCE:g}, got {kl:.3g}")
    first, last = summary["reward_first"], summary["reward_last"]
    if first is not None and not (0 <= first <= 1 and 0 <= last <= 1):
        broken.append(f"reward: expected a share of sampled tokens in [0, 1], got {first} first and {last} last")
    elif first is not None and summary["steps"] >= LEARNING_STEPS and not last > first:
        broken.append(f"reward: expected the last steps' mean reward above the first steps' after "
                      f"{summary['steps']} steps (at least {LEARNING_STEPS}), got {first} first and {last} last")
    return broken


def _plot(log: TrainingLog, path: str) -> str | None:
    """The per-token replay error both ways and the reward curve, as a PNG;
    None (and nothing written) without matplotlib (the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    support, full = _concat(log.support_diffs, np.float64), _concat(log.full_diffs, np.float64)
    kls = _concat(log.support_kls, np.float64)
    figure, (errors, rewards, staleness) = plt.subplots(1, 3, figsize=(16, 4))
    floor = 1e-12  # a difference of exactly 0 on a log axis
    errors.semilogy(np.maximum(full, floor), ".", markersize=2, label="full vocabulary")
    errors.semilogy(np.maximum(support, floor), ".", markersize=2, label="over the transported support")
    if kls.size:
        errors.semilogy(np.maximum(kls, floor), ".", markersize=2, label="KL(sampler || replay) over the support")
    errors.set(xlabel="sampled token (by batch, then weight version)",
               ylabel="|recomputed - rollout log-prob|, KL (nats)", title="replaying the sampler's distribution")
    errors.legend(loc="lower center", bbox_to_anchor=(0.5, 0.08))  # between the two bands and the exact zeros
    rewards.plot(range(1, len(log.rewards) + 1), log.rewards)
    rewards.set(xlabel="step", ylabel="mean reward of the batch", title="reward")
    top = max(log.staleness, default=0)
    staleness.hist(log.staleness, bins=np.arange(top + 2) - 0.5, rwidth=0.8)
    staleness.set(xlabel="policy versions behind the trainer (oldest turn)", ylabel="trajectories trained",
                  title="staleness", xticks=range(top + 1))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return os.path.abspath(path)


def summary_table(summary: dict) -> str:
    """The run's figures, one row each, its verdict last; "n/a" where a figure has no value."""

    def number(value, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    rows = [
        ("steps", summary["steps"]),
        ("reward, first / last", f"{number(summary['reward_first'], '.3f')} / {number(summary['reward_last'], '.3f')}"),
        ("replay max |diff|, over the support", number(summary["replay_max_abs_diff_support"], ".2e")),
        ("replay mean |diff|, full vocabulary", number(summary["replay_mean_abs_diff_full"], ".4f")),
        ("replay max KL from the sampler, over the support", number(summary["replay_max_support_kl"], ".2e")),
        ("sampled tokens replayed", summary["replay_tokens"]),
        ("share of them with a truncated support", number(summary["truncated_share"], ".3f")),
        ("staleness in weight versions, mean / max",
         f"{number(summary['staleness_mean'], '.2f')} / {number(summary['staleness_max'], 'd')}"),
        ("the same per sampled token (the loss's weights), mean / max",
         f"{number(summary['token_staleness_mean'], '.2f')} / {number(summary['token_staleness_max'], 'd')}"),
        ("trajectories not replayed (weights no longer kept)", summary["skipped_trajectories"]),
        ("max staleness / group filter", f"{number(summary['max_staleness'], 'd')} / {summary['group_filter'] or 'none'}"),
        ("dropped stale / filtered, share of the finished",
         f"{summary['stale_dropped']} / {summary['filtered']}, {summary['discarded_share']:.3f}"),
        ("starved", summary["starved"] or "no"),
        ("resumed from the checkpoint of step", number(summary["resumed_from_step"], "d")),
        ("sampled by the abandoned lineage, dropped", summary["abandoned"]),
        ("trained again after the resume", batches_again(summary)),
        ("checker", checker_counts(summary)),
        ("acked, still at the broker when the run stopped", summary["left_at_broker"]),
        ("time", f"{summary['seconds']} s"),
    ]
    if "plot" in summary:
        rows.append(("plot", summary["plot"] or "not written: it needs matplotlib (the plot extra)"))
    if "archive" in summary:
        rows.append(("archive", archive_line(summary["archive"])))
    if "data_kept_in" in summary:
        rows.append(("data kept in", summary["data_kept_in"]))
    rows.append(("verdict", "ok" if summary["ok"] else f"FAILED: {'; '.join(summary['failed'])}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(["rollstream demo --train: model producers + broker + a replaying trainer on loopback",
                      *(f"  {name:<{width}}  {value}" for name, value in rows)])
