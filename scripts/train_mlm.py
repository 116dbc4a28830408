#!/usr/bin/env python3
"""Masked-LM training of a BERT-large-shaped BertForMaskedLM (random init, synthetic tokens) as transformers runs it,
compiled, and with Substation injected: step time, tokens/s, peak memory and the loss of every step.

    python scripts/train_mlm.py --out layouts/h100-train_mlm.json --plot layouts/h100-train_mlm.png

Variants: `hf` (transformers as is, attn_implementation="sdpa"), `hf_compile` (torch.compile of it), `substation`
(`substation.inject`, running the shipped configuration for the size's dimensions on this GPU, tuned for the
nearest length, `substation.shipped_configuration`: layouts/h100-<preset>.json, layouts/h200-<preset>.json on an
H200; each layer's step replayed from its CUDA graphs on a GPU), and, when asked for, `substation_eager` (launched),
`substation_nondet` (layouts/<gpu>-<preset>-nondet.json where there is one: gradients not bit-reproducible),
`substation_unsplit` (as `substation`, with `padded_batches=False`: the configuration's kernels as profiled where
`--length-multiple` would turn on the padded-batch variants), `substation_defaults` (`inject(model)` and nothing else:
what a user's one line gets, whatever the other flags say) and `substation_untuned` (`inject(model, layouts=None,
cuda_graphs=False, length_multiple=None)`: what `inject(model)` ran before the twenty-third session made the fast
path its default), `substation_unchecked` (`inject(model, check_mask=False)`: a batch's padding mask is not read back
to check its values, a wait for the GPU once per step where every batch brings a new mask).
Precisions: `fp16_amp` (float32 weights, autocast float16, GradScaler), `bf16_amp` (autocast bfloat16), `fp32` (no
autocast; for a CPU smoke run). Every run starts from the same weights and trains on the same batches: streams of runs
of consecutive token ids from Zipf-distributed starts (some ids frequent, and a masked id follows from its neighbours:
the loss falls), masked as BERT masks them, and updates with AdamW (fused on a GPU, as a user who cares for speed runs
it; `--optimizer foreach` for PyTorch's default). Step time: CUDA events, the median of the steps after warm-up; peak
memory: allocated to tensors / reserved by the caching allocator (the second counts what CUDA graphs' shared pools hold
between replays); losses: every step, warm-up included. `--profile DIR` adds steps under torch.profiler. `--min-length
N` trains on batches of varying length instead, each padded to its longest sequence (L from N to the size's), as a data
loader with dynamic padding makes them; `--length-multiple M` has the injected Encoders pad each batch to a multiple of
M (a few shapes, each captured once; `substation.lengths`). `--rounds N` runs the variants in turn N times, each row
saying its round: in one process the first run of all took 24-26 ms a step where the same variant later took 20.5-20.7
(H100, B8 on batches of varying length, eighteenth session), whichever variant came first, so compare the rounds after
the first. `--eval-batch B` then evaluates each trained model as a training loop does between epochs: forward and loss
under no_grad in eval mode, on batches of B sequences of the size's L (step time after warm-up, mean loss, peak memory
meanwhile). `--capture-ahead` has the graphed variants capture every batch length's graphs before the first step.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from substation import Encoder, capture_shapes, inject, shipped_configuration
from substation.benchmark import padded_batch_mask
from substation.errors import SizeError
from substation.sizes import PRESETS, SIZE_SPEC_HELP, Size, get_size, size_name
from substation.timing import time_steps

log = logging.getLogger("train_mlm")
# substation_nondet: as substation, on the size's configuration made with --nondeterministic where one is shipped
VARIANTS = ("hf", "hf_compile", "substation", "substation_eager", "substation_nondet", "substation_unsplit",
            "substation_defaults", "substation_untuned", "substation_unchecked")
PRECISIONS = {"fp16_amp": torch.float16, "bf16_amp": torch.bfloat16, "fp32": None}  # name -> autocast dtype
PAD_ID, MASK_ID, FIRST_ID = 0, 1, 2  # ids 0 ([PAD]) and 1 ([MASK]) never occur in a stream
PROFILED_STEPS = 3
EVAL_WARMUP = 3  # evaluation steps before the timed ones (a graphed model captures its evaluation graphs in them)
MASKED_SHARE, RUN_LENGTH = 0.15, 16  # BERT's share of predicted positions; the mean length of a run of ids


@dataclasses.dataclass(frozen=True)
class Row:
    """One run, as `--out` writes it."""

    size: str
    variant: str
    precision: str
    layers: int
    step_ms: float
    tokens_per_s: float
    peak_mem_gb: float | None  # the most memory tensors took at once (max_memory_allocated); None on the CPU
    losses: list[float]
    min_length: int | None = None  # batches of varying length, L from this to the size's (None: all the size's L)
    round: int = 1  # which time the variants ran in turn (`--rounds`)
    eval_batch: int | None = None  # `--eval-batch`: the evaluation's batch size (None: no evaluation)
    eval_ms: float | None = None  # the median evaluation step (forward and loss under no_grad, eval mode)
    eval_loss: float | None = None  # the mean loss over the evaluation steps
    eval_peak_gb: float | None = None  # the peak memory while evaluating after training (on the GPU)
    hold_loss: bool = False  # `--hold-loss`: each step's loss kept until the next step's forward returned
    # The most memory the caching allocator held at once (max_memory_reserved): what the process takes from the GPU.
    # CUDA graphs' pools hold memory their tensors no longer take (graphs of several shapes sharing a pool), which
    # only this one counts.
    peak_reserved_gb: float | None = None
    eval_peak_reserved_gb: float | None = None
    step_times_ms: list[float] = dataclasses.field(default_factory=list)  # each timed step's, in order
    capture_ahead: bool = False  # `--capture-ahead`: every batch length's graphs captured before the first step


# ---- data ---------------------------------------------------------------------------------------------------
def token_stream(generator: torch.Generator, batch: int, length: int, vocab: int) -> torch.Tensor:
    """[batch, length] ids in runs of consecutive ids (wrapping round the vocabulary), each run from an id drawn by
    Zipf's law, as words are: a model learns first how frequent ids are, then that an id follows its neighbour."""
    zipf = 1.0 / torch.arange(1, vocab - FIRST_ID + 1, dtype=torch.float64)
    starts = FIRST_ID + torch.multinomial(zipf, batch * length, replacement=True, generator=generator)
    starts = starts.view(batch, length)
    new_run = torch.rand(batch, length, generator=generator) < 1 / RUN_LENGTH
    new_run[:, 0] = True
    position = torch.arange(length).expand(batch, length)
    run_start = torch.where(new_run, position, 0).cummax(1).values
    return FIRST_ID + (starts.gather(1, run_start) - FIRST_ID + position - run_start) % (vocab - FIRST_ID)


