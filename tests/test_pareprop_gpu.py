"""PaReprop's lanes on a CUDA device; skipped without one (``python -m pytest -m gpu``, which
``benchmarks/gpu.sh`` runs, and again once per cross-stream wait with that wait dropped, its
negative controls: docs/gpu.md, "Negative controls").

Each of the schedule's waits (``_Lanes.WAITS``) has a test built to fail without it:

* ``recover-after-recover``: recover(k-1) reads the inputs recover(k) rebuilds on the other
  lane; a recomputation slowed on the producing lane, its outputs in memory filled with NaN;
* ``recover-after-grads``: a lifetime test, a reader slowed on one stream, the memory of what
  it reads freed and refilled with NaN on the other stream;
* ``join``: block 0 slowed on the side lane, its gradients read on the main stream;
* ``grads-after-grads`` and ``bottom-grads-after-grads``: grads(k) reads the dY that grads(k+1)
  writes on the other lane; gradients slowed on the producing lane, written into NaN.

The same schedule captured as CUDA graphs, its waits now edges of a graph: blocks slowed in
both recomputation and backward, and the lifetime test's stored blocks. (The slowed blocks of
tests/test_engine_gpu.py, NOTE [ Tests that can catch a race ], may catch any of them too, but
their recover and grads are slowed alike, so which lane is late is left to chance.)

Beside them: no "AccumulateGrad node's stream does not match" warning from PaReprop's backward,
checked in fresh processes against a control that shows this torch does warn; the fallback to
Reprop deciding on the device, with exact gradients; the FSDP prefetch with a slowed lane and
poisoned memory (two GPUs; skipped with fewer).
"""

import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import pareprop
from pareprop.distributed import fsdp
from pareprop.engine import MAIN_LANE, SIDE_LANE, current_lane, graphs
from pareprop.engine.lanes import _block_lanes, _side_stream
from pareprop.engine.testing import engine_errors, relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ROOT = pathlib.Path(__file__).resolve().parents[1]
SLEEP_CYCLES = 4_000_000  # about 2 ms on current GPUs


class _SleepBackward(torch.autograd.Function):
    """Identity whose backward holds its stream for a while before it reads the gradient."""

    @staticmethod
    def forward(ctx, x, cycles):
        ctx.cycles = cycles
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(ctx.cycles)
        return grad.clone(), None  # the first read of the incoming gradient, after the sleep


class Block(pareprop.ReversibleBlock):
    """LayerNorm and Linear in F and G. ``slow``: the backward of F and G first sleeps, so the
    gradient flowing in is read late. ``poison``: in recomputation (grad mode on), F first
    fills that many freed stream-sized blocks of its stream's allocator pool with NaN.
    ``slow_recompute``: F and G first sleep when PaReprop's backward recomputes them (on a
    lane), so what recover rebuilds is written late."""

    def __init__(self, dim, slow=False, poison=0, slow_recompute=False):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.proj1, self.proj2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.slow, self.poison, self.slow_recompute = slow, poison, slow_recompute

    def _late(self, x):
        return _SleepBackward.apply(x, SLEEP_CYCLES) if self.slow else x

    def _wait_if_recomputed(self):
        if self.slow_recompute and current_lane() is not None:
            torch.cuda._sleep(SLEEP_CYCLES)

    def f(self, x, **kwargs):
        if self.poison and torch.is_grad_enabled():
            junk = [torch.full_like(x, float("nan")) for _ in range(self.poison)]
            del junk  # back to the pool of the current stream, NaN inside
        self._wait_if_recomputed()
        return self._late(self.proj1(self.norm1(x)))

    def g(self, x, **kwargs):
        self._wait_if_recomputed()
        return self._late(self.proj2(self.norm2(x)))

    def f_split(self, x, **kwargs):  # declared, and None: whole branches, chunked schedule
        return None


