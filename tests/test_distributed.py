"""Multi-process training on the CPU (gloo): DDP with every engine is exact, gradient
accumulation is exact, torchrun resumes, and wrappings that cannot work are refused."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as tdist

import pareprop
from _two_processes import on_two_processes
from pareprop.distributed import check_wrapping, wrap_ddp
from pareprop.engine import ENGINES

pytestmark = [  # slow: torchrun and spawned process pairs (README, Development)
    pytest.mark.slow,
    pytest.mark.skipif(not tdist.is_available(), reason="no torch.distributed"),
]

MODEL = "rev_vit_tiny_patch4_32"
# Three blocks: an odd depth, where PaReprop's final step is easiest to get wrong.
TINY = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=3, num_heads=2)
BATCH, LR = 8, 0.5
_CAN_COMPILE = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


def _model(engine):
    torch.manual_seed(0)
    return pareprop.create_model(MODEL, engine=engine, **TINY).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 1, 8, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 10, (BATCH,), generator=g)


def _step(model, net, batches, sync_all=False):
    """One SGD step (SGD, not Adam: Adam's first step hides gradient scale errors)."""
    from pareprop.distributed import no_sync

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        ctx = no_sync(net) if not (last or sync_all) else torch.enable_grad()
        with ctx:
            loss = torch.nn.functional.cross_entropy(net(x), y) / len(batches)
            loss.backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _on_rank(rank, world):
    x, y = _batch()
    # This process's half of the global batch (see NOTE [ Batch size ] in trainer/setup.py).
    xs, ys = x[rank::world], y[rank::world]
    results = {}
    for engine in ENGINES:
        model = _model(engine).train()
        results[(engine, 1)] = _step(model, wrap_ddp(model), [(xs, ys)])
        model = _model(engine).train()
        half = len(ys) // 2
        micro = [(xs[:half], ys[:half]), (xs[half:], ys[half:])]
        results[(engine, 2)] = _step(model, wrap_ddp(model), micro)
    for engine in ENGINES[1:]:  # chunked branches (pareprop.set_chunking)
        model = pareprop.set_chunking(_model(engine).train(), chunks=2)
        results[(engine, "chunked")] = _step(model, wrap_ddp(model), [(xs, ys)])
    model = _model("pareprop").train()
    results[("pareprop", "static")] = _step(
        model, wrap_ddp(model, static_graph=True), [(xs, ys)]
    )
    if _CAN_COMPILE:  # compiled F and G (pareprop.compile_blocks) under DDP
        from pareprop.engine.compile import compile_blocks

        model = compile_blocks(_model("reversible").train())
        results[("reversible", "compiled")] = _step(model, wrap_ddp(model), [(xs, ys)])
    return results


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return on_two_processes(_on_rank, tmp_path_factory.mktemp("ddp"))


def _reference():
    x, y = _batch()
    model = _model("autograd").train()
    return _step(model, model, [(x, y)])


def _assert_same(params, ref, tol=1e-12):
    before = {n: p for n, p in _model("autograd").named_parameters()}
    for name, p in ref.items():
        moved = (ref[name] - before[name]).norm().item()
        err = (params[name] - p).norm().item() / max(moved, 1e-30)
        assert err < tol, f"{name}: relative error {err:.2e} of the update"


@pytest.mark.parametrize("engine", ENGINES)
def test_two_processes_on_half_batches_equal_one_on_the_whole(ddp_results, engine):
    ref = _reference()
    for rank in range(2):
        _assert_same(ddp_results[rank][(engine, 1)], ref)


@pytest.mark.parametrize("engine", ENGINES)
def test_gradient_accumulation_over_two_micro_batches(ddp_results, engine):
    ref = _reference()
    for rank in range(2):
        _assert_same(ddp_results[rank][(engine, 2)], ref)


@pytest.mark.skipif(not _CAN_COMPILE, reason="compile_blocks needs torch >= 2.5")
def test_compiled_blocks_under_ddp_equal_one_process(ddp_results):
    ref = _reference()
    for rank in range(2):
        _assert_same(ddp_results[rank][("reversible", "compiled")], ref, tol=1e-10)


@pytest.mark.parametrize("engine", ENGINES[1:])
def test_chunked_branches_under_ddp_equal_one_process(ddp_results, engine):
    ref = _reference()
    for rank in range(2):
        _assert_same(ddp_results[rank][(engine, "chunked")], ref)


def test_static_graph_is_valid_with_pareprop(ddp_results):
    _assert_same(ddp_results[0][("pareprop", "static")], _reference())


def test_wrapping_inside_a_stack_is_refused(tmp_path):
    model = _model("reversible")
    stack = next(m for m in model.modules() if isinstance(m, pareprop.ReversibleStack))
    tdist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1
    )
    try:
        stack.blocks[1] = torch.nn.parallel.DistributedDataParallel(stack.blocks[1])
        with pytest.raises(ValueError, match="inside the ReversibleStack"):
            check_wrapping(model)
        with pytest.raises(ValueError, match="inside the ReversibleStack"):
            wrap_ddp(model)
        plain = _model("reversible")
        with pytest.raises(ValueError, match="find_unused_parameters=True is not needed"):
            wrap_ddp(plain, find_unused_parameters=True)
        with pytest.raises(ValueError, match="already wrapped"):
            wrap_ddp(wrap_ddp(plain))
    finally:
        tdist.destroy_process_group()


def _torchrun(args, cwd):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "pareprop",
        "train",
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_torchrun_resume_continues_from_the_saved_step(tmp_path):
    out = tmp_path / "run"
    common = [
        "--model",
        MODEL,
        *[f"--model-arg={k}={v}" for k, v in TINY.items()],
        "--epochs",
        "2",
        "--batch-size",
        "256",
        "--out",
        str(out),
        "--no-progress",
    ]
    first = _torchrun(common + ["--stop-after-epochs", "1"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 process(es)" in first.stderr
    second = _torchrun(common + ["--resume", str(out / "last")], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["type"] == "epoch"]
    # rank 0 alone writes: one record per epoch, and the second starts where the first stopped
    assert [r["epoch"] for r in epochs] == [1, 2]
    assert epochs[1]["step"] == 2 * epochs[0]["step"] == 12
    assert "epochs 2-2" in second.stderr


def test_init_without_cuda_joins_with_gloo(monkeypatch):
    # --device cuda on a machine without CUDA: join with gloo, so that the trainer can say
    # what is wrong, instead of failing inside torch.cuda.set_device.
    from pareprop import distributed

    joined = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(tdist, "init_process_group", lambda backend: joined.update(b=backend))
    monkeypatch.setattr(tdist, "get_rank", lambda: 0)
    monkeypatch.setattr(tdist, "get_world_size", lambda: 2)
    info = distributed.init("cuda")
    assert joined == {"b": "gloo"} and info.backend == "gloo"


def test_fsdp_sharding_is_what_the_engine_asks_for():
    # The engine calls a sharded stack's sharding through the BlockSharding protocol alone.
    from pareprop.distributed.fsdp import _BlockSharding
    from pareprop.engine import BlockSharding

    assert isinstance(_BlockSharding([], reshard_after_forward=True), BlockSharding)
    assert not isinstance(object(), BlockSharding)
