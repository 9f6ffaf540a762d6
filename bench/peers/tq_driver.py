"""TransferQueue 0.1.11 streaming rollout samples from a producer to a
consumer, the peer that bench/pipeline.py runs against rollstream.

This process is the producer; the consumer is a Ray actor (a process of its
own). TransferQueue runs on its SimpleStorage backend with its controller in
polling mode, so the consumer asks for batches while the producer is still
putting them, and an ask that finds too few samples ready comes back empty
and is asked again.

Each rep, in a partition of its own:

- the consumer starts asking, `get_meta(fields, batch_size=B,
  partition_id=..., mode="fetch", task_name=...)` then `get_data(meta)`,
  and splits each batch's fields (dense tensors for equal-length fields,
  jagged nested tensors for ragged ones) into per-sample numpy arrays, as a
  trainer reads them;
- half a second later the producer puts every batch of B samples,
  `put(data=TensorDict, partition_id=...)`, building each TensorDict from
  per-sample arrays built before the clock starts.

`stream_e2e_s` runs from the producer's first put to the consumer holding
the last sample as numpy (both read the same monotonic clock). Afterwards,
untimed, every field of every sample the consumer got is compared with what
was put, by digest, and the partition is cleared. A warm-up rep comes first.

The samples are bench/peers/tq_workload.py's, with every response token
inside its own support, so they are byte for byte what pipeline.py sends
through rollstream. RSS: the peak resident set (VmHWM) of every process of
the run, read before shutdown and keyed `role[pid]` (an actor's role is its
`ray::ClassName` title); `peak_rss_mib` holds the data path (this producer,
the actors of the run, raylet, gcs_server), `peak_rss_mib_ray_helpers` the
rest of Ray (its agents, dashboard and log monitor).

Runs in a virtualenv with torch, transferqueue==0.1.11 and psutil
(bench/peers/setup_tq.sh makes one); it never imports rollstream. Prints
progress, then the figures as one JSON line (also written to `--json FILE`);
exits 2 when a sample came back different.

    .venv-tq/bin/python bench/peers/tq_driver.py [--samples 256] [--reps 3] [--json tq.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

# Read by Ray and TransferQueue at import, and handed on to the actors.
ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TQ_NUM_THREADS": "2", "TQ_LOGGING_LEVEL": "WARNING"}
for _name, _value in ENV.items():
    os.environ.setdefault(_name, _value)
warnings.filterwarnings("ignore", message=r"The PyTorch API of nested tensors is in prototype stage")

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tq_workload import FIELDS, make_samples, payload_bytes, with_tokens_in_support  # noqa: E402

TASK = "train"
POLL_PAUSE_S = 0.001
CONSUMER_HEAD_START_S = 0.5


def fingerprint(array: np.ndarray) -> str:
    """The array's bytes, dtype and shape, hashed."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{array.dtype.str}{array.shape}".encode())
    h.update(np.ascontiguousarray(array).view(np.uint8).data)
    return h.hexdigest()


def as_tensordict(samples: list[dict]) -> TensorDict:
    """One batch: a field whose arrays share a shape as one dense tensor,
    any other as a jagged nested tensor."""
    columns = {}
    for name in FIELDS:
        arrays = [sample[name] for sample in samples]
        if len({a.shape for a in arrays}) == 1:
            columns[name] = torch.from_numpy(np.stack(arrays))
        else:
            columns[name] = torch.nested.as_nested_tensor([torch.from_numpy(a) for a in arrays], layout=torch.jagged)
    return TensorDict(columns, batch_size=len(samples))


