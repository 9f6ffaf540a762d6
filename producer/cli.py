"""`rollstream producer`: the long-running producer daemon."""
from __future__ import annotations

import click

from rollstream.common.config import BYTES, SETTINGS_CONTEXT, config_option, settings_options

from .settings import ProducerSettings
from .sources import source_names


class SourceName(click.ParamType):
    """`--source`: a registered source's name. Its choices are read from the
    registry when the help is shown, so a source that a layer above
    registers after this module loads is listed too; the name is checked
    with the other settings (`daemon.violations`)."""

    name = "text"

    def get_metavar(self, param: click.Parameter, ctx: click.Context) -> str:
        return f"[{'|'.join(source_names())}]"


HELP = {
    "source": "synthetic: sampled load; sglang: drive an SGLang /generate endpoint; replay: recorded turns; "
              "model (registered by the `rollstream` command): sample from a small torch LM (rollstream.app.tiny_lm).",
    "broker_endpoint": "The node broker's producer endpoint (tcp://, ipc:// or inproc://).",
    "producer_id": "Name sent in hello; keep it stable to resend a spool after a restart. Default: host-source.",
    "job": "The job its trajectories belong to: a broker keeps jobs apart, and hands them only to consumers of "
           "the same job (an evaluation run, a second experiment).",
    "window": "Most frames unsettled at once (the broker's welcome may lower it).",
    "reply_timeout": "Seconds without a reply after which unacked frames are reported (they are resent only after a "
                     "reconnect, or when a later ping is answered first).",
    "retry_delay": "Seconds before resending a frame the broker answered `unavailable`.",
    "heartbeat_interval": "Seconds between pings.",
    "heartbeat_timeout": "Seconds of broker silence after which it counts as down (broker_up = 0).",
    "spool_dir": "Directory of the disk spool of unacked frames; none: frames live in memory only.",
    "spool_bytes": "Spool budget; when it is used up, the source waits (backpressure).",
    "spool_fsync": "fsync every spool write (survives power loss, slower).",
    "shutdown_timeout": "Seconds to wait, on SIGTERM or at the end, for open trajectories and in-flight acks.",
    "crc": "Send a CRC-32 of the array frames with every turn.",
    "ledger": "Append a record of every trajectory sent and acked to this JSON-lines file, for the end-to-end "
              "checker (rollstream.common.checker; docs/operations.md).",
    "check_content": "Also check each turn's content rules before sending (the broker checks every frame anyway).",
    "trajectories": "Trajectories to produce; 0: until stopped (replay and --prompts end with their files).",
    "group_size": "Samples per prompt, sent as one group when more than 1.",
    "turns": "Engine calls per trajectory.",
    "prompt_tokens": "Mean prompt length of synthetic prompts (uniform in [x/2, 3x/2]).",
    "response_tokens": "Mean sampled tokens per turn (synthetic); max_new_tokens (sglang).",
    "tool_tokens": "Mean forced tool-output tokens between turns (synthetic); echoed tokens (sglang tool).",
    "tool_seconds": "Synthetic: seconds the environment takes between two turns (a tool call); the trajectory stays "
                    "open meanwhile.",
    "rate": "Trajectory starts per second; 0: as fast as the broker takes them.",
    "concurrency": "Trajectories in progress at once.",
    "vocab_size": "Vocabulary size: synthetic ids are drawn below it and every id is checked against it.",
    "seed": "Random seed of the synthetic source, of random prompts and of the model source's initial weights.",
    "temperature": "Sampling temperature.",
    "top_k": "Top-k truncation; <= 0 disables it.",
    "top_p": "Top-p (nucleus) truncation.",
    "min_p": "Min-p truncation.",
    "abort_rate": "Synthetic: chance that a later turn is aborted without supports (a replay gap).",
    "version_file": "Synthetic: a file holding the trainer's policy version (an integer), read as each trajectory "
                    "starts; its turns carry it as weight_version step-N (step-0 while the file is missing).",
    "reward_levels": "Synthetic: rewards in this many levels over [0, 1], the top one likelier as the policy version "
                     "rises (so a group's rewards tie more and more often); under 2: continuous.",
    "late_reward_rate": "Synthetic: chance that a trajectory ends without its reward and sends it late_reward_seconds "
                        "later (a slow verifier).",
    "late_reward_seconds": "Synthetic: how long a late reward takes.",
    "retry_rate": "Synthetic: chance that a trajectory outside a group is discarded (abort) after its first turn and "
                  "produced again from turn 0.",
    "sglang_url": "Base URL of the SGLang-compatible server (POST {url}/generate).",
    "sglang_timeout": "Seconds one /generate call may take.",
    "prompts": "sglang: JSON-lines file of prompts ({\"input_ids\": [...]} per line); default: random prompts.",
    "model_weights": "model: a TinyLM safetensors file, reloaded whenever it changes; until it exists, weights from --seed.",
    "replay_path": "replay: a .jsonl recording, a miles session payload (.safetensors), or a directory of them.",
    "default_reward": "replay: reward when a recording gives none.",
    "metrics_port": "Prometheus /metrics port; 0 disables it.",
    "metrics_host": "Address the metrics endpoint binds.",
    "log_level": "debug, info, warning or error.",
    "curve_secret_key": "This producer's own CURVE key pair (a .key_secret file from `rollstream keys generate`); "
                        "with --curve-server-key the connection to the broker uses CURVE.",
    "curve_server_key": "The broker's public key (its .key file).",
}
TYPES = {
    "source": SourceName(),
    "spool_bytes": BYTES,
    "spool_fsync": click.BOOL,
    "crc": click.BOOL,
    "check_content": click.BOOL,
    "log_level": click.Choice(["debug", "info", "warning", "error"]),
    "reward_levels": click.IntRange(min=0),
    "late_reward_rate": click.FloatRange(0.0, 1.0),
    "late_reward_seconds": click.FloatRange(min=0.0),
}


@click.command(context_settings=SETTINGS_CONTEXT)
@config_option(ProducerSettings, "producer")
@settings_options(ProducerSettings, HELP, TYPES)
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
def producer(log_format: str, **values) -> None:
    """Run a producer daemon: generate or replay rollouts and stream their
    turns to the node's broker, resending until every frame is acked."""
    import asyncio

    from rollstream.common.config import settings_from
    from rollstream.common.logs import setup_logging

    from .daemon import run, violations
    from .replay import ReplayError
    from .source import SourceSettingsError
    from .spool import SpoolError

    settings = settings_from(ProducerSettings, values, violations)
    setup_logging(settings.log_level, log_format)
    try:
        asyncio.run(run(settings))
    except SourceSettingsError as exc:
        raise click.BadParameter(str(exc)) from None
    except (ReplayError, SpoolError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