def mask_tokens(generator: torch.Generator, ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) as BERT masks: round(15%) of each sequence's positions (at least one) are predicted; of
    those, 80% read [MASK], 10% a random id, 10% their own. Labels are -100 where nothing is predicted."""
    batch, length = ids.shape
    predicted = max(1, round(MASKED_SHARE * length))
    chosen = torch.zeros_like(ids, dtype=torch.bool).scatter_(
        1, torch.rand(batch, length, generator=generator).argsort(1)[:, :predicted], True)
    draw = torch.rand(batch, length, generator=generator)
    random_ids = torch.randint(FIRST_ID, vocab, ids.shape, generator=generator)
    inputs = torch.where(chosen & (draw < 0.8), MASK_ID, torch.where(chosen & (draw < 0.9), random_ids, ids))
    return inputs, torch.where(chosen, ids, -100)


def make_batches(count: int, size: Size, vocab: int, seed: int,
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches of (input ids, labels) [B, L], the same for every run of this seed."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        inputs, labels = mask_tokens(generator, token_stream(generator, size.B, size.L, vocab), vocab)
        batches.append((inputs.to(device), labels.to(device)))
    return batches


def varying_batches(count: int, size: Size, min_length: int, vocab: int, seed: int,
                    device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`count` batches as a loader that pads each to its longest sequence makes them (`padded_batch_mask`, L from
    min_length to size.L): (input ids, labels, attention mask [B, L]), [PAD] and no label past a sequence's end.
    The same for every run of this seed."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        keep = padded_batch_mask(generator, size.B, min_length, size.L)
        inputs, labels = mask_tokens(generator, token_stream(generator, size.B, keep.shape[1], vocab), vocab)
        batches.append((inputs.masked_fill(~keep, PAD_ID).to(device), labels.masked_fill(~keep, -100).to(device),
                        keep.long().to(device)))
    return batches


# ---- models -------------------------------------------------------------------------------------------------
def initial_model(size: Size, layers: int, vocab: int, seed: int):
    """A randomly initialized BertForMaskedLM of this size's shape (float32, on the CPU): every run copies it."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab, hidden_size=size.I, num_attention_heads=size.H, intermediate_size=size.U,
                        num_hidden_layers=layers, max_position_embeddings=max(512, size.L), attn_implementation="sdpa")
    torch.manual_seed(seed)
    return BertForMaskedLM(config)


