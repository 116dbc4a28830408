"""The CPU side of `substation.graphed`: which graphed forwards still hold their saved tensors, and which gradient
buffer a replay may write."""
import gc

from substation.graphed import GraphedStep


def test_a_forward_holds_its_saved_tensors_until_its_autograd_graph_goes():
    graphed = GraphedStep.__new__(GraphedStep)  # the bookkeeping alone: capturing needs a GPU
    graphed.outstanding = set()
    first = graphed.hold(1)
    second = graphed.hold(2)
    assert graphed.outstanding == {1, 2}
    del first
    gc.collect()
    assert graphed.outstanding == {2}, "a finished (or dropped) step releases its generation"
    del second
    assert not graphed.outstanding


def test_gradient_buffers_know_which_one_a_parameter_still_holds():
    """What a graphed backward relies on, on the CPU: a buffer's views handed to autograd become the parameters'
    .grad without a copy (AccumulateGrad steals them), a held buffer is not free, zero_grad's default frees it, and
    gradients accumulated into a held one leave the other free."""
    import torch

    from substation.graphed import GradientBuffers

    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    buffers = GradientBuffers([p.shape for p in params], torch.float32, torch.device("cpu"))

    class HandOut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, index, *inputs):
            ctx.index = index
            return sum(p.sum() for p in inputs)

        @staticmethod
        def backward(ctx, grad):
            flat = buffers.flats[ctx.index]
            flat.copy_(torch.arange(flat.numel(), dtype=flat.dtype) + 1)
            return None, *buffers.views(flat)

    def step() -> int:
        index = buffers.free()
        assert index is not None
        HandOut.apply(index, *params).backward()
        return index

    assert step() == 0
    base = buffers.flats[0].untyped_storage().data_ptr()
    assert all(p.grad.untyped_storage().data_ptr() == base for p in params), "no copy"
    assert buffers.free() == 1, "buffer 0 is held as .grad"
    assert step() == 1  # accumulated into buffer 0's views
    torch.testing.assert_close(params[1].grad, 2 * (torch.arange(12, 17, dtype=torch.float32) + 1))
    assert buffers.free() == 1, "accumulation kept buffer 0 and let buffer 1 go"
    held = params[0].grad
    for p in params:
        p.grad = None
    assert buffers.free() == 1, "a reference the user keeps holds buffer 0"
    assert step() == 1
    assert buffers.free() is None
    del held
    for p in params:
        p.grad = None
    assert buffers.free() == 0
    assert buffers.fits([p.shape for p in params], torch.float32, torch.device("cpu"))
    assert not buffers.fits([p.shape for p in params], torch.float16, torch.device("cpu"))


def test_a_new_shape_out_of_memory_or_beyond_max_shapes_drops_the_shapes_used_longest_ago():
    """Each captured shape holds a memory pool. A new shape's capture that runs out of memory drops the oldest shapes'
    graphs one at a time and tries again, and raises where none are left to drop; a shape beyond `max_shapes` drops
    the oldest. The first drop is warned of (it means captures to come), later ones are not."""
    import warnings

    import pytest
    import torch

    from substation.graphed import StepGraphs

    graphs = StepGraphs(max_shapes=4)
    graphs._steps.update((length, f"graphs of L={length}") for length in (64, 128, 192))
    fits_beside = 1  # a capture fits beside one other shape's pool, no more

    def capture():
        if len(graphs._steps) > fits_beside:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return "new graphs"

    with pytest.warns(UserWarning, match=r"out of GPU memory .* the 2 shape\(s\) used longest ago were dropped \(2 kept"):
        assert graphs._kept(graphs._steps, 256, capture) == "new graphs"
    assert list(graphs._steps) == [192, 256], "the two used longest ago are dropped, the newest kept"

    fits_beside = 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned of once per stack: not again
        for length in (320, 384, 448):
            graphs._kept(graphs._steps, length, capture)
    assert list(graphs._steps) == [256, 320, 384, 448], "max_shapes=4: the oldest dropped"
    graphs._kept(graphs._steps, 320, capture)  # captured again (its parameters moved, say): replaced, nothing dropped
    assert list(graphs._steps) == [256, 384, 448, 320]

    fits_beside = -1  # fits nowhere: with nothing left to drop, the allocator's error
    with pytest.raises(torch.OutOfMemoryError):
        graphs._kept(graphs._steps, 512, capture)
    assert not graphs._steps

    fresh = StepGraphs(max_shapes=1)
    fresh._steps[64] = "graphs of L=64"
    with pytest.warns(UserWarning, match=r"beyond max_shapes=1 .* the 1 shape\(s\) .* \(1 kept\)"):
        fresh._kept(fresh._steps, 128, lambda: "new graphs")


def test_forward_only_graphs_are_kept_apart_and_dropped_first_for_their_own_kind():
    """Evaluation's forward-only graphs count against max_shapes apart from the training graphs, so evaluating many
    shapes never pushes a training shape out; out of memory, a capture drops the graphs of its own kind first, then
    the other kind's."""
    import warnings

    import torch

    from substation.graphed import StepGraphs

    graphs = StepGraphs(max_shapes=2)
    graphs._steps.update((length, f"training graphs of L={length}") for length in (64, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for length in (64, 128, 192):
            graphs._kept(graphs.forward_only, length, lambda: "forward-only graphs")
    assert list(graphs.forward_only) == [128, 192] and list(graphs._steps) == [64, 128]
    assert len(graphs) == 2, "len counts the training shapes"

    room = 1  # a capture fits only where at most one other shape's graphs are left, of either kind

    def capture():
        if len(graphs._steps) + len(graphs.forward_only) > room:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return "forward-only graphs"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphs._kept(graphs.forward_only, 256, capture)
    assert list(graphs.forward_only) == [256] and list(graphs._steps) == [128], "its own kind first, then the other"


def test_the_shapes_of_one_kind_capture_into_the_pool_their_kept_graphs_use(monkeypatch):
    """A new shape's capture shares the pool of the kept graphs of its kind on its device; where none is kept it
    takes a new pool, since PyTorch's allocator refuses a shared pool that no graph uses any more."""
    from types import SimpleNamespace

    import torch

    import substation.graphed as graphed
    from substation.graphed import StepGraphs

    handles = iter(range(100))
    monkeypatch.setattr(graphed.torch.cuda, "graph_pool_handle", lambda: (next(handles), 0))
    monkeypatch.setattr(graphed.torch.cuda, "Stream", lambda device: ("stream on", device))
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    steps = {}
    first = StepGraphs._pool(steps, gpu0)
    assert first.handle == (0, 0) and first.forwards == 0 and first.stream == ("stream on", gpu0)
    steps[("L", 64)] = SimpleNamespace(pool=first, x=SimpleNamespace(device=gpu0))
    assert StepGraphs._pool(steps, gpu0) is first, "shared while a graph of the pool is kept"
    assert StepGraphs._pool(steps, gpu1).handle == (1, 0), "another device: another pool"
    steps.clear()
    assert StepGraphs._pool(steps, gpu0).handle == (2, 0), "none kept: a new pool"
