#!/usr/bin/env python3
"""Masked-LM training under DistributedDataParallel, one process per GPU (torchrun, NCCL): the same 24-layer
BertForMaskedLM as scripts/train_mlm.py, as transformers runs it and with Substation injected, on 1 and on N GPUs.

    python scripts/train_ddp.py --gpus 1 2 --out layouts/h200x2-train_ddp.json

Substation is injected with `stack=False`: a pair of CUDA graphs per layer, so that DDP's all-reduce of a layer's
gradients overlaps the backward of the layers below it (one graph pair for the stack returns every gradient at once).
For each number of GPUs the script starts `torchrun --standalone --nproc-per-node N` on itself. Each rank trains on
its share (B sequences) of a global batch of N*B: weak scaling, so a perfect run's tokens/s grow N-fold; the scaling
efficiency is tokens/s on N GPUs / (N * tokens/s on 1). Before timing, on more than one GPU, each variant checks that
DDP's gradients equal one process's on the whole global batch (rank 0 runs it; dropout off so that both see the same
function; AMP as in training, the loss scaled by 2**14 as GradScaler scales it): the largest relative difference of a parameter's gradient (L2 norms) is reported and
must stay under --tolerance (a gradient that is zero up to rounding, the key bias's, against 1e-3 of the largest
gradient's norm). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and its PyTorch and NVSHMEM peers).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import subprocess
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import train_mlm  # noqa: E402  (a sibling script: the model, data, variants and timing are its)

from substation.errors import SizeError  # noqa: E402
from substation.sizes import SIZE_SPEC_HELP, Size, get_size, size_name  # noqa: E402

log = logging.getLogger("train_ddp")
VARIANTS = ("hf", "substation")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass(frozen=True)
class Row:
    """One variant on one number of GPUs, as `--out` writes it."""

    size: str  # one rank's share: the global batch is gpus * B
    variant: str
    precision: str
    layers: int
    gpus: int
    step_ms: float  # the slowest rank's median
    tokens_per_s: float  # the global batch's
    scaling_efficiency: float | None  # tokens/s / (gpus * tokens/s on 1 GPU); None without a 1-GPU row
    grad_max_rel_diff: float | None  # DDP against one process on the global batch; None on 1 GPU
    grad_worst_param: str | None
    losses: list[float]  # rank 0's


# ---- one rank (under torchrun) ---------------------------------------------------------------------------------
def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.detach().float() / CHECK_LOSS_SCALE for name, p in model.named_parameters()
             if p.grad is not None}
    if not all(g.isfinite().all() for g in grads.values()):
        raise FloatingPointError("the gradient check's scaled loss overflowed")
    return grads


CHECK_LOSS_SCALE = 2.0**14  # as GradScaler scales: unscaled fp16 gradients of a fresh model underflow


def backward_once(forward, inputs: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype | None,
                  device: torch.device) -> None:
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss = forward(input_ids=inputs, labels=labels).loss
    (loss * CHECK_LOSS_SCALE).backward()


def compare_gradients(variant: str, args: argparse.Namespace, initial, size: Size, device: torch.device,
                      global_batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, str] | None:
    """(largest relative gradient difference, its parameter) of DDP against one process on `global_batch`, on rank
    0 (None elsewhere). In eval mode: no dropout, so DDP's ranks and the single process compute the same function."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = train_mlm.PRECISIONS[args.precision]
    inputs, labels = (t.chunk(world)[rank] for t in global_batch)
    model, _ = train_mlm.prepare(variant, initial, size_name(size), device, seed=args.seed, stack=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model.eval(), device_ids=device_ids(device))
    backward_once(ddp, inputs, labels, dtype, device)
    got = gradients(model)
    del ddp, model
    if rank != 0:
        return None
    single, _ = train_mlm.prepare(variant, initial, size_name(size), device, seed=args.seed, stack=False)
    backward_once(single.eval(), *global_batch, dtype, device)
    want = gradients(single)
    del single
    if got.keys() != want.keys():
        raise AssertionError(f"{variant}: DDP and one process gave gradients of different parameters")
    # A gradient that is zero up to rounding (the key bias's: softmax ignores it) is measured against a floor.
    floor = 1e-3 * max(float(w.norm()) for w in want.values())
    diffs = {name: float((got[name] - w).norm()) / max(float(w.norm()), floor) for name, w in want.items()}
    worst = max(diffs, key=diffs.__getitem__)
    return diffs[worst], worst


def device_ids(device: torch.device) -> list[int] | None:
    return [device.index] if device.type == "cuda" else None