@ray.remote(num_cpus=0)
class StreamConsumer:
    """Attaches to the running TransferQueue and drains a partition."""

    def __init__(self):
        tq.init()  # a controller exists: this only makes a client
        self.client = tq.get_client()

    def pid(self) -> int:
        return os.getpid()

    def drain(self, partition: str, expected: int, batch: int) -> dict:
        held: dict[int, dict[str, np.ndarray]] = {}
        empty_asks = 0
        meta_s = data_s = split_s = 0.0
        while len(held) < expected:
            t0 = time.perf_counter()
            meta = self.client.get_meta(data_fields=list(FIELDS), batch_size=min(batch, expected - len(held)),
                                        partition_id=partition, mode="fetch", task_name=TASK)
            t1 = time.perf_counter()
            meta_s += t1 - t0
            if meta.size == 0:
                empty_asks += 1
                time.sleep(POLL_PAUSE_S)
                continue
            data = self.client.get_data(meta)
            t2 = time.perf_counter()
            split = {name: [t.numpy() for t in data[name].unbind()] for name in FIELDS}
            for row, index in enumerate(meta.global_indexes):
                held[index] = {name: split[name][row] for name in FIELDS}
            t3 = time.perf_counter()
            data_s += t2 - t1
            split_s += t3 - t2
        done = time.perf_counter()
        fingerprints = {index: {name: fingerprint(a) for name, a in arrays.items()} for index, arrays in held.items()}
        return {"done": done, "get_meta_s": meta_s, "get_data_s": data_s, "to_numpy_s": split_s,
                "empty_asks": empty_asks, "fingerprints": fingerprints}


def run_rep(client, consumer, partition: str, samples: list[dict], batch: int, reference: list[dict]) -> dict:
    pending = consumer.drain.remote(partition, len(samples), batch)
    time.sleep(CONSUMER_HEAD_START_S)
    where: dict[int, int] = {}  # TransferQueue's global index -> sample
    build_s = put_s = 0.0
    first = time.perf_counter()
    for start in range(0, len(samples), batch):
        t0 = time.perf_counter()
        data = as_tensordict(samples[start:start + batch])
        t1 = time.perf_counter()
        meta = client.put(data=data, partition_id=partition)
        t2 = time.perf_counter()
        build_s += t1 - t0
        put_s += t2 - t1
        where.update((index, start + row) for row, index in enumerate(meta.global_indexes))
    produced = time.perf_counter()
    got = ray.get(pending)
    got_fps = {int(index): fps for index, fps in got["fingerprints"].items()}
    mismatches = sum(got_fps.get(index, {}).get(name) != reference[i][name] for index, i in where.items() for name in FIELDS)
    return {"stream_e2e_s": got["done"] - first, "producer_s": produced - first, "build_s": build_s, "put_s": put_s,
            "get_meta_s": got["get_meta_s"], "get_data_s": got["get_data_s"], "to_numpy_s": got["to_numpy_s"],
            "empty_asks": got["empty_asks"], "samples": len(got_fps), "mismatches": mismatches,
            "verified": mismatches == 0 and got_fps.keys() == where.keys() and len(where) == len(samples)}