def shipped_layouts(name: str, nondeterministic: bool = False, device_name: str | None = None) -> Path | None:
    """The shipped configuration for a size's dimensions on this GPU (`substation.shipped_configuration`: with
    `nondeterministic`, the one made with --nondeterministic where there is one), tuned for its nearest length."""
    size = get_size(name)
    return shipped_configuration(size.H, size.P, size.U, size.L, device_name, nondeterministic)


def prepare(variant: str, initial, name: str, device: torch.device, seed: int | None = None,
            stack: bool = True, length_multiple: int | None = None) -> tuple[torch.nn.Module, Callable]:
    """(the model whose parameters train, what a step calls) of one variant, from a copy of the initial model;
    `seed` seeds the injected Encoders' dropout (None: inject's default), `stack` and `length_multiple` are
    inject's."""
    model = copy.deepcopy(initial).to(device).train()
    if variant in ("substation_defaults", "substation_unchecked"):
        inject(model, seed=seed, stack=stack, check_mask=variant == "substation_defaults")
    elif variant == "substation_untuned":
        inject(model, layouts=None, seed=seed, stack=stack, cuda_graphs=False, length_multiple=None)
    elif variant.startswith("substation"):
        layouts = shipped_layouts(name, nondeterministic=variant == "substation_nondet",
                                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None)
        log.info("substation at %s: %s", name, layouts or "no shipped configuration: PyTorch's layouts")
        # `substation` replays each layer's step from its CUDA graphs on a GPU; `substation_eager` launches it.
        padded = {"padded_batches": False} if variant == "substation_unsplit" else {}
        inject(model, layouts=layouts, seed=seed, stack=stack, length_multiple=length_multiple,
               cuda_graphs=variant != "substation_eager" and device.type == "cuda", **padded)
    return model, torch.compile(model) if variant == "hf_compile" else model


