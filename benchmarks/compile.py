"""Step time of every engine, eager and with compiled F and G; compile time against depth.

    python benchmarks/compile.py [--depth 4] [--embed-dim 192] [--batch-size 16] [--img-size 32]
        [--rounds 5] [--compile-depths 2 12] [--profile]

Rev-ViT (patch 4, 32 px, CIFAR-like) full training steps (forward, cross-entropy, backward,
SGD-free: gradients only). Configurations take turns, one step each per round, so machine load
falls on all of them alike; medians over the rounds. Compile time: a fresh Dynamo cache and no
inductor FX-graph cache, the first step (forward + backward) of a reversible model at each
depth in --compile-depths, minus the median eager step at that depth. --profile: where a
step's time goes, per engine, eager and compiled (torch.profiler, medians of --rounds steps):
forward, the engine's recomputation (``pareprop::recover``), its gradient computation
(``pareprop::grads``) and the rest of backward, and the operators that take the most time.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

import pareprop


def _model(args: argparse.Namespace, depth: int, engine: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return pareprop.create_model(
        "rev_vit_tiny_patch4_32", img_size=args.img_size, embed_dim=args.embed_dim,
        depth=depth, num_heads=3, num_classes=10, drop_path_rate=0.1, engine=engine,
    )


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    start = time.perf_counter()
    F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def step_times(args: argparse.Namespace) -> Dict[str, float]:
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    y = torch.randint(0, 10, (args.batch_size,))
    models = {}
    for engine in pareprop.ENGINES:
        eager = _model(args, args.depth, engine)
        models[f"{engine} eager"] = eager
        models[f"{engine} compiled"] = pareprop.compile_blocks(copy.deepcopy(eager))
    for model in models.values():  # warm-up: compiles, and first-touch allocations
        model.train()
        _step(model, x, y)
        _step(model, x, y)
    times: Dict[str, List[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            times[name].append(_step(model, x, y))
    return {name: statistics.median(t) for name, t in times.items()}


def compile_times(args: argparse.Namespace) -> Dict[int, float]:
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    y = torch.randint(0, 10, (args.batch_size,))
    result = {}
    for depth in args.compile_depths:
        eager = _model(args, depth, "reversible").train()
        eager_step = statistics.median(_step(eager, x, y) for _ in range(3))
        torch._dynamo.reset()
        compiled = pareprop.compile_blocks(_model(args, depth, "reversible").train())
        result[depth] = _step(compiled, x, y) - eager_step
    return result


def profile(args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    y = torch.randint(0, 10, (args.batch_size,))
    print("\nwhere a step's time goes (ms, medians of the rounds)")
    print(f"  {'config':22s} {'step':>8} {'forward':>8} {'recover':>8} {'grads':>8} "
          f"{'backward rest':>14}")
    tops = {}
    for engine in ("autograd", "reversible"):
        for mode in ("eager", "compiled"):
            model = _model(args, args.depth, engine).train()
            if mode == "compiled":
                model = pareprop.compile_blocks(model)
            _step(model, x, y)
            _step(model, x, y)
            rows = []
            for _ in range(args.rounds):
                with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                    with torch.profiler.record_function("bench::forward"):
                        loss = F.cross_entropy(model(x), y)
                    with torch.profiler.record_function("bench::backward"):
                        loss.backward()
                model.zero_grad(set_to_none=True)
                total = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
                rows.append([total.get(k, 0.0) for k in (
                    "bench::forward", "pareprop::recover", "pareprop::grads", "bench::backward")])
                tops[f"{engine} {mode}"] = prof.key_averages()
            fwd, rec, grd, bwd = (statistics.median(r[i] for r in rows) for i in range(4))
            print(f"  {engine + ' ' + mode:22s} {fwd + bwd:8.1f} {fwd:8.1f} {rec:8.1f} "
                  f"{grd:8.1f} {bwd - rec - grd:14.1f}")
    for name in ("autograd compiled", "reversible compiled"):
        print(f"\ntop operators by self CPU time, {name} (last profiled step)")
        print(tops[name].table(sort_by="self_cpu_time_total", row_limit=8,
                               max_name_column_width=48))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--embed-dim", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compile-depths", type=int, nargs="+", default=[2, 12])
    p.add_argument("--profile", action="store_true", help="only the profile of where time goes")
    args = p.parse_args()
    if args.profile:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {vars(args)}")
        profile(args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {vars(args)}")
    times = step_times(args)
    base = times["autograd eager"]
    print("\nmedian step time (s), ratio to eager autograd")
    for name, t in times.items():
        print(f"  {name:22s} {t:8.4f}  {t / base:5.2f}x")
    print(f"target: compiled reversible / eager autograd = "
          f"{times['reversible compiled'] / base:.2f} (<= 1 meets it)")
    comp = compile_times(args)
    print("\ncompile time of a reversible model's first step (s)")
    for depth, t in comp.items():
        print(f"  depth {depth:3d}  {t:7.2f}")
    first, last = args.compile_depths[0], args.compile_depths[-1]
    print(f"ratio depth {last} / depth {first}: {comp[last] / comp[first]:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
