"""The training loop's steps: a micro-batch, an optimizer step, an epoch, an evaluation.

Ordinary supervised training: cross-entropy with label smoothing under the run's autocast,
gradient accumulation (the processes synchronise on a step's last micro-batch only), gradient
clipping, the fp16 scaler, and the schedule advanced once per optimizer step. A non-finite
loss or gradient norm stops the run before the optimizer step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from pareprop import distributed as dist_lib
from pareprop.trainer.report import peak_mem_mb


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) became NaN or infinite; the run stopped before saving."""


# NOTE [ Reading the device once per log interval ]
#     A ``.item()`` is the host waiting for the device: one per micro-batch (the loss, the
#     correct count, the finiteness check) drains the queue of launched work that CUDA graphs
#     and PaReprop's overlapped backward depend on, every micro-batch. So the running numbers
#     stay on the device: the sums of loss x n and of correct answers (float64, added in the
#     order a read per micro-batch would add them: every metric is the same, bit for bit),
#     each step's loss, and the first non-finite loss or gradient norm with its step
#     (``_Fault``). The host reads them all in one transfer every ``--log-interval`` optimizer
#     steps and at the end of the epoch. A non-finite value is found there, up to one interval
#     late: the run stops naming the step it happened at, its weights unsaved (a checkpoint is
#     written only after the epoch's read), and the last good checkpoint is kept.


class _Fault:
    """The first non-finite value of an epoch, kept on the device: (what, value, step)."""

    WHAT = ("loss", "the gradient norm")  # recorded as 1, 2 (0: none)

    def __init__(self, device: torch.device):
        self.found = torch.zeros((), dtype=torch.bool, device=device)
        self.record = torch.zeros(3, dtype=torch.float64, device=device)

    def note(self, value: torch.Tensor, what: str, step: int) -> None:
        value = value.detach().to(torch.float64).reshape(())
        first = ~torch.isfinite(value) & ~self.found  # no host read: masks, not branches
        code = float(self.WHAT.index(what) + 1)
        fresh = torch.stack([value.new_full((), code), value, value.new_full((), float(step))])
        self.record = torch.where(first, fresh, self.record)
        self.found = self.found | first


def _precision_advice(amp: str) -> str:
    """The end of a non-finite stop's advice: a wider type than the run's ``--amp``."""
    if amp == "fp16":
        return ", or train with --amp bf16 (float32's range) or --amp none instead of fp16"
    if amp == "bf16":
        return ", or train with --amp none (float32) instead of bf16"
    return ""


