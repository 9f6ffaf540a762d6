"""Every producer-daemon setting with its default: the one list the command
line, the TOML file (`[producer]` table) and the environment
(`ROLLSTREAM_PRODUCER_<KEY>`) fill (see `rollstream.common.config`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProducerSettings:
    source: str = "synthetic"  # a registered source's name (rollstream.producer.sources)
    broker_endpoint: str = "tcp://127.0.0.1:5555"
    producer_id: str | None = None  # default: host name and source; keep it stable to reuse a spool
    job: str = "default"  # the job its trajectories belong to (rollstream.common.jobs)
    # reliability
    window: int = 256
    reply_timeout: float = 30.0
    retry_delay: float = 0.5
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    spool_dir: str | None = None
    spool_bytes: int = 1 << 30
    spool_fsync: bool = False
    shutdown_timeout: float = 10.0
    crc: bool = True
    check_content: bool = False
    ledger: str | None = None  # JSON-lines record of what was sent and acked (the end-to-end checker's)
    curve_secret_key: str | None = None  # this producer's .key_secret; with curve_server_key: CURVE to the broker
    curve_server_key: str | None = None  # the broker's public .key
    # what to produce (synthetic and sglang)
    trajectories: int = 0  # 0: until stopped (or until the replay/prompt files end)
    group_size: int = 1
    turns: int = 3
    prompt_tokens: int = 256
    response_tokens: int = 128
    tool_tokens: int = 32
    tool_seconds: float = 0.0  # synthetic: how long the environment takes between turns
    rate: float = 0.0  # trajectory starts per second; 0: as fast as possible
    concurrency: int = 8
    vocab_size: int = 151_936
    seed: int = 0
    temperature: float = 1.0
    top_k: int = 20
    top_p: float = 0.95
    min_p: float = 0.0
    abort_rate: float = 0.0
    retry_rate: float = 0.0
    version_file: str | None = None  # synthetic: the trainer's policy version, read as each trajectory starts
    reward_levels: int = 0  # synthetic: rewards in this many levels over [0, 1] (ties within a group); 0: continuous
    late_reward_rate: float = 0.0  # synthetic: chance a trajectory ends without its reward, sent later
    late_reward_seconds: float = 0.5
    # sglang
    sglang_url: str = "http://127.0.0.1:30000"
    sglang_timeout: float = 600.0
    prompts: str | None = None
    # model (the source the `rollstream` command registers: rollstream.app.model_source)
    model_weights: str | None = None
    # replay
    replay_path: str | None = None
    default_reward: float = 0.0
    # operations
    metrics_port: int = 9465
    metrics_host: str = "127.0.0.1"
    log_level: str = "info"
