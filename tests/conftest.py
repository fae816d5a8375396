"""Settings shared by every test module."""

import contextlib

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


# benchmarks/gpu.sh's negative controls: with PAREPROP_DROP_WAIT=NAME the PaReprop schedule
# skips that one cross-stream wait (pareprop.engine.lanes' _Lanes.WAITS), so that the GPU tests
# can show they fail without it. Unset (always, outside gpu.sh), nothing changes. How many times
# the wait was dropped (where it would have made a stream wait: on CUDA, for an event) is
# printed at the end, so a control whose tests pass says whether they reached the wait at all.
# Each control needs one failing test of its eager tests and one of its graphed tests (the
# schedule captured as CUDA graphs): after the first failure in a group, the rest of that group
# is skipped, so a control costs a few tests, not all of them.
_DROPPED = [0]
_CAUGHT = {}  # "eager" or "graphed" -> the first test of that group that failed


def _control_group(nodeid):
    return "graphed" if "graph" in nodeid else "eager"


def _drop_wait_name():
    """The wait PAREPROP_DROP_WAIT names, checked; None when unset."""
    import os

    name = os.environ.get("PAREPROP_DROP_WAIT") or None
    if name is not None:
        from pareprop.engine.lanes import _Lanes

        if name not in _Lanes.WAITS:
            raise pytest.UsageError(
                f"PAREPROP_DROP_WAIT: expected one of {', '.join(_Lanes.WAITS)}, got {name!r}")
    return name


@contextlib.contextmanager
def _dropping(name):
    """PaReprop's schedule without the wait ``name``, each drop counted in _DROPPED."""
    from pareprop.engine.lanes import _Lanes

    wait, join = _Lanes.wait, _Lanes.join

    def dropped_wait(self, i, event, n):
        if n != name:
            return wait(self, i, event, n)
        _DROPPED[0] += bool(self.enabled and event is not None)

    def dropped_join(self):
        _DROPPED[0] += bool(self.enabled)

    if name == "join":
        _Lanes.join = dropped_join
    else:
        _Lanes.wait = dropped_wait
    try:
        yield
    finally:
        _Lanes.wait, _Lanes.join = wait, join


def pytest_configure(config):
    _drop_wait_name()  # a misspelt name stops the run at once, in one line


@pytest.fixture(autouse=True, scope="session")
def _negative_control():
    name = _drop_wait_name()
    if name is None:
        yield
        return
    with _dropping(name):
        yield


def pytest_runtest_setup(item):
    group = _control_group(item.nodeid)
    if group in _CAUGHT and _drop_wait_name() is not None:
        pytest.skip(f"this control is caught already, by {_CAUGHT[group]}")


def pytest_runtest_logreport(report):
    # a test that failed, not one that could not run (an error in a fixture decides nothing)
    if report.failed and report.when == "call" and _drop_wait_name() is not None:
        _CAUGHT.setdefault(_control_group(report.nodeid), report.nodeid)


def pytest_terminal_summary(terminalreporter):
    name = _drop_wait_name()
    if name is not None:  # benchmarks/gpu.sh reads this line
        terminalreporter.write_line(f"PAREPROP_DROP_WAIT={name}: dropped {_DROPPED[0]} times")
