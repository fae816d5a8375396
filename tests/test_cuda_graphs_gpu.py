"""CUDA graphs of a stack's step on a CUDA device; skipped without one (``python -m pytest -m
gpu``, which ``benchmarks/gpu.sh`` runs).

Each test trains a graphed model beside a reference for a few steps, with an optimizer step
between steps and new data each step, so the replays after the capture are checked too (the
capture is the step after ``graphs.WARMUP_STEPS`` eager ones):

* every engine under graphs against eager autograd, float64 (exact) and float32, Rev-ViT and
  Rev-Swin (several stacks, window masks as keywords);
* dropout and drop-path on: the reversible engines under graphs against autograd under graphs
  (they draw the same masks from the same seed: NOTE [ Randomness in CUDA graphs ]), and new
  masks at each replay;
* bf16 autocast with AdamW, as the small-batch benchmark runs it, graphed against eager;
* the step really replays: after capture, a step rebuilds no block on the host;
* compiled F and G (``compile_blocks``, Inductor) under graphs and bf16 autocast: compiled in
  warm-up, nothing compiled in the capture or the replays, against the same engine eager;
* DDP (NCCL, one process) around a graphed model: every engine against eager autograd in
  float64, DDP's reduction fed by every replay.
The same code runs on the CPU through a stand-in (tests/test_cuda_graphs.py).
"""

import pytest
import torch

import pareprop
from pareprop.engine import backward, graphs
from pareprop.engine.testing import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NO_DROP = dict(attn_drop_rate=0.0, proj_drop_rate=0.0, drop_path_rate=0.0)
DROP = dict(attn_drop_rate=0.1, proj_drop_rate=0.1, drop_path_rate=0.3)
STEPS = graphs.WARMUP_STEPS + 3  # the capture and two more replays


def _vit(engine="autograd", drop=NO_DROP, dtype=torch.float32):
    torch.manual_seed(0)
    return pareprop.create_model("rev_vit_tiny_patch4_32", img_size=32, embed_dim=64, depth=4,
                                 num_heads=4, num_classes=10, engine=engine,
                                 **drop).to("cuda", dtype)


def _swin(engine="autograd", drop=NO_DROP, dtype=torch.float32):
    torch.manual_seed(0)
    return pareprop.create_model("rev_swin_tiny_32", embed_dim=32, depths=(2, 2),
                                 num_heads=(2, 4), window=4, patch_size=2, img_size=32,
                                 num_classes=10, engine=engine, **drop).to("cuda", dtype)


FAMILIES = {"vit": _vit, "swin": _swin}


def _train(models, steps=STEPS, amp=False, optimizer="sgd", batch=8):
    """Each step's (output, {name: grad}) per model, trained side by side on the same data
    and seeds."""
    dtype = next(models[0].parameters()).dtype
    if optimizer == "sgd":
        opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in models]
    else:
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models]
    data = torch.Generator(device="cuda").manual_seed(1)
    history = []
    for step in range(steps):
        x = torch.randn(batch, 3, 32, 32, device="cuda", dtype=dtype, generator=data)
        got = []
        for model, opt in zip(models, opts):
            torch.manual_seed(100 + step)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                out = model(x)
            out.float().pow(2).mean().backward()
            got.append((out.detach().float(),
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
            opt.step()
        history.append(got)
    torch.cuda.synchronize()
    return history


def _worst(got, ref):
    errors = {"output": relative_error(got[0], ref[0])}
    errors.update({n: relative_error(got[1][n], ref[1][n]) for n in ref[1]})
    return max(errors.items(), key=lambda item: item[1])


def _assert_close(history, tol):
    for step, (ref, got) in enumerate(history):
        name, err = _worst(got, ref)
        assert err < tol, f"step {step}: {name} off by {err:.3e}"


def _captured(model):
    stacks = [m for m in model.modules() if isinstance(m, pareprop.ReversibleStack)]
    return stacks and all(s.cuda_graph_status.startswith("captured") for s in stacks)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("engine", pareprop.ENGINES)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_graphed_engines_match_eager_autograd(family, engine, dtype, tol):
    make = FAMILIES[family]
    reference, graphed = make(dtype=dtype), make(engine, dtype=dtype)
    pareprop.set_engine(graphed, engine, cuda_graphs=True)
    _assert_close(_train([reference, graphed]), tol)
    assert _captured(graphed)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("engine", ["reversible", "pareprop"])
def test_graphed_dropout_matches_graphed_autograd(family, engine):
    make = FAMILIES[family]
    reference = make("autograd", DROP, torch.float64)
    graphed = make(engine, DROP, torch.float64)
    pareprop.set_engine(reference, "autograd", cuda_graphs=True)
    pareprop.set_engine(graphed, engine, cuda_graphs=True)
    _assert_close(_train([reference, graphed]), 1e-10)
    assert _captured(graphed)


def test_replays_draw_new_masks():
    model = _vit("pareprop", DROP)
    pareprop.set_engine(model, "pareprop", cuda_graphs=True)
    x = torch.randn(8, 3, 32, 32, device="cuda")
    outs = []
    for _ in range(STEPS):  # no optimizer step: the same weights each time
        out = model(x)
        out.sum().backward()
        outs.append(out.detach())
    assert _captured(model)
    assert relative_error(outs[-1], outs[-2]) > 1e-3  # two replays, two sets of masks


@pytest.mark.parametrize("engine", ["reversible", "pareprop"])
def test_bf16_autocast_with_adamw_matches_eager(engine):
    reference, graphed = _vit(engine), _vit(engine)
    pareprop.set_engine(reference, engine, fallback=False)
    pareprop.set_engine(graphed, engine, cuda_graphs=True)
    # the same kernels in the same order: only the autocast weight cache (off in a capture)
    # and the order of additions in the copies differ
    _assert_close(_train([reference, graphed], amp=True, optimizer="adamw"), 1e-2)
    assert _captured(graphed)


@pytest.mark.parametrize("engine", ["reversible", "pareprop"])
def test_a_replayed_step_runs_no_engine_code(engine, monkeypatch):
    model = _vit(engine)
    pareprop.set_engine(model, engine, cuda_graphs=True)
    _train([model], steps=graphs.WARMUP_STEPS + 1)
    assert _captured(model)
    calls = []
    recover = backward._recover
    monkeypatch.setattr(backward, "_recover", lambda *a: calls.append(1) or recover(*a))
    _train([model], steps=2)
    assert calls == []  # the backward graph replayed: nothing was rebuilt on the host
    pareprop.set_engine(model, engine, cuda_graphs=False)
    _train([model], steps=1)
    assert calls  # the control: an eager step does rebuild on the host


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5),
                    reason="compile_blocks needs torch >= 2.5")
