"""Settings shared by every test module."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # The tests run tiny models, often in float64: a second intra-op thread only adds hand-offs
    # (measured up to 10x slower on a busy 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def float64_seeded():
    """float64 as the default dtype and seed 0, for modules that compare engines exactly
    (``pytestmark = pytest.mark.usefixtures("float64_seeded")``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(autouse=True, scope="session")
def _negative_control():
    # benchmarks/gpu.sh's negative controls: with PAREPROP_DROP_WAIT=NAME the PaReprop schedule
    # skips that one cross-stream wait (pareprop.engine.lanes' _Lanes.WAITS), so that the GPU tests
    # can show they fail without it. Unset (always, outside gpu.sh), nothing changes.
    import os

    name = os.environ.get("PAREPROP_DROP_WAIT")
    if not name:
        yield
        return
    from pareprop.engine.lanes import _Lanes

    if name not in _Lanes.WAITS:
        raise pytest.UsageError(f"PAREPROP_DROP_WAIT: expected one of {_Lanes.WAITS}, got {name!r}")
    wait, join = _Lanes.wait, _Lanes.join
    if name == "join":
        _Lanes.join = lambda self: None
    else:
        _Lanes.wait = lambda self, i, event, n: None if n == name else wait(self, i, event, n)
    yield
    _Lanes.wait, _Lanes.join = wait, join
