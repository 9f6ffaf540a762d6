"""rollstream.app: the application layer above the roles.

What puts the roles together rather than being one of them:

- `cli`: the `rollstream` command (each role's subcommands, `keys`, `demo`).
- `harness`: the public harness that runs a whole pipeline on loopback
  (`LoopbackNode`, `Trainer`, `Pipeline`, `Chaos`), as the demos and the
  fault suite compose their runs.
- `demo`: `rollstream demo`, its summary and live progress.
- `tiny_lm`, `model_source`, `train_demo`: the model in the loop
  (`rollstream demo --train`): a small torch LM, the producer's `model`
  source that samples from it, and the trainer that replays its rollouts.
- `demo_rank`: one rank of the demo's mock trainer, a process of its own.

The app may import every role and `common`; neither a role nor `common`
imports the app (the import contracts in pyproject.toml).
"""