def train(variant: str, args: argparse.Namespace, initial, size: Size, device: torch.device,
          batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, list[float]]:
    """(this rank's median step ms, its losses) of DDP training on its shares of `batches`."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    # each rank its own dropout masks, as each rank's torch dropout follows its own seed
    torch.manual_seed(args.seed + rank)
    model, _ = train_mlm.prepare(variant, initial, size_name(size), device, seed=args.seed + 1000 * rank,
                                  stack=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dtype = train_mlm.PRECISIONS[args.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16_amp")
    upcoming, losses = iter(batches), []

    def step() -> None:
        inputs, labels = (t.chunk(world)[rank] for t in next(upcoming))
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = ddp(input_ids=inputs, labels=labels).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    step_ms = statistics.median(train_mlm.step_times_ms(step, args.warmup, args.steps, device))
    return step_ms, [float(loss) for loss in losses]


def worker(args: argparse.Namespace, size: Size) -> None:
    """One rank: every variant's gradient check (on more than one GPU) and timed training; rank 0 writes the rows."""
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}") if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device
                                         if device.type == "cuda" else None)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        initial = train_mlm.initial_model(size, args.layers, args.vocab, args.seed)
        global_size = dataclasses.replace(size, B=world * size.B)
        batches = train_mlm.make_batches(args.warmup + args.steps, global_size, args.vocab, args.seed, device)
        rows = []
        for variant in args.variants:
            check = compare_gradients(variant, args, initial, size, device, batches[0]) if world > 1 else None
            train_mlm.release(device)
            step_ms, losses = train(variant, args, initial, size, device, batches)
            train_mlm.release(device)
            slowest = torch.tensor([step_ms], dtype=torch.float64, device=device)
            torch.distributed.all_reduce(slowest, torch.distributed.ReduceOp.MAX)
            step_ms = float(slowest)
            rows.append(Row(size_name(size), variant, args.precision, args.layers, world, step_ms,
                            world * size.B * size.L / step_ms * 1e3, None, *(check or (None, None)), losses))
            if rank == 0:
                log.info("%d GPU(s), %s: %.2f ms/step%s", world, variant, step_ms,
                         f", gradients within {check[0]:.2e} of one process's ({check[1]})" if check else "")
        if rank == 0:
            Path(args.worker_out).write_text(json.dumps([dataclasses.asdict(row) for row in rows]), encoding="utf-8")
    finally:
        # DDP modules left in reference cycles keep the gloo group, and its worker threads, alive until the
        # interpreter's final collection; a thread that then drops a finished all-reduce's Python-owned tensor
        # cannot take the GIL and aborts the process. Collected here, the group's threads are joined below.
        gc.collect()
        torch.distributed.destroy_process_group()


# ---- the launcher ---------------------------------------------------------------------------------------------
def launch(gpus: int, argv: list[str], out: Path) -> list[Row]:
    """torchrun with `gpus` processes on this script; the rows rank 0 wrote."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               __file__, *argv, "--worker-out", str(out)]
    subprocess.run(command, check=True, env=os.environ | NO_MULTICAST)
    return [Row(**row) for row in json.loads(out.read_text(encoding="utf-8"))]


def with_efficiency(rows: list[Row]) -> list[Row]:
    one_gpu = {(row.size, row.variant): row.tokens_per_s for row in rows if row.gpus == 1}
    return [dataclasses.replace(row, scaling_efficiency=row.tokens_per_s / (row.gpus * one_gpu[row.size, row.variant]))
            if (row.size, row.variant) in one_gpu else row for row in rows]


def print_table(rows: list[Row]) -> None:
    print(f"{'size (per GPU)':>20} {'variant':>10} {'GPUs':>4} {'step ms':>8} {'tokens/s':>9} {'scaling':>7} "
          f"{'grad rel diff':>13} {'last loss':>9}")
    for row in rows:
        scaling = f"{row.scaling_efficiency:6.1%}" if row.scaling_efficiency is not None else "-"
        diff = f"{row.grad_max_rel_diff:.2e}" if row.grad_max_rel_diff is not None else "-"
        print(f"{row.size:>20} {row.variant:>10} {row.gpus:>4} {row.step_ms:8.2f} {row.tokens_per_s:9.0f} "
              f"{scaling:>7} {diff:>13} {row.losses[-1]:9.3f}")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Size]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="bert-large-b8-l512", help=f"one rank's share: {SIZE_SPEC_HELP}")
    parser.add_argument("--gpus", nargs="+", type=int, default=[1, 2], help="numbers of GPUs (processes) to run on")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--precision", choices=train_mlm.PRECISIONS, default="fp16_amp")
    parser.add_argument("--steps", type=int, default=30, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=2e-2, help="largest relative gradient difference "
                        "(L2 norm, per parameter) of DDP against one process that passes")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu: gloo, for a smoke run (with --precision fp32)")
    parser.add_argument("--out", metavar="JSON", help="the rows, a list of objects (required unless --worker-out)")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set by the launcher for rank 0
    args = parser.parse_args(argv)
    for name, least in (("layers", 1), ("steps", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            parser.error(f"--{name} {getattr(args, name)}: must be at least {least}")
    if args.worker_out is None and args.out is None:
        parser.error("--out is required")
    if any(n < 1 for n in args.gpus):
        parser.error(f"--gpus {args.gpus}: each must be at least 1")
    if args.device == "cuda" and max(args.gpus) > torch.cuda.device_count():
        parser.error(f"--gpus {max(args.gpus)}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    if args.device == "cpu" and args.precision != "fp32":
        parser.error(f"--precision {args.precision}: AMP runs on CUDA; on the CPU give fp32")
    try:
        size = get_size(args.size)
    except SizeError as error:
        parser.error(str(error))
    return args, size


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, size = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.worker_out is not None:
        worker(args, size)
        return 0
    forwarded = [a for a in argv if a != "--out" and a != args.out]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for gpus in args.gpus:
            rows += launch(gpus, forwarded, Path(scratch) / f"{gpus}.json")
    rows = with_efficiency(rows)
    print_table(rows)
    Path(args.out).write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1), encoding="utf-8")
    failed = [row for row in rows if row.grad_max_rel_diff is not None and row.grad_max_rel_diff > args.tolerance]
    for row in failed:
        log.error("%s on %d GPUs: gradients differ from one process's by %.2e (%s), over --tolerance %g",
                  row.variant, row.gpus, row.grad_max_rel_diff, row.grad_worst_param, args.tolerance)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
