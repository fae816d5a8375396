"""Engine checks that need a CUDA device; they skip cleanly without one.

Run on a GPU machine with ``python -m pytest -m gpu -q``; ``benchmarks/gpu.sh`` runs them, and
runs the slowed-block tests again once per cross-stream wait of PaReprop's schedule with that
wait dropped (its negative controls, docs/gpu.md). It runs no stream sanitizer: torch's
(``TORCH_CUDA_SANITIZER=1``) forgets a tensor's accesses when its memory is freed, so it cannot
see the lifetime races the waits exist for; the tests below can still be run under it by hand
(``UNDER_SANITIZER`` skips those that time kernels).

NOTE [ Tests that can catch a race ]
    Kernels of tiny blocks finish in microseconds, so a missing cross-stream wait would still
    almost always read finished data. Here F and G first launch a sleep kernel on their stream
    (``torch.cuda._sleep``, before the real work, in forward, recomputation and backward), so
    everything a block produces is late by about a millisecond: a consumer on the other stream
    that does not wait reads memory not yet written. What it reads instead is made wrong on
    purpose: a decoy step with other inputs first fills the streams' cached memory with other
    values, and just before backward the loss fills the current stream's free memory with NaN.
"""

import json
import os
from collections import defaultdict

import pytest
import torch
import torch.nn as nn

import pareprop
from pareprop.engine.testing import engine_errors, relative_error, worst_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# The sanitizer checks every kernel from Python: the host becomes far slower than the device,
# so tests that time kernels or expect the host to run ahead say nothing under it.
UNDER_SANITIZER = bool(os.environ.get("TORCH_CUDA_SANITIZER"))


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
    def __init__(self, depth, dim, drop=0.1, engine="reversible", block=Block):
        super().__init__()
        self.stack = pareprop.ReversibleStack([block(dim, drop) for _ in range(depth)], engine)

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
    """Identity whose forward and backward each hold one SM busy for a while before they
    produce their result: what comes after it on the stream is late by that much."""

    @staticmethod
    def forward(ctx, x, cycles=SLEEP_CYCLES):
        ctx.cycles = cycles
        torch.cuda._sleep(cycles)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(ctx.cycles)
        return grad.clone(), None


class SleepyBlock(Block):
    """Recover and grads cannot fill the GPU, so if the schedule lets them, they overlap."""

    def f(self, x, **kwargs):
        return _Sleep.apply(self.proj(x))

    def g(self, x, **kwargs):
        return _Sleep.apply(self.proj(x))


RACE_CYCLES = 1_000_000  # about half a millisecond


class SlowBlock(Block):
    """Block (dropout on) whose F and G wait on the device before their real work."""

    def f(self, x, **kwargs):
        return super().f(_Sleep.apply(x, RACE_CYCLES))

    def g(self, x, **kwargs):
        return super().g(_Sleep.apply(x, RACE_CYCLES))


def _poison_free_memory(mib=64):
    # 1 MiB tensors come from the allocator's small pool, where the test's tensors live too.
    chunks = [torch.full((2**17,), float("nan"), dtype=torch.float64, device="cuda")
              for _ in range(mib)]
    del chunks


def _poisoning_loss(outputs):
    _poison_free_memory()  # after forward, before backward allocates what it rebuilds
    gen = torch.Generator().manual_seed(1)
    return sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)).sum()
               for o in outputs)


@pytest.mark.parametrize("ambient", ["default stream", "user stream"])
@pytest.mark.parametrize("depth", [3, 4])
@pytest.mark.parametrize("engine", ["reversible", "pareprop"])
def test_slowed_blocks_give_autograd_gradients(engine, depth, ambient):
    torch.manual_seed(0)
    model = Model(depth, 32, block=SlowBlock).double().cuda()
    x = torch.randn(8, 64, 32, dtype=torch.float64, device="cuda")
    stream = torch.cuda.Stream() if ambient == "user stream" else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())  # x and the weights come from the default
    with torch.cuda.stream(stream):
        # The decoy: the same allocations with other values, on every stream the engine uses.
        pareprop.set_engine(model, engine)
        model(x + 1).sum().backward()
        model.zero_grad(set_to_none=True)
        errors = engine_errors(model, x, engines=(engine,), loss_fn=_poisoning_loss)[engine]
    torch.cuda.synchronize()
    key, err = max(errors.items(), key=lambda kv: kv[1])
    assert err < 1e-10, f"{engine}, depth {depth}, {ambient}: {key} off by {err:.3e}"


