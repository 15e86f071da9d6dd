"""ops.common.gc_paused: no garbage collection may run while a CUDA graph is captured (a collected
CUDAGraph in a reference cycle invalidates the capture; issue 42's passkey "capture failed")."""

import gc

import pytest
import torch

from kernel_checks import needs_cuda
from linearize.ops.common import gc_paused


class Finalized:
    """A node of a reference cycle that notes when the collector frees it."""

    freed: list = []

    def __init__(self, name):
        self.name, self.me = name, self

    def __del__(self):
        Finalized.freed.append(self.name)


@pytest.fixture
def eager_collector():
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    Finalized.freed = []
    gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation, as bad as it gets
    gc.enable()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()


def test_garbage_from_before_is_collected_at_entry_and_none_during_the_block(eager_collector):
    Finalized("before")
    with gc_paused():
        assert Finalized.freed == ["before"]
        Finalized("inside")
        for _ in range(1000):
            [[] for _ in range(10)]  # allocations that would trigger collections
        assert Finalized.freed == ["before"] and not gc.isenabled()
    assert gc.isenabled()
    gc.collect()
    assert Finalized.freed == ["before", "inside"]


def test_a_collector_disabled_by_the_caller_stays_disabled(eager_collector):
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_the_collector_comes_back_when_the_block_raises(eager_collector):
    with pytest.raises(RuntimeError, match="boom"):
        with gc_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()


@needs_cuda
def test_a_capture_survives_an_old_graph_left_in_a_reference_cycle(eager_collector):
    x = torch.ones(1024, device="cuda")
    old = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(old):
        x * 2
    cycle = [old]
    cycle.append(cycle)
    del old, cycle  # garbage that only the collector frees; freeing it destroys a graph
    new = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(new):
        for _ in range(200):
            [[] for _ in range(10)]
        z = x * 3
    new.replay()
    torch.cuda.synchronize()
    assert torch.equal(z, torch.full_like(x, 3.0))
