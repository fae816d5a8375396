"""Engine checks that need a CUDA device; they skip cleanly without one.

Run on a GPU machine with ``python -m pytest -m gpu -q`` (``benchmarks/gpu.sh`` does).
"""

import json
from collections import defaultdict

import pytest
import torch
import torch.nn as nn

import pareprop
from pareprop.testing import engine_errors, relative_error, worst_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Block(pareprop.ReversibleBlock):
    def __init__(self, dim, drop=0.1):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(drop)

    def f(self, x, **kwargs):
        return self.drop(self.proj(self.norm1(x)))

    def g(self, x, **kwargs):
        return self.drop(self.mlp(self.norm2(x)))


class Model(nn.Module):
    def __init__(self, depth, dim, drop=0.1, engine="reversible"):
        super().__init__()
        self.stack = pareprop.ReversibleStack([Block(dim, drop) for _ in range(depth)], engine)

    def forward(self, x):
        return torch.cat(self.stack(x, x), dim=-1)


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_engines_match_autograd_on_gpu_with_dropout(depth):
    torch.manual_seed(0)
    model = Model(depth, 16).double().cuda()
    x = torch.randn(4, 7, 16, dtype=torch.float64, device="cuda")
    engine, key, err = worst_error(engine_errors(model, x))
    assert err < 1e-10, f"{engine} on {key}: {err:.3e}"


def test_gpu_gradients_equal_cpu_gradients():
    torch.manual_seed(0)
    cpu = Model(3, 16, drop=0.0).double()
    x = torch.randn(4, 7, 16, dtype=torch.float64)
    grads = {}
    for device in ("cpu", "cuda"):
        for name in pareprop.ENGINES:
            model = Model(3, 16, drop=0.0, engine=name).double().to(device)
            model.load_state_dict(cpu.state_dict())
            model(x.to(device)).pow(2).sum().backward()
            grads[device, name] = [p.grad.cpu() for p in model.parameters()]
    for name in pareprop.ENGINES:
        errs = [relative_error(a, b) for a, b in zip(grads["cuda", name], grads["cpu", name])]
        assert max(errs) < 1e-10, name


@pytest.mark.parametrize("name", ["reversible", "pareprop"])
def test_cuda_rng_state_after_a_step_equals_autograd(name):
    def step(engine):
        torch.manual_seed(1)
        model = Model(3, 16, engine=engine).cuda()
        model(torch.randn(2, 4, 16, device="cuda")).sum().backward()
        return torch.cuda.get_rng_state(), torch.get_rng_state()

    got, want = step(name), step("autograd")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_autocast_bf16_gradients_close_to_autograd():
    torch.manual_seed(0)
    model = Model(4, 64, drop=0.0).cuda()
    x = torch.randn(8, 32, 64, device="cuda")
    grads = {}
    for name in pareprop.ENGINES:
        model.zero_grad(set_to_none=True)
        pareprop.set_engine(model, name)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        out.float().pow(2).mean().backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    for name in ("reversible", "pareprop"):
        errs = [relative_error(a, b) for a, b in zip(grads[name], grads["autograd"])]
        assert max(errs) < 5e-2, name


def _kernel_intervals(trace_path):
    with open(trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    by_stream = defaultdict(list)
    for ev in events:
        stream = ev.get("args", {}).get("stream")
        if ev.get("cat") == "kernel" and "dur" in ev and stream is not None:
            by_stream[stream].append((ev["ts"], ev["ts"] + ev["dur"]))
    return by_stream


def _overlap_us(a, b):
    total = 0.0
    for s1, e1 in a:
        for s2, e2 in b:
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


SLEEP_CYCLES = 2_000_000  # about a millisecond on current GPUs, on a single SM


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each hold one SM busy for a while: recover and
    grads then cannot fill the GPU, so if the schedule lets them, they run side by side."""

    @staticmethod
    def forward(ctx, x):
        torch.cuda._sleep(SLEEP_CYCLES)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(SLEEP_CYCLES)
        return grad.clone()


class SleepyBlock(Block):
    def f(self, x, **kwargs):
        return _Sleep.apply(self.proj(x))

    def g(self, x, **kwargs):
        return _Sleep.apply(self.proj(x))


def test_pareprop_runs_recovery_and_gradients_concurrently(tmp_path):
    depth = 6
    stack = pareprop.ReversibleStack([SleepyBlock(64, 0.0) for _ in range(depth)], "pareprop")
    stack.cuda()
    x = torch.randn(4, 8, 64, device="cuda")

    def step():
        y1, y2 = stack(x, x)
        (y1.sum() + y2.sum()).backward()

    for _ in range(2):  # warm-up: streams, allocator, kernels
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    by_stream = _kernel_intervals(trace)
    streams = sorted(by_stream)
    assert len(streams) >= 3, f"expected the default stream and two side streams, got {streams}"
    overlap = max(
        _overlap_us(by_stream[a], by_stream[b]) for a in streams for b in streams if a < b
    )
    # Forward runs on the default stream alone. In backward, steps l = L..2 each pair
    # recover(l-1) (two sleeps) with grads(l) (two sleeps): about 2 (L-1) sleeps overlap.
    sleep_us = max(e - s for spans in by_stream.values() for s, e in spans)
    assert overlap > 0.5 * (depth - 1) * sleep_us, (
        f"PaReprop's streams overlapped {overlap:.0f} us, expected about "
        f"{2 * (depth - 1) * sleep_us:.0f} us"
    )


def test_host_does_not_wait_inside_backward():
    model = Model(4, 64, engine="pareprop").cuda()
    x = torch.randn(4, 8, 64, device="cuda")
    model(x).sum().backward()  # warm-up
    loss = model(x).sum()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation raises
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