class LeanSlowBlock(pareprop.ReversibleBlock):
    """F and G: a sleep, LayerNorm, one square Linear; its graph is small next to its streams."""

    def __init__(self, dim, cycles):
        super().__init__()
        self.cycles = cycles
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.proj1, self.proj2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def f(self, x, **kwargs):
        return self.proj1(self.norm1(_Sleep.apply(x, self.cycles)))

    def g(self, x, **kwargs):
        return self.proj2(self.norm2(_Sleep.apply(x, self.cycles)))


def _backward_peaks(stack, x, w, engine):
    """Growth of reserved and allocated memory during one backward, after a warm-up step."""
    stack.set_engine(engine, fallback=False)  # PaReprop itself, not its fallback to Reprop
    for _ in range(2):  # a warm-up step, then the measured one
        stack.zero_grad(set_to_none=True)
        y1, y2 = stack(x, x)
        loss = (y1 * w).sum() + (y2 * w).sum()  # full-size dY1, dY2
        del y1, y2
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        del loss
    return (torch.cuda.max_memory_reserved() - reserved,
            torch.cuda.max_memory_allocated() - allocated)


def test_pareprop_reserves_at_most_two_rebuilt_graphs_more_than_reversible():
    # Sleeps of ~5 ms per F and G let the host enqueue the whole backward far ahead of the
    # device, the case where tensors handed between streams with record_stream cannot be
    # reused until the device catches up, and reserved memory grows with depth.
    torch.manual_seed(0)
    depth, batch, tokens, dim = 24, 16, 256, 1024  # one stream tensor: 16 MiB
    stack = pareprop.ReversibleStack([LeanSlowBlock(dim, 10_000_000) for _ in range(depth)])
    stack.cuda()
    x = torch.randn(batch, tokens, dim, device="cuda")
    w = torch.randn_like(x)
    stream_bytes = x.numel() * x.element_size()
    # One block's rebuilt graph: what F and G keep for backward, and the two inputs rebuilt.
    x1, x2 = (x.clone().requires_grad_(True) for _ in range(2))
    rebuilt = pareprop.activation_bytes(stack.blocks[0], x1, x2) + 2 * stream_bytes
    del x1, x2

    reversible = _backward_peaks(stack, x, w, "reversible")
    par = _backward_peaks(stack, x, w, "pareprop")
    slack = 32 * 2**20  # allocator rounding: 2 MiB small segments per stream, 20 MiB mid-size
    mib = 2**20
    report = (f"backward growth, reserved/allocated MiB: reversible {reversible[0] / mib:.0f}/"
              f"{reversible[1] / mib:.0f}, pareprop {par[0] / mib:.0f}/{par[1] / mib:.0f}; "
              f"one rebuilt graph {rebuilt / mib:.0f} MiB, stream tensor {stream_bytes / mib:.0f}"
              f" MiB, depth {depth}")
    assert par[1] <= reversible[1] + 2 * rebuilt + slack, report
    assert par[0] <= reversible[0] + 2 * rebuilt + slack, report


@pytest.mark.skipif(UNDER_SANITIZER, reason="timing says nothing under the sanitizer")
def test_pareprop_runs_recovery_and_gradients_concurrently(tmp_path):
    depth = 6
    stack = pareprop.ReversibleStack([SleepyBlock(64, 0.0) for _ in range(depth)])
    stack.set_engine("pareprop", fallback=False).cuda()
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
    assert len(streams) >= 2, f"expected the main stream and the side stream, got {streams}"
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


@pytest.mark.parametrize("fallback", [False, True])
def test_host_does_not_wait_inside_backward(fallback):
    # With the fallback on, the passes that time PaReprop against Reprop (CUDA events, the
    # allocator's counters, Event.query) must not wait either.
    model = Model(4, 64).cuda()
    pareprop.set_engine(model, "pareprop", fallback=fallback)
    x = torch.randn(4, 8, 64, device="cuda")
    model(x).sum().backward()  # warm-up
    passes = 10 if fallback else 1  # every measuring pass, and the one that decides
    for _ in range(passes):
        loss = model(x).sum()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation raises
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