# ---- training -----------------------------------------------------------------------------------------------
def make_optimizer(name: str, params, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW as `--optimizer` names it: `fused` (one kernel per step for all parameters; GradScaler hands it the
    scale and the inf flag, so no unscale pass either) or `foreach` (PyTorch's default: a launch per op per group
    of tensors; on the H100 ~10 ms a step for BERT-large's 335 M parameters, a quarter of an injected step)."""
    fused = name == "fused" and device.type == "cuda"  # the fused kernels are CUDA's; the CPU smoke run loops
    return torch.optim.AdamW(params, lr=lr, fused=fused or None, foreach=None if fused else name == "foreach")


@dataclasses.dataclass(frozen=True)
class Peak:
    """The peak memory (GB) since the last reset: allocated to tensors and reserved by the caching allocator."""

    allocated_gb: float | None = None  # None on the CPU
    reserved_gb: float | None = None

    @classmethod
    def of(cls, device: torch.device) -> Peak:
        if device.type != "cuda":
            return cls()
        return cls(torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Evaluation steps after training, as a training loop runs them between epochs."""

    step_ms: float
    loss: float
    peak: Peak


def train(variant: str, precision: str, initial, name: str, batches: Sequence, warmup: int, lr: float,
          device: torch.device, profile: Path | None = None, optimizer_name: str = "fused",
          length_multiple: int | None = None, evaluation: Sequence | None = None,
          hold_loss: bool = False, capture_ahead: bool = False) -> tuple[list[float], list[float], Peak,
                                                                          Evaluation | None]:
    """(the ms of each step after `warmup` steps, the loss of every step, the peak memory, the evaluation) of
    training on `batches`, one step each, then evaluating on `evaluation` batches where given; with `profile`, the
    last PROFILED_STEPS training batches are not timed but run under torch.profiler, whose table of ops and kernels
    (their device time over those steps) goes to that file. `hold_loss`: each step's loss, autograd graph and all,
    is let go only once the next step's forward has returned, as in a loop written at a script's top level.
    `capture_ahead`: a graphed variant captures every batch length's graphs before the first step
    (`substation.capture_shapes`), so no step stalls for a capture."""
    model, forward = prepare(variant, initial, name, device, length_multiple=length_multiple)
    dtype = PRECISIONS[precision]
    if capture_ahead and any(isinstance(m, Encoder) and m.cuda_graphs for m in model.modules()):  # as prepared
        lengths = {inputs.shape[1] for inputs, _, _ in batches}
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            padded = capture_shapes(model, batches[0][0].shape[0], lengths)
        log.info("%s: captured lengths %s ahead", variant, padded)
    optimizer = make_optimizer(optimizer_name, model.parameters(), lr, device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16_amp")
    upcoming, losses, held = iter(batches), [], []

    def step() -> None:
        inputs, labels, mask = next(upcoming)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = forward(input_ids=inputs, attention_mask=mask, labels=labels).loss
        if hold_loss:
            held[:] = [loss]
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped where fp16 gradients overflowed
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read once at the end: no wait for the GPU in a step

    timed = len(batches) - warmup - (PROFILED_STEPS if profile else 0)
    times_ms = step_times_ms(step, warmup, timed, device)
    if profile:
        profile_steps(step, device, profile)
    peak = Peak.of(device)
    evaluated = evaluate(model, forward, evaluation, dtype, device) if evaluation else None
    return times_ms, [float(loss) for loss in losses], peak, evaluated


def evaluate(model: torch.nn.Module, forward: Callable, batches: Sequence, dtype: torch.dtype | None,
             device: torch.device) -> Evaluation:
    """Forward and loss on each of `batches` under no_grad in eval mode (no dropout), timed after EVAL_WARMUP, with
    the peak memory meanwhile; the model goes back to training mode after."""
    model.eval()
    upcoming, losses = iter(batches), []

    def step() -> None:
        inputs, labels = next(upcoming)
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            losses.append(forward(input_ids=inputs, labels=labels).loss)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_ms = statistics.median(step_times_ms(step, EVAL_WARMUP, len(batches) - EVAL_WARMUP, device))
    model.train()
    return Evaluation(step_ms, statistics.mean(float(loss) for loss in losses), Peak.of(device))


def profile_steps(step: Callable[[], None], device: torch.device, path: Path) -> None:
    """PROFILED_STEPS steps under torch.profiler (which slows them): the ops and kernels by device time. A layer's
    CUDA-graph replay is listed as one op (GraphedFunction) whose time includes the kernels it replays, which are
    listed too: the column does not add up to the step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / PROFILED_STEPS
    events = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{PROFILED_STEPS} steps under the profiler: {wall_ms:.2f} ms a step on the host's clock\n"
                    + events.table(sort_by="self_device_time_total" if device.type == "cuda" else "self_cpu_time_total",
                                   row_limit=40, max_name_column_width=90) + "\n",
                    encoding="utf-8")


def step_times_ms(step: Callable[[], None], warmup: int, steps: int, device: torch.device) -> list[float]:
    """The time of each of `steps` steps after `warmup` ones: CUDA events on a GPU, the host's clock on the CPU."""
    if device.type == "cuda":
        return [us / 1e3 for us in time_steps(step, warmup, steps, flush_l2=False).each_us]
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def release(device: torch.device) -> None:
    """Free what a run left (compiled graphs hold their model; Encoders and their CUDA graphs reference each other),
    so that the next run's peak memory is its own."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---- output -------------------------------------------------------------------------------------------------
def print_table(rows: Sequence[Row]) -> None:
    print(f"{'size':>22} {'precision':>9} {'variant':>18} {'round':>5} {'step ms':>9} {'tokens/s':>10} "
          f"{'peak GB':>11} {'vs hf':>6} {'last loss':>9}")
    for row, (peak, speedup) in zip(rows, _peaks_and_speedups(rows, lambda r: r.step_ms,
                                                              lambda r: (r.peak_mem_gb, r.peak_reserved_gb))):
        print(f"{row.size:>22} {row.precision:>9} {row.variant:>18} {row.round:5d} {row.step_ms:9.2f} "
              f"{row.tokens_per_s:10.0f} {peak} {speedup:>6} {row.losses[-1]:9.3f}")
    evaluated = [row for row in rows if row.eval_ms is not None]
    if not evaluated:
        return
    print(f"\nevaluation after training:\n{'size':>22} {'precision':>9} {'variant':>18} {'round':>5} {'batch':>5} "
          f"{'step ms':>9} {'peak GB':>11} {'vs hf':>6} {'mean loss':>9}")
    for row, (peak, speedup) in zip(evaluated, _peaks_and_speedups(
            evaluated, lambda r: r.eval_ms, lambda r: (r.eval_peak_gb, r.eval_peak_reserved_gb))):
        print(f"{row.size:>22} {row.precision:>9} {row.variant:>18} {row.round:5d} {row.eval_batch:5d} "
              f"{row.eval_ms:9.2f} {peak} {speedup:>6} {row.eval_loss:9.3f}")


def _peaks_and_speedups(rows: Sequence[Row], ms: Callable[[Row], float],
                        peak_gb: Callable[[Row], tuple[float | None, float | None]]) -> list[tuple[str, str]]:
    """Each row's peak memory (allocated/reserved, as far as known) and its speed against the `hf` row of its size
    and precision (blank where none), as table columns."""
    hf = {(row.size, row.precision): ms(row) for row in rows if row.variant == "hf"}
    return [(f"{'/'.join(f'{gb:.1f}' for gb in peak_gb(row) if gb is not None) or '-':>11}",
             f"{hf[row.size, row.precision] / ms(row):5.2f}×" if (row.size, row.precision) in hf else "")
            for row in rows]


def plot_losses(rows: Sequence[Row], path: str) -> None:
    """The loss curves of every variant, one panel per size (rows) and precision (columns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(row.size for row in rows))
    precisions = list(dict.fromkeys(row.precision for row in rows))
    fig, axes = plt.subplots(len(sizes), len(precisions), figsize=(5.5 * len(precisions), 3.6 * len(sizes)),
                             squeeze=False, sharey="row")
    for (i, size), (j, precision) in ((a, b) for a in enumerate(sizes) for b in enumerate(precisions)):
        ax = axes[i][j]
        for row in rows:
            if (row.size, row.precision) == (size, precision):
                again = f", round {row.round}" if row.round > 1 else ""
                ax.plot(range(1, len(row.losses) + 1), row.losses, label=f"{row.variant} ({row.step_ms:.1f} ms{again})")
        ax.set_title(f"{size}, {precision}")
        ax.set_xlabel("step")
        ax.set_ylabel("MLM loss")
        ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the command --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[Size], torch.device]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", nargs="+", default=list(PRESETS), help=f"sizes to train at: {SIZE_SPEC_HELP}")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:3]))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["fp16_amp", "bf16_amp"])
    parser.add_argument("--steps", type=int, default=40, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the timed ones (compilation included)")
    parser.add_argument("--vocab", type=int, default=30522, help="vocabulary size (BERT's by default)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--min-length", type=int, metavar="N",
                        help="batches of varying length: each padded to its longest sequence, L from N to the size's")
    parser.add_argument("--length-multiple", type=int, metavar="M",
                        help="the injected Encoders pad each batch to a multiple of M (Encoder's length_multiple)")
    parser.add_argument("--rounds", type=int, default=1, help="run the variants in turn this many times (compare "
                        "the rounds after the first: the process's first run pays for its start)")
    parser.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                        help="AdamW's implementation (fused: one kernel a step, on a GPU)")
    parser.add_argument("--seed", type=int, default=0, help="the initial weights' and the data's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True, metavar="JSON", help="the rows, a list of objects")
    parser.add_argument("--plot", metavar="PNG", help="the loss curves")
    parser.add_argument("--eval-batch", type=int, metavar="B",
                        help="after training, evaluate (forward and loss under no_grad, eval mode) on batches of B "
                             "sequences of the size's L: step time, loss and peak memory")
    parser.add_argument("--eval-steps", type=int, default=20, help=f"timed evaluation steps, after {EVAL_WARMUP}")
    parser.add_argument("--hold-loss", action="store_true",
                        help="keep each step's loss (and its autograd graph) until the next step's forward returned, "
                             "as a training loop written at a script's top level does")
    parser.add_argument("--capture-ahead", action="store_true",
                        help="graphed Substation variants capture every batch length's graphs before the first step "
                             "(substation.capture_shapes), longest first: no step stalls for a capture")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help=f"after the timed steps, {PROFILED_STEPS} more under torch.profiler: a table of "
                             "kernels per run in DIR (<size>-<precision>-<variant>.txt)")
    args = parser.parse_args(argv)
    for name, least in (("layers", 1), ("steps", 1), ("warmup", 0), ("vocab", FIRST_ID + 1), ("min_length", 1),
                        ("length_multiple", 1), ("rounds", 1), ("eval_batch", 1), ("eval_steps", 1)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least {least}")
    try:
        sizes = [get_size(spec) for spec in args.size]
        device = torch.device(args.device)
    except (SizeError, RuntimeError) as error:
        parser.error(str(error))
    if args.min_length is not None and any(args.min_length > size.L for size in sizes):
        parser.error(f"--min-length {args.min_length}: above a size's L ({min(size.L for size in sizes)})")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU (give --device cpu with --precisions fp32)")
    if args.capture_ahead and device.type != "cuda":
        parser.error(f"--capture-ahead: CUDA graphs are captured on a GPU, not on {device}")
    if device.type != "cuda" and set(args.precisions) - {"fp32"}:
        parser.error(f"--precisions {' '.join(args.precisions)}: AMP runs on a CUDA device; on {device} give fp32")
    return args, sizes, device


def run(variant: str, precision: str, size: Size, initial, batches: Sequence, args: argparse.Namespace,
        device: torch.device, round_: int = 1, evaluation: Sequence | None = None) -> Row:
    name = size_name(size)
    try:
        profile = args.profile / f"{name}-{precision}-{variant}.txt" if args.profile else None
        times_ms, losses, peak, evaluated = train(variant, precision, initial, name, batches, args.warmup, args.lr,
                                                  device, profile, args.optimizer, args.length_multiple, evaluation,
                                                  args.hold_loss, args.capture_ahead)
    finally:
        release(device)
    tokens = statistics.mean(inputs.numel() for inputs, _, _ in batches[args.warmup:])  # a timed step's, padded
    step_ms = statistics.median(times_ms)
    row = Row(name, variant, precision, args.layers, step_ms, tokens / step_ms * 1e3, peak.allocated_gb, losses,
              args.min_length, round_, hold_loss=args.hold_loss, peak_reserved_gb=peak.reserved_gb,
              step_times_ms=times_ms, capture_ahead=args.capture_ahead)
    if evaluated is None:
        return row
    return dataclasses.replace(row, eval_batch=args.eval_batch, eval_ms=evaluated.step_ms, eval_loss=evaluated.loss,
                               eval_peak_gb=evaluated.peak.allocated_gb,
                               eval_peak_reserved_gb=evaluated.peak.reserved_gb)


def main(argv: list[str] | None = None) -> int:
    args, sizes, device = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    rows, failed = [], []
    progress = tqdm(total=len(sizes) * len(args.precisions) * len(args.variants) * args.rounds, desc="train_mlm",
                    unit="run", disable=None)
    for size in sizes:
        initial = initial_model(size, args.layers, args.vocab, args.seed)
        count = args.warmup + args.steps + (PROFILED_STEPS if args.profile else 0)
        if args.min_length is None:
            batches = [(inputs, labels, None) for inputs, labels in make_batches(count, size, args.vocab, args.seed,
                                                                                 device)]
        else:
            batches = varying_batches(count, size, args.min_length, args.vocab, args.seed, device)
        evaluation = None if args.eval_batch is None else make_batches(
            EVAL_WARMUP + args.eval_steps, dataclasses.replace(size, B=args.eval_batch), args.vocab, args.seed + 1,
            device)
        for precision in args.precisions:
            for round_, variant in ((r, v) for r in range(1, args.rounds + 1) for v in args.variants):
                label = f"{size_name(size)} {precision} {variant}" + (f" round {round_}" if args.rounds > 1 else "")
                progress.set_postfix_str(label)
                try:
                    rows.append(run(variant, precision, size, initial, batches, args, device, round_, evaluation))
                except Exception:  # one run failing (a compiler error, out of memory) leaves the others to run
                    log.exception("%s failed", label)
                    failed.append(label)
                progress.update()
    progress.close()
    print_table(rows)
    Path(args.out).write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1), encoding="utf-8")
    if args.plot and rows:
        plot_losses(rows, args.plot)
    if failed:
        log.error("failed: %s", "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
