"""Two gloo processes on this machine, for the distributed tests (DDP and FSDP2 on the CPU).

``on_two_processes(run, tmp)`` spawns two processes; process ``rank`` joins a gloo group through
a file in ``tmp``, calls ``run(rank, world, *args)`` and saves what it returns, and the list of
both results (rank 0 first) comes back to the test. ``run`` must be a module-level function of
the test module, so that the spawned process can import it.
"""

from __future__ import annotations

import datetime
import os
import pathlib
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank: int, world: int, tmp: str, run: Callable[..., Any], args: tuple,
            timeout_s: Optional[float]) -> None:
    torch.set_num_threads(1)  # two processes on two cores
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    tdist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}",
                             rank=rank, world_size=world, **kw)
    try:
        torch.save(run(rank, world, *args), os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        tdist.destroy_process_group()


def on_two_processes(run: Callable[..., Any], tmp: pathlib.Path, *args: Any,
                     timeout_s: Optional[float] = None, weights_only: bool = True) -> List[Any]:
    """What ``run(rank, WORLD, *args)`` returned on each of two gloo processes.

    ``timeout_s`` bounds a collective's wait, so that a process left waiting for a peer that
    stopped fails in seconds instead of gloo's default 30 minutes. ``weights_only=False``
    where a result holds more than tensors, containers and numbers (the test's own files).
    """
    mp.spawn(_worker, args=(WORLD, str(tmp), run, args, timeout_s), nprocs=WORLD, join=True)
    return [torch.load(pathlib.Path(tmp) / f"rank{r}.pt", weights_only=weights_only)
            for r in range(WORLD)]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a tensor FSDP2 shards (a DTensor); any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def sgd_step(model: torch.nn.Module, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
             lr: float = 0.5) -> dict:
    """One SGD step of ``net`` (``model`` itself or wrapped) on a classification batch: every
    parameter of ``model`` after it, whole."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    return {n: full_tensor(p).detach().clone() for n, p in model.named_parameters()}
