"""Every producer-daemon setting with its default and its declaration
(kind, unit, range, help): the one list the command line, the TOML file
(`[producer]` table) and the environment (`ROLLSTREAM_PRODUCER_<KEY>`) fill
(see `rollstream.common.config`)."""
from __future__ import annotations

from dataclasses import dataclass

from rollstream.common.config import (
    DIRECTORY,
    EXISTING,
    FILE,
    OUTPUT_FILE,
    PATH,
    URL,
    choice,
    count,
    endpoint,
    flag,
    log_level,
    number,
    port,
    seconds,
    setting,
    share,
    size,
    text,
    vocabulary,
)
from rollstream.common.contract import LONGEST_HEARTBEAT_INTERVAL
from rollstream.common.jobs import JOB_PATTERN

from .sources import source_names

# What a restarted daemon does with the trajectories it had open at its broker (`on_restart`, producer/source.py).
ON_RESTART = ("continue", "restart", "abort")
# The SGLang endpoints the sglang source drives (`sglang_api`).
SGLANG_APIS = ("generate", "chat")


@dataclass
class ProducerSettings:
    source: str = choice(
        "synthetic", "synthetic: sampled load; sglang: drive an SGLang server; vllm: drive a vLLM server; replay: "
                     "recorded turns; "
                     "model (registered by the `rollstream` command): sample from a small torch LM "
                     "(rollstream.app.tiny_lm).", source_names)
    broker_endpoint: str = endpoint("tcp://127.0.0.1:5555", "The node broker's producer endpoint.", binds=False)
    producer_id: str | None = text(None, "Name sent in hello; keep it stable to resend a spool after a restart. "
                                         "Default: host-source.")
    job: str = text("default", "The job its trajectories belong to: a broker keeps jobs apart, and hands them only to "
                               "consumers of the same job (an evaluation run, a second experiment).",
                    pattern=JOB_PATTERN)
    # reliability
    window: int = count(256, "Most frames unsettled at once (the broker's welcome may lower it).", "frames")
    reply_timeout: float = seconds(30.0, "Seconds without a reply after which unacked frames are reported (they are "
                                         "resent only after a reconnect, or when a later ping is answered first).")
    retry_delay: float = seconds(0.5, "Seconds before resending a frame the broker answered `unavailable`.")
    heartbeat_interval: float = seconds(1.0, "Seconds between pings.", high=LONGEST_HEARTBEAT_INTERVAL)
    heartbeat_timeout: float = seconds(10.0, "Seconds of broker silence after which it counts as down "
                                             "(broker_up = 0).")
    spool_dir: str | None = setting(None, DIRECTORY, "Directory of the disk spool of unacked frames; none: frames live "
                                                     "in memory only.")
    spool_bytes: int = size(1 << 30, "Spool budget; when it is used up, the source waits (backpressure).")
    spool_fsync: bool = flag(False, "fsync every spool write (survives power loss, slower).")
    shutdown_timeout: float = seconds(10.0, "Seconds to wait, on SIGTERM or at the end, for open trajectories and "
                                            "in-flight acks.", above=False)
    crc: bool = flag(True, "Send a CRC-32 of the array frames with every turn.")
    check_content: bool = flag(False, "Also check each turn's content rules before sending (the broker checks every "
                                      "frame anyway).")
    ledger: str | None = setting(
        None, OUTPUT_FILE, "Append a record of every trajectory sent and acked to this JSON-lines file, for the "
                           "end-to-end checker (rollstream.common.checker; docs/operations.md).")
    curve_secret_key: str | None = setting(
        None, FILE, "This producer's own CURVE key pair (a .key_secret file from `rollstream keys generate`); with "
                    "--curve-server-key the connection to the broker uses CURVE.")
    curve_server_key: str | None = setting(None, FILE, "The broker's public key (its .key file).")
    # what to produce (synthetic and sglang)
    trajectories: int = count(0, "Trajectories to produce; 0: until stopped (replay and --prompts end with their "
                                 "files).", "trajectories", low=0)
    group_size: int = count(1, "Samples per prompt, sent as one group when more than 1.", "samples")
    turns: int = count(3, "Engine calls per trajectory.", "turns")
    prompt_tokens: int = count(256, "Mean prompt length of synthetic prompts (uniform in [x/2, 3x/2]).", "tokens")
    response_tokens: int = count(128, "Mean sampled tokens per turn (synthetic); max_new_tokens (sglang).", "tokens")
    tool_tokens: int = count(32, "Mean forced tool-output tokens between turns (synthetic); echoed tokens (sglang "
                                 "tool).", "tokens", low=0)
    tool_seconds: float = seconds(0.0, "Synthetic: seconds the environment takes between two turns (a tool call); the "
                                       "trajectory stays open meanwhile.", above=False)
    rate: float = number(0.0, "Trajectory starts per second; 0: as fast as the broker takes them.",
                         "trajectories per second", low=0.0)
    concurrency: int = count(8, "Trajectories in progress at once.", "trajectories")
    vocab_size: int = vocabulary(151_936, "Vocabulary size: synthetic ids are drawn below it and every id is "
                                          "checked against it.", low=3)
    seed: int = count(0, "Random seed of the synthetic source, of random prompts and of the model source's initial "
                         "weights.", "", low=0)
    temperature: float = number(1.0, "Sampling temperature.", low=0.0, above=True)
    top_k: int = count(20, "Top-k truncation; 0 or -1 disables it.", "token ids", low=-1)
    top_p: float = number(0.95, "Top-p (nucleus) truncation; 1 disables it.", low=0.0, high=1.0, above=True)
    min_p: float = number(0.0, "Min-p truncation; 0 disables it.", low=0.0, high=1.0)
    abort_rate: float = share(0.0, "Synthetic: chance that a later turn is aborted without supports (a replay gap).")
    retry_rate: float = share(0.0, "Synthetic: chance that a trajectory outside a group is discarded (abort) after its "
                                   "first turn and produced again from turn 0.")
    version_file: str | None = setting(
        None, PATH, "Synthetic: a file holding the trainer's policy version (an integer), read as each trajectory "
                    "starts; its turns carry it as weight_version step-N (step-0 while the file is missing).")
    reward_levels: int = count(0, "Synthetic: rewards in this many levels over [0, 1], the top one likelier as the "
                                  "policy version rises (so a group's rewards tie more and more often); under 2: "
                                  "continuous.", "levels", low=0)
    late_reward_rate: float = share(0.0, "Synthetic: chance that a trajectory ends without its reward and sends it "
                                         "late_reward_seconds later (a slow verifier).")
    late_reward_seconds: float = seconds(0.5, "Synthetic: how long a late reward takes.", above=False)
    # engines (sglang, vllm)
    sglang_url: str = setting("http://127.0.0.1:30000", URL, "Base URL of the SGLang server (POST {url}/generate, or "
                                                             "{url}/v1/chat/completions with sglang_api = chat).",
                              schemes=("http", "https"))
    sglang_timeout: float = seconds(600.0, "Seconds one SGLang call may take.")
    sglang_api: str = choice("generate", "The SGLang endpoint the sglang source drives: generate (/generate) or chat "
                                         "(/v1/chat/completions with return_meta_info; the context goes as input_ids).",
                             SGLANG_APIS)
    vllm_url: str = setting("http://127.0.0.1:8000", URL, "Base URL of the vLLM server, started with "
                                                          "--return-sampling-mask (POST {url}/inference/v1/generate).",
                            schemes=("http", "https"))
    vllm_timeout: float = seconds(600.0, "Seconds one vLLM call may take.")
    full_log_probs: bool = flag(False, "sglang: also ask for each sampled token's log-prob under the full distribution "
                                       "(return_logprob) and carry it as the turn's full_log_probs.")
    mask_log_probs: bool = flag(False, "sglang, vllm: also carry every support id's log-prob as the turn's "
                                       "mask_log_probs, renormalised over each support as the engine reports them "
                                       "(sglang: asked with sampling_logprobs_mode support; vllm: the server started "
                                       "with --return-sampling-mask-logprobs, top_k at most 2048).")
    overflow_retries: int = count(0, "sglang, vllm: times a turn whose support outgrew the engine's cap is asked again "
                                     "with half the top-k; then (0: at once) the trajectory is given up "
                                     "(support_overflow).", "retries", low=0, high=16)
    sampling_mask_cap: int = count(4096, "sglang, vllm: the engine's cap on a support (SGLang's "
                                         "--sampling-mask-max-tokens), for the narrowed top-k and the log when the "
                                         "engine's refusal does not say it.", "token ids", high=1 << 24)
    prompts: str | None = setting(None, FILE, "JSON-lines file of prompts ({\"input_ids\": [...]} per line): each is "
                                              "issued once (group_size samples), the run ends when all are done; "
                                              "default: random prompts drawn from --seed.")
    on_restart: str = choice(
        "continue", "What a restarted daemon does with the trajectories it had open at its broker (needs --spool-dir): "
                    "continue them from where they stood, restart them from turn 0, or abort them (their groups go "
                    "on without them). A source that cannot continue one restarts it.", ON_RESTART)
    # model (the source the `rollstream` command registers: rollstream.app.model_source)
    model_weights: str | None = setting(None, PATH, "model: a TinyLM safetensors file, reloaded whenever it changes; "
                                                    "until it exists, weights from --seed.")
    # replay
    replay_path: str | None = setting(None, EXISTING, "replay: a .jsonl recording, a miles session payload "
                                                      "(.safetensors), or a directory of them.")
    default_reward: float = number(0.0, "replay: reward when a recording gives none.", "reward", unbounded=True)
    # operations
    metrics_port: int = port(9465, "Prometheus /metrics port; 0 disables it.")
    metrics_host: str = text("127.0.0.1", "Address the metrics endpoint binds.")
    log_level: str = log_level()
