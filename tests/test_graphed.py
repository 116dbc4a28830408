"""The CPU side of `substation.graphed`: which graphed forwards still hold their saved tensors."""
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
