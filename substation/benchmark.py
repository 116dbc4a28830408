"""The benchmark harness of `scripts/run_encoder.py`: one training step of Substation's Encoder and of the
PyTorch baselines (`substation.baselines`), timed the same way, in one process.

A step is `y = layer(x, mask); y.backward(dy)` in training mode (dropout on), with every parameter
gradient and dX set to None first (as `optimizer.zero_grad()` does), so no step pays for accumulation.
The forward alone runs under `torch.no_grad()`, in training mode too. Each is timed

- ungraphed: as a user calls it, Python and launches included (no spin kernel hides the host's cost,
  unlike `substation.timing.Timer`, which times device work alone);
- graphed: the whole step captured in one CUDA graph (warm-up on a side stream, gradients set to None
  before capture so that the graph's pool owns them and every replay overwrites them) and replayed.

Substation runs as two variants: `substation`, the Encoder with `cuda_graphs=True` (as called, each pass replays
a CUDA graph of its own; switched off inside the whole-step graph), and `substation_eager`, the Encoder as a user
calls it by default (`cuda_graphs=False`: every step's launches from Python). Graphed, both are the same step.

`substation.timing.time_steps` brackets each step with CUDA events after warm-up, back to back, with the L2 cache
flushed before each (inputs come from DRAM, as in `Timer`); the median and min are kept. With
`device_time`, `substation.timing.Timer` times them instead: the GPU's time alone, host cost hidden.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn

from substation.baselines import VARIANTS as BASELINES
from substation.baselines import make_baseline
from substation.errors import SizeError
from substation.sizes import Size
from substation.timing import ClockLog, Timing, time_steps

log = logging.getLogger(__name__)

Tensor = torch.Tensor
SUBSTATION = "substation"  # the Encoder as called with cuda_graphs=True: it replays CUDA graphs of its own
SUBSTATION_EAGER = "substation_eager"  # the Encoder as a user calls it by default: cuda_graphs=False
SUBSTATION_VARIANTS = (SUBSTATION, SUBSTATION_EAGER)
ALL_VARIANTS = (*SUBSTATION_VARIANTS, *BASELINES)
JSON_KEYS = ("size", "variant", "graphed", "fwdbwd_ms", "fwd_ms", "min_ms", "tflops", "sm_mhz")


@dataclass(frozen=True)
class Result:
    """One variant, graphed or not: median ms of a step and of the forward, min ms of a step, TFLOP/s of a step, and
    the median SM clock (MHz) while they were timed (`substation.timing.ClockLog`; None without nvidia-smi).

    A variant that could not run has no times and says why in `error`.
    """

    size: str
    variant: str
    graphed: bool
    fwdbwd_ms: float | None = None
    fwd_ms: float | None = None
    min_ms: float | None = None
    tflops: float | None = None
    sm_mhz: float | None = None
    error: str | None = None

    def as_json(self) -> dict[str, object]:
        """Exactly `JSON_KEYS` (a failed variant has nulls; its reason is in the table)."""
        return {key: getattr(self, key) for key in JSON_KEYS}


# ---- sizes and flop -------------------------------------------------------------------------------------
def forward_flop(size: Size) -> int:
    """The forward contractions' flop of one layer (the elementwise work is < 0.5% and not counted)."""
    from substation.analysis import operator_costs

    costs = operator_costs(size)
    return int(costs[(costs.kind == "contraction") & (costs["pass"] == "forward")].flop.sum())


def step_flop(size: Size) -> int:
    """A training step's flop: the forward's contractions, and twice that in the backward."""
    return 3 * forward_flop(size)