def test_compiled_blocks_under_graphs_compile_nothing_in_the_capture():
    # NOTE [ Autocast's weight cache under CUDA graphs ]: warm-up and capture run with the
    # same weight-cache state, so Inductor compiles in warm-up only; a compile inside the
    # capture would fail it (or be counted here).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        reference = _vit("pareprop")
        graphed = pareprop.compile_blocks(_vit("pareprop"))
        pareprop.set_engine(reference, "pareprop", fallback=False)
        pareprop.set_engine(graphed, "pareprop", cuda_graphs=True)
        compiled = []
        history = []
        for _ in range(STEPS):  # one step at a time, to count what each compiled
            history += _train([reference, graphed], steps=1, amp=True)
            compiled.append(counters["stats"]["unique_graphs"])
        assert _captured(graphed)
        assert compiled[0] > 0 and len(set(compiled[graphs.WARMUP_STEPS - 1:])) == 1, compiled
        _assert_close(history, 2e-2)  # compiled bf16 kernels round otherwise than eager
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("engine", pareprop.ENGINES)
def test_ddp_around_a_graphed_model_matches_eager_autograd(engine, tmp_path):
    # NOTE [ Parameter aliases in a capture ]: DDP's reducer holds every parameter's
    # AccumulateGrad node, made on the default stream; the capture differentiates with
    # respect to aliases, and DDP reduces the gradients each replay hands back.
    import torch.distributed as tdist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from pareprop.distributed import wrap_ddp

    tdist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0,
                             world_size=1)
    try:
        reference = _vit(dtype=torch.float64)
        model = _vit(engine, dtype=torch.float64)
        pareprop.set_engine(model, engine, cuda_graphs=True)
        net = wrap_ddp(model)
        reduced = []

        def counted(state, bucket):
            reduced.append(len(bucket.parameters()))
            return allreduce_hook(state, bucket)

        net.register_comm_hook(None, counted)
        opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)
                for m in (reference, model)]
        data = torch.Generator(device="cuda").manual_seed(1)
        for step in range(STEPS):
            x = torch.randn(8, 3, 32, 32, device="cuda", dtype=torch.float64, generator=data)
            reduced.clear()
            for run, opt in zip((reference, net), opts):
                opt.zero_grad(set_to_none=True)
                run(x).pow(2).mean().backward()
            assert sum(reduced) == len(list(model.parameters())), f"step {step}: {reduced}"
            for (name, p), r in zip(model.named_parameters(), reference.parameters()):
                err = relative_error(p.grad, r.grad)
                assert err < 1e-10, f"step {step}: {name} off by {err:.3e}"
            for opt in opts:
                opt.step()
        assert _captured(model)
    finally:
        tdist.destroy_process_group()