class TrainLoop:
    """One epoch of training and one evaluation of the validation set.

    Part of :class:`~pareprop.trainer.Trainer`; uses what its set-up built (``net``,
    ``model``, ``sampler`` and the loaders, ``optimizer``, ``scheduler``, ``scaler``,
    ``coupling``) and advances its ``step`` (and ``step_losses``). The host reads the device
    once per ``cfg.log_interval`` steps (NOTE [ Reading the device once per log interval ]).
    """

    def _raise_non_finite(self, found: str) -> None:
        raise NonFiniteLossError(
            f"{found}: stopped before the weights were saved; {self._kept()}. Lower --lr, raise "
            f"--warmup-epochs, keep --clip-grad{_precision_advice(self.cfg.amp)}"
        )

    def _backward(
        self, i: int, forward: Callable[[], Tuple[torch.Tensor, Any]]
    ) -> Tuple[torch.Tensor, Any, bool]:
        """Micro-batch ``i``: ``forward()`` (the loss and what else it returns), then the
        backward of its share of the step; (loss, what else, ends a step)."""
        accum = self.cfg.grad_accum
        in_group = min(accum, self.micro_per_epoch - (i // accum) * accum)
        last_micro = (i + 1) % accum == 0 or i + 1 == self.micro_per_epoch
        # Micro-batches before the last one of a step only accumulate locally.
        sync = nullcontext() if last_micro else dist_lib.no_sync(self.net)
        with sync:
            loss, out = forward()
            self._fault.note(loss, "loss", self.step)
            self.scaler.scale(loss / in_group).backward()
        return loss, out, last_micro

    def _forward_backward(
        self, i: int, x: torch.Tensor, y: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, bool]:
        """Micro-batch ``i``: forward, loss and backward; (loss, logits, ends a step)."""

        def forward() -> Tuple[torch.Tensor, torch.Tensor]:
            with self._autocast():
                logits = self.net(x)
                loss = F.cross_entropy(
                    logits.float(), y, label_smoothing=self.cfg.label_smoothing
                )
            return loss, logits

        return self._backward(i, forward)

    def _optimizer_step(self) -> None:
        """Clip, step, and advance the schedule by one optimizer step."""
        cfg = self.cfg
        if cfg.clip_grad is not None and cfg.clip_grad > 0:
            self.scaler.unscale_(self.optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
            if cfg.fsdp:  # the norm of sharded gradients is a (replicated) DTensor
                norm = norm.full_tensor()
            # With fp16 the scaler skips a step whose gradients overflowed; otherwise a
            # non-finite gradient (finite loss) would turn every weight into NaN.
            if not self.scaler.is_enabled():
                self._fault.note(norm, "the gradient norm", self.step)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.scheduler.step_update(num_updates=self.step)
        if self.coupling is not None:
            self.coupling.step()

    def _read(self, sums: torch.Tensor, losses: List[torch.Tensor]) -> List[float]:
        """The host's one read: ``sums``, then each pending step loss; stops on a fault."""
        found = self._fault.found.to(torch.float64).reshape(1)
        found = dist_lib.all_reduce(found, self.dist)  # every process stops together
        parts = [sums.reshape(-1), found, self._fault.record, *(t.reshape(1) for t in losses)]
        values = torch.cat([t.detach().to(sums.device, torch.float64) for t in parts]).tolist()
        n = sums.numel()
        self.step_losses.extend(values[n + 4:])
        losses.clear()
        if values[n] > 0:
            code, value, step = values[n + 1 : n + 4]
            if code == 0:  # found by another process
                self._raise_non_finite(f"another process found a non-finite loss or gradient "
                                       f"norm in epoch {self.epoch + 1}, by step {self.step}")
            what = _Fault.WHAT[int(code) - 1]
            self._raise_non_finite(f"{what} is {value} at epoch {self.epoch + 1}, "
                                   f"step {int(step) + 1}")
        return values[:n]

    # The progress bar's samples/s: whole samples for a classifier, tenths of images for a
    # detector (slow enough for the tenths to matter).
    RATE_FORMAT = ".0f"

    def _micro_step(
        self, i: int, batch: Any
    ) -> Tuple[torch.Tensor, int, torch.Tensor, bool]:
        """Micro-batch ``i`` of the epoch, forward and backward: (loss, samples, the float64
        row added to the epoch's device sums, ends a step). Here the row is loss x n and the
        correct answers."""
        x, y = batch
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        loss, logits, last_micro = self._forward_backward(i, x, y)
        n = y.shape[0]
        correct = (logits.argmax(-1) == y).sum()
        return loss, n, torch.stack([loss.detach().double() * n, correct.double()]), last_micro

    def _zero_sums(self) -> torch.Tensor:
        """The epoch's device sums when no micro-batch ran."""
        return torch.zeros(2, dtype=torch.float64, device=self.device)

    def _train_record(self, sums: List[float], count: float) -> Dict[str, Any]:
        """The epoch's own numbers from its summed rows over ``count`` samples (at least 1)."""
        loss_sum, correct = sums
        return {"train_loss": loss_sum / count, "train_acc": correct / count}

    def train_epoch(self) -> Dict[str, Any]:
        """One epoch of micro-batches (:meth:`_micro_step`) and optimizer steps, the running
        numbers read every log interval; the epoch's record."""
        from tqdm import tqdm

        cfg = self.cfg
        self.net.train()
        self.sampler.set_epoch(self.epoch)
        # On the device, read every log interval (NOTE [ Reading the device once per log
        # interval ]): the micro-steps' rows summed in float64, sized at the first batch;
        # the samples counted here.
        sums: Optional[torch.Tensor] = None
        self._fault = _Fault(self.device)
        losses: List[torch.Tensor] = []  # each step's loss, until the next read
        t0, seen = time.perf_counter(), 0
        bar = tqdm(
            self.train_loader,
            desc=f"epoch {self.epoch + 1}/{cfg.epochs}",
            disable=not cfg.progress or self.dist.rank != 0,
            dynamic_ncols=True,
            leave=True,
        )
        self.optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(bar):
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                break
            loss, n, row, last_micro = self._micro_step(i, batch)
            if sums is None:
                sums = torch.zeros_like(row)
            sums += row
            seen += n
            if not last_micro:
                continue
            self._optimizer_step()
            losses.append(loss.detach())
            if self.step % cfg.log_interval:
                continue
            loss_sum = self._read(sums, losses)[0]
            rate = seen * self.dist.world_size / (time.perf_counter() - t0)
            running = {"loss": loss_sum / seen, "lr": self.optimizer.param_groups[0]["lr"],
                       "samples_per_s": rate, "peak_mem_mb": peak_mem_mb(self.device)}
            self._write_scalars("train", running)
            bar.set_postfix(
                loss=f"{running['loss']:.4f}", lr=f"{running['lr']:.2e}",
                samples_s=f"{rate:{self.RATE_FORMAT}}", mem_mb=f"{running['peak_mem_mb']:.0f}",
                refresh=False,
            )
        bar.close()
        if sums is None:  # no batch ran (max_steps reached)
            sums = self._zero_sums()
        # The epoch's totals over every process, read with the rest in one transfer.
        totals = torch.cat([sums, sums.new_full((1,), float(seen))])
        values = self._read(dist_lib.all_reduce(totals, self.dist), losses)
        count = values[-1]
        elapsed = time.perf_counter() - t0
        record = self._train_record(values[:-1], max(count, 1))
        record.update({"lr": self.optimizer.param_groups[0]["lr"], "time_s": elapsed,
                       "samples_per_s": count / elapsed})
        return record

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Loss (plain cross-entropy) and accuracy on the validation set, over all processes."""
        self.net.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss, correct
        seen = 0
        batches = list(self.val_loader) if self.cfg.fsdp else self.val_loader
        if self.cfg.fsdp:
            # Every forward of a sharded model all-gathers, so every process must run the same
            # number of them: one whose shard has fewer batches runs extra, uncounted ones.
            most = dist_lib.all_reduce(torch.tensor([float(len(batches))]), self.dist, "max")
            for _ in range(int(most.item()) - len(batches)):
                with self._autocast():
                    self.model(batches[0][0][:1].to(self.device))
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            with self._autocast():
                logits = self.model(x)  # the bare model: DDP needs no sync in evaluation
            loss = F.cross_entropy(logits.float(), y, reduction="sum")
            correct = (logits.argmax(-1) == y).sum()
            sums += torch.stack([loss.double(), correct.double()])  # read once, at the end
            seen += y.shape[0]
        totals = dist_lib.all_reduce(torch.cat([sums, sums.new_full((1,), float(seen))]),
                                     self.dist)
        loss_sum, correct, count = totals.tolist()
        return {"val_loss": loss_sum / count, "val_acc": correct / count}

