"""One node of a baseline that users would pick instead of lowcomm-node (issue 7), as benchmark code.

    python benchmarks/baseline_trainer.py diloco-hivemind --manifest M --out node0.jsonl ...
    python benchmarks/baseline_trainer.py data-parallel --rank 0 --world 4 --master 10.78.0.1:29500 ...

Both train the manifest's model on the manifest's data with the daemon's own InnerTrainer (same
model, data stream, AdamW and schedule), so only the communication differs from our protocols:
- `diloco-hivemind`: DiLoCo as OpenDiLoCo runs it: every H steps the pseudo-gradient Δ = φ − θ is
  averaged by hivemind's DecentralizedAverager (a group all-reduce over its own DHT and p2pd,
  fp32 or fp16 on the wire), then φ takes DiLoCo's Nesterov outer step (protocol/diloco.py)
  and θ restarts from φ. The trainer waits for the all-reduce: that wait is its idle time.
- `data-parallel`: synchronous data-parallel, the gradients all-reduced with torch.distributed
  (gloo) after every step, fp32.
- `local`: no communication at all, what a volunteer would get training alone.

Each node writes JSON lines: `sync` (seconds waited on the network, bytes of the averaged
tensors) and `eval` (validation loss at a step), stamped with wall-clock `time`; and `done`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from node.data.corpus import load_corpus, stream_seed  # noqa: E402
from node.config.manifest import Manifest, load_manifest  # noqa: E402
from node.train.trainer import InnerTrainer, pad_step  # noqa: E402
from protocol.diloco import DiLoCo, DiLoCoHyperParameters  # noqa: E402


class Log:
    def __init__(self, path: Path):
        self.file = open(path, "a", buffering=1)

    def __call__(self, event: str, **fields) -> None:
        self.file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def build_trainer(manifest: Manifest, node_seed: int) -> InnerTrainer:
    train = manifest.train
    if train.threads:
        torch.set_num_threads(train.threads)
    corpus = load_corpus(manifest.data)
    # Each node its own batch stream, as each daemon has (its seed comes from its identity).
    return InnerTrainer(manifest.model, train, corpus, manifest.data.seq_len,
                        stream_seed(f"baseline-node-{node_seed}", train.seed))


def train_step(trainer: InnerTrainer, manifest: Manifest) -> None:
    """One inner step, padded to train.min_step_seconds (an emulated accelerator's pace) as the
    daemon's worker pads its steps (node/daemon/worker.py)."""
    pad_step(trainer.train_step().seconds, manifest.train.min_step_seconds, time.sleep)


def maybe_evaluate(trainer: InnerTrainer, log: Log, eval_every: int) -> None:
    if eval_every and trainer.step % eval_every == 0:
        log("eval", step=trainer.step, val_loss=trainer.evaluate())


# ---------------------------------------------------------------------------- DiLoCo over hivemind

def run_diloco_hivemind(args: argparse.Namespace, manifest: Manifest, log: Log) -> None:
    import hivemind
    from hivemind.compression import Float16Compression, NoCompression

    trainer = build_trainer(manifest, args.node_index)
    params = trainer.named_parameters()
    outer = DiLoCo(params, DiLoCoHyperParameters(manifest.protocol.outer_lr,
                                                 manifest.protocol.outer_momentum))
    # wait_timeout: hivemind's DHT drops a peer from its routing table when a request to it
    # gets no reply within 3 s. Its requests share one connection per peer with the all-reduce,
    # so on a slow uplink they queue behind megabytes of it and miss; after a long all-reduce
    # each node's table held no (or one) peer, its stores and lookups stayed local, and no
    # group formed again ("could not find a group", measured: DEBUG logs at 1.8 Mbit/s)
    dht = hivemind.DHT(start=True, initial_peers=args.initial_peer, host_maddrs=args.listen,
                       announce_maddrs=args.announce or None, use_ipfs=False, nat_port_map=False,
                       wait_timeout=args.dht_wait_timeout)
    (Path(args.out).with_suffix(".address")).write_text(
        "\n".join(str(a) for a in dht.get_visible_maddrs()) + "\n")
    buffers = [torch.zeros_like(p) for p in params.values()]
    averager = hivemind.DecentralizedAverager(
        buffers, dht, start=True, prefix=f"{manifest.swarm.id}-diloco",
        target_group_size=args.group_size, min_group_size=args.group_size,
        min_matchmaking_time=args.matchmaking_time, request_timeout=args.request_timeout,
        # a group member that stops sending mid-all-reduce is dropped, and the all-reduce ends,
        # as a user would set them: without them an fp32 run at 1.1 Mbit/s hung in its tenth
        # all-reduce for 38 min (step's own timeout bounds only the search for a group)
        allreduce_timeout=args.allreduce_timeout, next_chunk_timeout=args.next_chunk_timeout,
        compression=Float16Compression() if args.wire == "fp16" else NoCompression())
    payload = sum(b.numel() for b in buffers) * (2 if args.wire == "fp16" else 4)
    H = manifest.protocol.inner_steps
    try:
        while trainer.step < args.steps:
            train_step(trainer, manifest)
            if trainer.step % H == 0:
                delta = outer.pseudo_gradient(params)
                with averager.get_tensors() as tensors:
                    for buffer, value in zip(tensors, delta.values()):
                        buffer.copy_(value)
                waited, error = time.monotonic(), None
                control = averager.step(timeout=args.sync_timeout, wait=False)
                try:
                    group = control.result(timeout=args.sync_timeout + args.allreduce_timeout + 30)
                except Exception as exc:  # e.g. "could not find a group" on a saturated link:
                    control.cancel()  # (a no-op once it ended) a user's loop goes on with its own Δ
                    group, error = None, f"{type(exc).__name__}: {exc}"
                waited = time.monotonic() - waited
                with averager.get_tensors() as tensors:
                    mean = dict(zip(delta, (t.clone() for t in tensors)))
                if not group:  # no group formed in time: DiLoCo with our own Δ only
                    mean = delta
                trainer.load_parameters(outer.outer_step([mean]))
                log("sync", step=trainer.step, network_wait_seconds=waited,
                    group_size=len(group) if group else 1, payload_bytes=payload, error=error)
            maybe_evaluate(trainer, log, args.eval_every)
    finally:
        averager.shutdown()
        dht.shutdown()


# ---------------------------------------------------------------------------- data-parallel over gloo

def run_data_parallel(args: argparse.Namespace, manifest: Manifest, log: Log) -> None:
    import torch.distributed as dist

    host, port = args.master.rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=args.rank,
                            world_size=args.world)
    trainer = build_trainer(manifest, args.rank)
    parameters = [p for p in trainer.model.parameters()]
    payload = 4 * sum(p.numel() for p in parameters)
    try:
        while trainer.step < args.steps:
            # InnerTrainer.train_step with the all-reduce between backward and the optimizer
            computed = time.monotonic()
            trainer.accumulate_gradients()
            pad_step(time.monotonic() - computed, manifest.train.min_step_seconds, time.sleep)
            flat = torch.cat([p.grad.reshape(-1) for p in parameters])
            waited = time.monotonic()
            dist.all_reduce(flat)
            waited = time.monotonic() - waited
            flat /= args.world
            offset = 0
            for p in parameters:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            if manifest.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(parameters, manifest.train.grad_clip)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.scheduler.step()
            trainer.step += 1
            log("sync", step=trainer.step, network_wait_seconds=waited, payload_bytes=payload)
            maybe_evaluate(trainer, log, args.eval_every)
    finally:
        dist.destroy_process_group()