class Model(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.stack = pareprop.ReversibleStack(blocks)

    def forward(self, x):
        return torch.cat(self.stack(x, x), dim=-1)


def test_lifetime_guard_keeps_memory_a_slowed_reader_still_needs():
    # NOTE [ Tensor lifetimes across streams ] in engine/backward.py. Blocks 2 and 3 are stored, so
    # the lanes do not alternate strictly (asserted below): block 4 (side stream) hands its dY to
    # grads(3) on the main stream, whose backward first sleeps, so it reads dY late. dY is freed on
    # the host as soon as grads(3) is queued, back to the side stream's pool; the next work on the
    # side stream is recover(1), whose F grabs every freed stream-sized block of that pool and fills
    # it with NaN. Only recover(1)'s wait for grads(3) (recover(k) waits for grads(k+2)) keeps it
    # from doing so while grads(3) sleeps. Without that wait the side stream runs recover(1) as soon
    # as grads(4) is done, the NaN lands in dY's memory while grads(3) still sleeps, and grads(3) to
    # grads(0), the input's gradient and every parameter gradient of blocks 0-3 come out NaN: the
    # errors below are NaN, not < 1e-10.
    torch.manual_seed(0)
    dim = 32
    blocks = [Block(dim), Block(dim, poison=64), Block(dim, slow=True), Block(dim, slow=True),
              Block(dim)]
    model = Model(blocks).double().cuda()
    model.stack.store_blocks([2, 3])
    assert _block_lanes([False, False, True, True, False]) == [
        MAIN_LANE, SIDE_LANE, MAIN_LANE, MAIN_LANE, SIDE_LANE]
    pareprop.set_engine(model, "pareprop", fallback=False)
    x = torch.randn(8, 64, dim, dtype=torch.float64, device="cuda")
    for _ in range(2):  # the second step reuses the pools the first one filled
        errors = engine_errors(model, x, engines=("pareprop",))["pareprop"]
        torch.cuda.synchronize()
        key, err = max(errors.items(), key=lambda kv: kv[1] if kv[1] == kv[1] else float("inf"))
        assert err < 1e-10, f"{key} off by {err:.3e}"


def test_final_join_waits_for_block_0_on_the_side_lane():
    # At even depth with nothing stored the lanes alternate from main at the top, so block 0,
    # the last step of backward, runs on the side lane ([side, main, side, main]). Its
    # backward is slowed: the stack's input gradient and block 0's parameter gradients reach
    # the main stream only through the final join (lanes.join, then to_main). Without it the
    # main stream reads them (the comparison with autograd below) before the side stream has
    # written them.
    torch.manual_seed(0)
    dim = 32
    blocks = [Block(dim, slow=True), Block(dim), Block(dim), Block(dim)]
    assert _block_lanes([False] * 4) == [SIDE_LANE, MAIN_LANE, SIDE_LANE, MAIN_LANE]
    model = Model(blocks).double().cuda()
    pareprop.set_engine(model, "pareprop", fallback=False)
    x = torch.randn(8, 64, dim, dtype=torch.float64, device="cuda")
    for _ in range(2):
        errors = engine_errors(model, x, engines=("pareprop",))["pareprop"]
        torch.cuda.synchronize()
        key, err = max(errors.items(), key=lambda kv: kv[1] if kv[1] == kv[1] else float("inf"))
        assert err < 1e-10, f"{key} off by {err:.3e}"


def _nan_filled_loss(outputs):
    # After forward, before backward allocates what it rebuilds: every free block of the main
    # stream's pool that could hold a stream tensor is filled with NaN.
    (out,) = outputs
    stream_shape = (*out.shape[:-1], out.shape[-1] // 2)  # the model concatenates Y1, Y2
    junk = [torch.full(stream_shape, float("nan"), dtype=out.dtype, device=out.device)
            for _ in range(64)]
    del junk
    gen = torch.Generator().manual_seed(1)
    return (out * torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)).sum()


def test_recover_waits_for_the_slowed_recomputation_above():
    # recover(k-1) starts from the X1, X2 that recover(k) rebuilds, on the other lane: only its
    # wait for recover(k) ("recover-after-recover") orders the read after the write. Nothing
    # stored at depth 4: lanes [side, main, side, main]. Blocks 3 and 1 (main lane) sleep
    # before each recomputed F and G, so their rebuilt X is written about 4 ms after the host
    # queued it, in memory the loss filled with NaN; recover(2) and recover(0) on the side
    # lane have nothing else to wait for (recover(2): only the side stream's start, after
    # forward; recover(0): grads(2), queued on main before recover(1)). Without the wait they
    # read NaN, and every gradient below block 3 comes out NaN.
    torch.manual_seed(0)
    dim = 32
    blocks = [Block(dim), Block(dim, slow_recompute=True), Block(dim),
              Block(dim, slow_recompute=True)]
    assert _block_lanes([False] * 4) == [SIDE_LANE, MAIN_LANE, SIDE_LANE, MAIN_LANE]
    model = Model(blocks).double().cuda()
    pareprop.set_engine(model, "pareprop", fallback=False)
    x = torch.randn(8, 64, dim, dtype=torch.float64, device="cuda")
    for _ in range(2):  # the second step reuses the pools the first one filled
        errors = engine_errors(model, x, engines=("pareprop",),
                               loss_fn=_nan_filled_loss)["pareprop"]
        torch.cuda.synchronize()
        key, err = max(errors.items(), key=lambda kv: kv[1] if kv[1] == kv[1] else float("inf"))
        assert err < 1e-10, f"{key} off by {err:.3e}"


def test_grads_wait_for_the_slowed_gradients_above():
    # grads(k) starts from the dY that grads(k+1) writes, on the other lane: only its wait for
    # grads(k+1) ("grads-after-grads"; for block 0, "bottom-grads-after-grads") orders the read
    # after the write. Nothing stored at depth 4: lanes [side, main, side, main]. Blocks 3 and
    # 1 (main lane) sleep first in the backward of F and G, so the dY they hand down is written
    # about 4 ms after the host queued it, in memory the loss filled with NaN; grads(2) and
    # grads(0) on the side lane follow recover(2) and recover(0), which are not slowed. Without
    # the wait they read NaN, and the gradients of blocks 0-2 and of the input come out NaN.
    torch.manual_seed(0)
    dim = 32
    blocks = [Block(dim), Block(dim, slow=True), Block(dim), Block(dim, slow=True)]
    assert _block_lanes([False] * 4) == [SIDE_LANE, MAIN_LANE, SIDE_LANE, MAIN_LANE]
    model = Model(blocks).double().cuda()
    pareprop.set_engine(model, "pareprop", fallback=False)
    x = torch.randn(8, 64, dim, dtype=torch.float64, device="cuda")
    for _ in range(2):
        errors = engine_errors(model, x, engines=("pareprop",),
                               loss_fn=_nan_filled_loss)["pareprop"]
        torch.cuda.synchronize()
        key, err = max(errors.items(), key=lambda kv: kv[1] if kv[1] == kv[1] else float("inf"))
        assert err < 1e-10, f"{key} off by {err:.3e}"


def _graphed_against_autograd(blocks, stored=()):
    """Train the stack of ``blocks`` under graphed PaReprop beside autograd, new data each step
    (its warm-up, the capture, two more replays), each step's gradients compared."""
    dim = 32

    def model(engine):
        torch.manual_seed(0)
        net = Model(blocks())
        net.stack.store_blocks(stored)
        pareprop.set_engine(net, engine, **(dict(fallback=False, cuda_graphs=True)
                                            if engine == "pareprop" else {}))
        return net.double().cuda()

    graphed, reference = model("pareprop"), model("autograd")
    data = torch.Generator(device="cuda").manual_seed(1)
    for step in range(graphs.WARMUP_STEPS + 3):
        x = torch.randn(8, 64, dim, dtype=torch.float64, device="cuda", generator=data)
        got = []
        for net in (graphed, reference):
            net.zero_grad(set_to_none=True)
            net(x).pow(2).sum().backward()
            got.append({n: p.grad.clone() for n, p in net.named_parameters()})
        torch.cuda.synchronize()
        for name, want in got[1].items():
            err = relative_error(got[0][name], want)
            assert err < 1e-10, f"step {step}: {name} off by {err:.3e}"
    assert graphed.stack.cuda_graph_status.startswith("captured")


def test_graphed_schedule_keeps_the_waits_between_lanes():
    # Under cuda_graphs=True the schedule above is captured once, each wait becoming an edge of
    # the graph, and replayed. Blocks 1 and 3 (main lane) are slowed in recomputation and in
    # the backward of F and G, so recover(2), recover(0), grads(2) and grads(0) on the side
    # lane would read what those blocks write before it is written, were an edge missing. In a
    # replay that memory holds the previous step's values, and each step has new data: the
    # gradients would differ from autograd's. Without the final join the capture itself fails.
    slowed = dict(slow=True, slow_recompute=True)
    _graphed_against_autograd(lambda: [Block(32), Block(32, **slowed), Block(32),
                                       Block(32, **slowed)])


def test_graphed_schedule_keeps_lifetimes_beside_stored_blocks():
    # The lifetime test above, captured: blocks 2 and 3 stored and slowed in backward, block 1
    # filling freed memory of its lane with NaN in recomputation. In a capture, memory freed on
    # one lane may be handed to the other lane's later allocations as in eager mode; only the
    # wait of recover(1) for grads(3) ("recover-after-grads", an edge of the graph) orders the
    # NaN after the slowed reader.
    _graphed_against_autograd(lambda: [Block(32), Block(32, poison=64), Block(32, slow=True),
                                       Block(32, slow=True), Block(32)], stored=(2, 3))


def _run_fresh(script):
    """stderr of ``script`` in a new Python process (TORCH_WARN_ONCE warns once per process)."""
    env = dict(os.environ)
    env.pop("TORCH_CUDA_SANITIZER", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    done = subprocess.run([sys.executable, "-W", "default", "-c", textwrap.dedent(script)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


WARNING = "AccumulateGrad node's stream does not match"

CONTROL = """
    import torch
    w = torch.nn.Parameter(torch.randn(4, device="cuda"))
    kept = w * 2  # keeps w's AccumulateGrad, made on the default stream, alive
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.autograd.grad((w * 3).sum(), [w])
    torch.cuda.synchronize()
"""

PAREPROP_STEPS = """
    import torch, torch.nn as nn, pareprop

    class Block(pareprop.ReversibleBlock):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def f(self, x, **kwargs):
            return self.a(x)

        def g(self, x, **kwargs):
            return self.b(x)

    for stored in ((), (1,)):
        stack = pareprop.ReversibleStack([Block() for _ in range(4)], stored_blocks=stored)
        stack.set_engine("pareprop", fallback=False).cuda()
        x = torch.randn(2, 8, 16, device="cuda", requires_grad=True)
        for _ in range(2):
            y1, y2 = stack(x, x)
            (y1.sum() + y2.sum()).backward()
    torch.cuda.synchronize()
"""


def test_pareprop_backward_does_not_warn_of_accumulate_grad_streams():
    # NOTE [ Parameter aliases on the lanes ]: no autograd node sees two streams.
    if WARNING not in _run_fresh(CONTROL):
        pytest.skip("this torch does not warn of AccumulateGrad stream mismatches (< 2.9)")
    assert WARNING not in _run_fresh(PAREPROP_STEPS)


def test_fallback_decides_on_the_device_with_exact_gradients(caplog):
    torch.manual_seed(0)
    model = Model([Block(32) for _ in range(4)]).double().cuda()
    pareprop.set_engine(model, "pareprop")
    x = torch.randn(4, 16, 32, dtype=torch.float64, device="cuda")
    reference = Model([Block(32) for _ in range(4)]).double().cuda()
    reference.load_state_dict(model.state_dict())
    pareprop.set_engine(reference, "autograd")
    reference(x).pow(2).sum().backward()
    want = [p.grad for p in reference.parameters()]
    assert pareprop.chosen_schedule(model) == "measuring"
    choice = model.stack._fallback
    passes = 2 * (choice.WARMUP + choice.TRIALS)
    with caplog.at_level(logging.INFO, logger="pareprop"):
        for _ in range(passes + 2):
            model.zero_grad(set_to_none=True)
            model(x).pow(2).sum().backward()
            torch.cuda.synchronize()  # the timed passes' events are done: the next decides
            got = [p.grad for p in model.parameters()]
            assert max(relative_error(a, b) for a, b in zip(got, want)) < 1e-10
    assert pareprop.chosen_schedule(model) in ("pareprop", "reversible")
    records = [r for r in caplog.records if r.name == "pareprop"]
    assert len(records) == 1 and "ms per backward" in records[0].getMessage()


# ---- FSDP: the prefetch's all-gather buffer (NOTE [ FSDP prefetch on the waiting lane ]) ----

WORLD = 2


def _fsdp_worker(rank, init_file, out):
    import torch.distributed as tdist

    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                             world_size=WORLD)
    try:
        model = _fsdp_model().cuda()
        fsdp.shard(model)
        # A sharded stack under a reversible engine needs stream inputs that require grad.
        x = _fsdp_batch()[rank::WORLD].cuda().requires_grad_(True)
        for _ in range(2):  # the second step reuses the pools the first one filled
            model.zero_grad(set_to_none=True)
            out_ = model(x)
            _poison_pools()
            out_.pow(2).mean().backward()
        grads = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()}
        torch.cuda.synchronize()
        torch.save(grads, os.path.join(out, f"rank{rank}.pt"))
    finally:
        tdist.destroy_process_group()


def _fsdp_model():
    torch.manual_seed(0)
    # Slow blocks keep both lanes busy, so a copy-out queued on one lane runs late while the
    # other lane allocates; the poison fills what each lane's pool has free with NaN.
    blocks = [Block(64, slow=i % 2 == 0, poison=32 if i % 2 else 0) for i in range(6)]
    model = Model(blocks).double()
    pareprop.set_engine(model, "pareprop", fallback=False)
    return model


def _fsdp_batch():
    torch.manual_seed(1)
    return torch.randn(8, 32, 64, dtype=torch.float64)


def _poison_pools():
    side = _side_stream(torch.device("cuda", torch.cuda.current_device()))
    for stream in (torch.cuda.current_stream(), side):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            junk = [torch.full((2**17,), float("nan"), dtype=torch.float64, device="cuda")
                    for _ in range(32)]
            del junk


@pytest.mark.skipif(torch.cuda.device_count() < WORLD or not fsdp.fsdp_available(),
                    reason="needs two CUDA devices and FSDP2")
def test_fsdp_prefetch_under_pareprop_gives_one_process_gradients(tmp_path):
    # Reviewed, never run: the machines this was written on have at most one GPU. At world
    # size 1 FSDP2 copies the shard without an all-gather buffer, so one GPU cannot show the
    # race; tests/test_fsdp_lanes.py checks on the CPU that each prefetch is issued on the lane
    # that waits for it.
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD,
             join=True)
    model = _fsdp_model()
    pareprop.set_engine(model, "autograd")
    model(_fsdp_batch()).pow(2).mean().backward()
    for rank in range(WORLD):
        grads = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, p in model.named_parameters():
            assert relative_error(grads[name], p.grad) < 1e-10, (rank, name)