def vm_hwm(pid: int) -> int:
    """Peak resident set of a process, bytes (its current one where the
    kernel keeps no peak)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def role(process: psutil.Process) -> str | None:
    """What a process of the run is: `ray::Name` for a Ray worker (None for
    an idle one), the script or module a python runs, else its executable's
    name."""
    try:
        argv = process.cmdline()
    except psutil.Error:
        return None
    if not argv:
        return None
    if argv[0].startswith("ray::"):
        name = argv[0].split()[0].split(".")[0]  # a busy actor's title also names its method
        return None if name == "ray::IDLE" else name
    head = os.path.basename(argv[0])
    if head.startswith("python"):
        rest = iter(argv[1:])
        for arg in rest:
            if arg == "-m":
                return next(rest, head)
            if not arg.startswith("-"):
                return os.path.basename(arg).removesuffix(".py")
    return head


# Besides this producer, the processes data passes through or that schedule
# it: the actors of this run (TransferQueue's controller and storage units,
# the consumer), the raylet and the GCS. Ray's agents, dashboard and log
# monitor are counted apart.
RAY_SERVERS = ("raylet", "gcs_server")
RAY_HELPER_ACTORS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def peak_rss() -> tuple[dict[str, float], dict[str, float]]:
    """(data path, Ray's helpers): peak RSS MiB by `role[pid]`, over this
    process and every process it started."""
    me = psutil.Process()
    data_path = {f"producer[{me.pid}]": vm_hwm(me.pid)}
    helpers = {}
    for child in me.children(recursive=True):
        name = role(child)
        if name is None:
            continue
        on_path = name in RAY_SERVERS or (name.startswith("ray::") and name not in RAY_HELPER_ACTORS)
        (data_path if on_path else helpers)[f"{name}[{child.pid}]"] = vm_hwm(child.pid)
    return ({k: round(v / 2**20, 1) for k, v in data_path.items()}, {k: round(v / 2**20, 1) for k, v in helpers.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="samples per put and per get")
    parser.add_argument("--resp-len", type=int, default=5000)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=3, help="timed reps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed reps first")
    parser.add_argument("--storage-units", type=int, default=1)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    samples = with_tokens_in_support(make_samples(args.samples, args.resp_len, args.prompt_len, args.seed), args.seed)
    reference = [{name: fingerprint(sample[name]) for name in FIELDS} for sample in samples]
    payload = payload_bytes(samples)
    print(f"workload: {args.samples} samples of {args.prompt_len} + {args.resp_len} tokens, {payload / 1e6:.1f} MB",
          flush=True)

    # TransferQueue's controller and each storage unit take one Ray CPU; the consumer takes none.
    ray.init(num_cpus=max(2, 1 + args.storage_units), object_store_memory=2 * 2**30, include_dashboard=False,
             _temp_dir=os.path.join(tempfile.gettempdir(), "tq-driver-ray"),
             runtime_env={"env_vars": {name: os.environ[name] for name in ENV}})
    try:
        tq.init(OmegaConf.create({
            "controller": {"polling_mode": True},
            "backend": {"storage_backend": "SimpleStorage",
                        "SimpleStorage": {"num_data_storage_units": args.storage_units}},
        }))
        client = tq.get_client()
        consumer = StreamConsumer.remote()
        ray.get(consumer.pid.remote())  # started before the first rep

        warmups, reps = [], []
        for rep in range(args.warmup + args.reps):
            partition = f"rep-{rep}"
            result = run_rep(client, consumer, partition, samples, args.batch, reference)
            (warmups if rep < args.warmup else reps).append(result)
            label = "warm-up" if rep < args.warmup else f"rep {rep - args.warmup}"
            print(f"{label}: {result['stream_e2e_s']:.3f} s first put to last sample (puts done at "
                  f"{result['producer_s']:.3f} s, {result['empty_asks']} empty asks), "
                  + ("verified" if result["verified"] else f"NOT VERIFIED ({result['mismatches']} fields differ)"),
                  flush=True)
            client.clear_partition(partition)
        data_path, ray_helpers = peak_rss()
    finally:
        tq.close()
        ray.shutdown()

    seconds = [r["stream_e2e_s"] for r in reps]
    figures = {
        "versions": {"transferqueue": getattr(tq, "__version__", "?"), "torch": torch.__version__,
                     "ray": ray.__version__},
        "samples": args.samples, "batch": args.batch, "prompt_len": args.prompt_len, "resp_len": args.resp_len,
        "payload_bytes": payload, "response_tokens": args.samples * args.resp_len,
        "reps": reps, "warmups": warmups,
        "stream_e2e_s": seconds, "stream_e2e_median_s": statistics.median(seconds) if seconds else None,
        "verified": all(r["verified"] for r in warmups + reps),
        "peak_rss_mib": data_path, "peak_rss_mib_ray_helpers": ray_helpers,
    }
    median = figures["stream_e2e_median_s"]
    print(f"TransferQueue {figures['versions']['transferqueue']}: median "
          + (f"{median:.3f} s" if median is not None else "- (no timed rep)") + ", "
          f"peak RSS {sum(data_path.values()):.0f} MiB over {len(data_path)} processes "
          f"(+{sum(ray_helpers.values()):.0f} MiB in Ray's helpers)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    sys.exit(0 if figures["verified"] else 2)


if __name__ == "__main__":
    main()