def run_local(args: argparse.Namespace, manifest: Manifest, log: Log) -> None:
    trainer = build_trainer(manifest, args.node_index)
    while trainer.step < args.steps:
        train_step(trainer, manifest)
        maybe_evaluate(trainer, log, args.eval_every)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("method", choices=["diloco-hivemind", "data-parallel", "local"])
    parser.add_argument("--manifest", type=Path, required=True, help="model, data, train, H")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines of this node")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--eval-every", type=int, default=50)
    # diloco-hivemind (and local: the node's batch stream)
    parser.add_argument("--node-index", type=int, default=0)
    parser.add_argument("--listen", action="append", default=[])
    parser.add_argument("--announce", action="append", default=[])
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--matchmaking-time", type=float, default=3.0)
    parser.add_argument("--request-timeout", type=float, default=3.0)
    parser.add_argument("--sync-timeout", type=float, default=120.0)
    parser.add_argument("--allreduce-timeout", type=float, default=600.0,
                        help="seconds an all-reduce may take once its group formed")
    parser.add_argument("--next-chunk-timeout", type=float, default=60.0,
                        help="seconds a group member may go without sending its next chunk")
    parser.add_argument("--wire", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--dht-wait-timeout", type=float, default=3.0,
                        help="seconds hivemind's DHT waits for a reply before it drops the peer "
                             "(default hivemind's 3 s); on a slow link, longer than an "
                             "all-reduce keeps the link busy")
    # data-parallel
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--master", default="127.0.0.1:29500")
    args = parser.parse_args(argv)
    manifest = load_manifest(args.manifest)
    log = Log(args.out)
    started = time.time()
    log("started")  # idle fractions are taken over the run from here
    run = {"diloco-hivemind": run_diloco_hivemind, "data-parallel": run_data_parallel,
           "local": run_local}[args.method]
    run(args, manifest, log)
    log("done", seconds=time.time() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