def tflops(flop: int, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else flop / (ms * 1e-3) / 1e12


# ---- the layers -----------------------------------------------------------------------------------------
def reference_state_dict(size: Size, seed: int = 0) -> dict[str, Tensor]:
    """HF-initialized weights (float32, CPU) in HF names: what every variant loads."""
    from substation.encoder import Encoder

    torch.manual_seed(seed)
    return Encoder(size, dtype=torch.float32).state_dict()


def substation_encoder(layouts: str | None, size: Size, dtype: torch.dtype, state_dict: dict[str, Tensor],
                       cuda_graphs: bool = True, device: str = "cuda", **encoder_kwargs) -> nn.Module:
    """`Encoder.from_layouts(layouts, cuda_graphs=..., **encoder_kwargs)` (None: an Encoder of `size` in PyTorch's
    layouts) with the shared weights, on `device`; a clear error where it cannot be."""
    from substation.encoder import Encoder

    if layouts is None:
        encoder = Encoder(size, dtype=dtype, cuda_graphs=cuda_graphs, **encoder_kwargs)
    else:
        encoder = Encoder.from_layouts(layouts, dtype=dtype, cuda_graphs=cuda_graphs, **encoder_kwargs)
    made_for = getattr(encoder, "size", None)
    if made_for is not None and made_for.dims() != size.dims():
        raise SizeError(f"{layouts} was made for {made_for.dims()}, the benchmark's size is {size.dims()}")
    encoder.load_state_dict(state_dict)
    return encoder.to(device).train()


def build_variant(variant: str, size: Size, dtype: torch.dtype, state_dict: dict[str, Tensor],
                  layouts: str | None = None, device: str = "cuda") -> nn.Module:
    """One variant of `ALL_VARIANTS` in training mode (dropout 0.1) with the shared weights."""
    if variant in SUBSTATION_VARIANTS:
        if layouts is None:
            raise ValueError(f"the {variant} variant needs a layouts file")
        return substation_encoder(layouts, size, dtype, state_dict, cuda_graphs=variant == SUBSTATION, device=device)
    return make_baseline(variant, size, dtype, device, state_dict).train()


def make_inputs(size: Size, dtype: torch.dtype, device: str = "cuda", masked: bool = False,
                seed: int = 1) -> tuple[Tensor, Tensor | None, Tensor]:
    """x: bji (requires grad), mask: [B, L] or None (masked: every other sequence pads its last eighth), dY: bji."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(size.B, size.L, size.I, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(size.B, size.L, size.I, generator=gen).to(device=device, dtype=dtype)
    mask = None
    if masked:
        mask = torch.ones(size.B, size.L, dtype=dtype)
        mask[1::2, size.L - max(1, size.L // 8):] = 0
        mask = mask.to(device)
    return x, mask, dy


class LayerStack(nn.Module):
    """Layers applied in turn, each taking (x, attention_mask): a BERT encoder's stack of any variant."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, attention_mask)
        return x


STACK_COMPILED = {"substation_compile": SUBSTATION_EAGER, "compile_default": "eager_sdpa"}  # variant -> its layers
SUBSTATION_STACK = "substation_stack"  # an EncoderStack, as `inject` makes one: a step of all layers in one graph pair


def build_stack(variant: str, layers: int, size: Size, dtype: torch.dtype, state_dict: dict[str, Tensor],
                layouts: str | None, device: str = "cuda", **encoder_kwargs) -> nn.Module:
    """`layers` layers of a variant (`ALL_VARIANTS`; one of `STACK_COMPILED`: `torch.compile` of the whole stack of
    its layers; or `SUBSTATION_STACK`, its Encoders taking `encoder_kwargs`) with the same weights, in training
    mode."""
    if variant == SUBSTATION_STACK:
        from substation.stack import EncoderStack

        graphs = device.startswith("cuda")
        return EncoderStack([substation_encoder(layouts, size, dtype, state_dict, cuda_graphs=graphs, device=device,
                                                **encoder_kwargs) for _ in range(layers)])
    base = STACK_COMPILED.get(variant, variant)
    stack = LayerStack([build_variant(base, size, dtype, state_dict, layouts, device) for _ in range(layers)])
    return torch.compile(stack) if variant in STACK_COMPILED else stack


def padded_batch_mask(generator: torch.Generator, batch: int, min_length: int, max_length: int) -> Tensor:
    """The key-padding mask [batch, L] (True keeps) of a batch padded to its longest sequence, as a data loader with
    dynamic padding makes it: L uniform in [min_length, max_length], each sequence's own length uniform in [1, L]
    but the first's, L."""
    length = int(torch.randint(min_length, max_length + 1, (), generator=generator))
    own = torch.randint(1, length + 1, (batch,), generator=generator)
    own[0] = length
    return torch.arange(length) < own[:, None]


# ---- steps, graphs, timing ------------------------------------------------------------------------------
def train_step(layer: nn.Module, x: Tensor, mask: Tensor | None, dy: Tensor) -> Callable[[], Tensor]:
    """y = layer(x, mask); y.backward(dy), with the gradients of the parameters and x set to None first."""
    params = [p for p in layer.parameters() if p.requires_grad]

    def step() -> Tensor:
        for p in params:
            p.grad = None
        x.grad = None
        y = layer(x, mask)
        y.backward(dy)
        return y

    return step


def forward_step(layer: nn.Module, x: Tensor, mask: Tensor | None) -> Callable[[], Tensor]:
    def step() -> Tensor:
        with torch.no_grad():
            return layer(x, mask)

    return step


def capture(step: Callable[[], object], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm `step` up on a side stream, then capture one call in a CUDA graph: (graph, what the call returned).

    Replaying the graph reruns the step on the same tensors; what the step allocated during capture (its
    output, gradients that were None) lives in the graph's pool and is overwritten by each replay. A later
    eager step that sets `.grad` to None again points `.grad` elsewhere: keep the captured `.grad` tensors
    (right after capture) to read the replay's gradients.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    # Detached, so that the step's autograd graph (and its AccumulateGrad nodes, made on the capture stream)
    # does not outlive the capture.
    return graph, out.detach() if isinstance(out, Tensor) else out


def time_layer(layer: nn.Module, x: Tensor, mask: Tensor | None, dy: Tensor, graphed: bool, warmup: int,
               runs: int, flush_l2: bool = True, device_time: bool = False) -> tuple[Timing, Timing]:
    """(step timing, forward timing) of one layer, graphed or not.

    `device_time` times with `substation.timing.Timer` instead, whose spin kernel hides the host's cost:
    the GPU's time for the step's kernels and the gaps between them, as the profilers time an operator.
    """
    train, fwd = train_step(layer, x, mask, dy), forward_step(layer, x, mask)
    if graphed:
        train_graph, _ = capture(train)
        fwd_graph, _ = capture(fwd)
        train, fwd = train_graph.replay, fwd_graph.replay
    if device_time:
        from substation.timing import Timer

        timer = Timer(warmup, runs, flush_l2)
        return timer(train), timer(fwd)
    return time_steps(train, warmup, runs, flush_l2), time_steps(fwd, warmup, runs, flush_l2)


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def benchmark(size_name: str, size: Size, dtype: torch.dtype, variants: Sequence[str], layouts: str | None = None,
              warmup: int = 20, runs: int = 100, masked: bool = False, flush_l2: bool = True,
              modes: Sequence[bool] = (False, True), on_encoder: Callable[[nn.Module, Tensor, Tensor | None], None]
              | None = None, device_time: bool = False) -> list[Result]:
    """Time every variant ungraphed and graphed; a variant that fails gives rows with the reason, and the run goes on.

    `on_encoder(encoder, x, mask)` is called with Substation's Encoder once it is built (for `--breakdown`).
    """
    state = reference_state_dict(size)
    x, mask, dy = make_inputs(size, dtype, masked=masked)
    flop = step_flop(size)
    results: list[Result] = []
    for variant in variants:
        log.info("%s: building%s", variant, " (torch.compile runs at the first step: minutes)"
                 if variant.startswith("compile") else "")
        try:
            layer = build_variant(variant, size, dtype, state, layouts)
        except Exception as error:  # an unavailable variant is a row, not the end of the run
            log.warning("%s: not run: %s", variant, _reason(error))
            results += [Result(size_name, variant, graphed, error=_reason(error)) for graphed in modes]
            continue
        if variant == SUBSTATION and on_encoder is not None:
            on_encoder(layer, x, mask)
        for graphed in modes:
            if variant == SUBSTATION:  # its own graphs ungraphed; its plain plan inside the whole-step graph
                layer.cuda_graphs = not graphed
            try:
                with ClockLog(x.device.index or 0) as clocks:
                    step_timing, fwd_timing = time_layer(layer, x, mask, dy, graphed, warmup, runs, flush_l2,
                                                         device_time)
            except Exception as error:
                log.warning("%s%s: failed: %s", variant, " graphed" if graphed else "", _reason(error))
                results.append(Result(size_name, variant, graphed, error=_reason(error)))
                continue
            fwdbwd_ms = step_timing.median_us / 1e3
            results.append(Result(size_name, variant, graphed, fwdbwd_ms, fwd_timing.median_us / 1e3,
                                  step_timing.min_us / 1e3, tflops(flop, fwdbwd_ms), clocks.median_mhz))
            log.info("%s%s: step %.3f ms (min %.3f), forward %.3f ms, SM clock %s MHz", variant,
                     " graphed" if graphed else "", fwdbwd_ms, step_timing.min_us / 1e3, fwd_timing.median_us / 1e3,
                     "?" if clocks.median_mhz is None else f"{clocks.median_mhz:.0f}")
        del layer
        torch.cuda.empty_cache()
    return results


# ---- tables ---------------------------------------------------------------------------------------------
def results_table(results: Iterable[Result]) -> pd.DataFrame:
    """One row per (variant, graphed): times, TFLOP/s and Substation's speedup over the row (same graphing)."""
    results = list(results)
    ours = {r.graphed: r.fwdbwd_ms for r in results if r.variant == SUBSTATION and r.fwdbwd_ms}
    rows = []
    for r in results:
        speedup = r.fwdbwd_ms / ours[r.graphed] if r.fwdbwd_ms and r.graphed in ours else None
        rows.append({"variant": r.variant, "graphed": "yes" if r.graphed else "no", "fwdbwd_ms": r.fwdbwd_ms,
                     "min_ms": r.min_ms, "fwd_ms": r.fwd_ms, "TFLOP/s": r.tflops, "SM_MHz": r.sm_mhz,
                     "substation_speedup": speedup, "note": r.error or ""})
    return pd.DataFrame(rows, columns=["variant", "graphed", "fwdbwd_ms", "min_ms", "fwd_ms", "TFLOP/s", "SM_MHz",
                                       "substation_speedup", "note"])


def format_table(table: pd.DataFrame, digits: int = 3) -> str:
    """A DataFrame as text: floats to `digits` places, missing values as '-'."""
    def cell(value: object) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    return table.astype(object).map(cell).to_string(index=False)


def breakdown_table(rows: Iterable[object]) -> pd.DataFrame:
    """`runtime.OperatorTime` rows in execution order, with measured/predicted and a total per pass and overall
    (predicted sums only the rows that have a prediction); host_us is what enqueueing the step costs the CPU."""
    records = [{"op": r.op, "pass": r.pass_, "impl": r.impl, "label": r.label,
                "predicted_us": math.nan if r.predicted_us is None else float(r.predicted_us),
                "measured_us": float(r.measured_us), "host_us": float(r.host_us)} for r in rows]
    table = pd.DataFrame(records, columns=["op", "pass", "impl", "label", "predicted_us", "measured_us", "host_us"])
    totals = []
    for name, part in [*table.groupby("pass", sort=False), ("all", table)]:
        totals.append({"op": "total" if name == "all" else f"total {name}", "pass": name, "impl": "", "label": "",
                       "predicted_us": part.predicted_us.sum(min_count=1), "measured_us": part.measured_us.sum(),
                       "host_us": part.host_us.sum()})
    table = pd.concat([table, pd.DataFrame(totals)], ignore_index=True)
    table["ratio"] = table.measured_us / table.predicted_us
    return table


def plot_results(rows: Iterable[Mapping[str, object]], path: str) -> None:
    """Bars of each variant's step time, as called and graphed, one panel per size (rows as `--json` writes
    them; failed variants are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["fwdbwd_ms"]]
    sizes = list(dict.fromkeys(str(r["size"]) for r in rows))
    if not sizes:
        raise ValueError("no timed rows to plot")
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        mine = [r for r in rows if r["size"] == size]
        variants = list(dict.fromkeys(str(r["variant"]) for r in mine))
        for offset, graphed, label in ((-0.2, False, "as called"), (0.2, True, "graphed (one CUDA graph)")):
            times = {r["variant"]: r["fwdbwd_ms"] for r in mine if r["graphed"] == graphed}
            ax.bar([i + offset for i in range(len(variants))], [times.get(v, 0.0) for v in variants], width=0.4,
                   label=label)
        ax.set_xticks(range(len(variants)), variants, rotation=30, ha="right")
        ax.set_ylabel("forward + backward (ms)")
        ax.set_title(size)
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="upper center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=120)
    plt.close(fig)
