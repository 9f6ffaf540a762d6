"""The baselines the bench scripts measure rollstream against, kept in the
repository so every figure can be reproduced from a clone alone.

- `relay`: the transport ceiling, a bare two-hop ZeroMQ relay.
- `seed_path`: the seed's data path (per-sample CSR masks re-concatenated on
  every append, a per-sample payload, per-sample Python validation) and the
  standard agentic workload.
- `tq_workload`, `tq_driver`, `setup_tq.sh`: the TransferQueue peer of
  bench/pipeline.py, its samples and its virtualenv.

Bench scripts run from `bench/`, so they import these as `peers.<module>`,
as they import `procs`.
"""
