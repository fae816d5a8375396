"""The training loop's steps: a micro-batch, an optimizer step, an epoch, an evaluation.

Ordinary supervised training: cross-entropy with label smoothing under the run's autocast,
gradient accumulation (the processes synchronise on a step's last micro-batch only), gradient
clipping, the fp16 scaler, and the schedule advanced once per optimizer step. A non-finite
loss or gradient norm stops the run before the optimizer step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F

from pareprop import distributed as dist_lib
from pareprop.trainer.report import peak_mem_mb


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the run stopped before the optimizer step."""


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
    ``coupling``) and advances its ``step`` (and ``step_losses``).
    """

    def _check_finite(self, value: torch.Tensor, what: str = "loss") -> None:
        ok = torch.isfinite(value.detach()).to(torch.float32).reshape(1)
        ok = dist_lib.all_reduce(ok, self.dist, op="min")
        if ok.item() < 1:
            raise NonFiniteLossError(
                f"{what} is {value.item()} at epoch {self.epoch + 1}, step {self.step + 1}: "
                f"stopped before the optimizer step; {self._kept()}. Lower --lr, raise "
                f"--warmup-epochs, keep --clip-grad{_precision_advice(self.cfg.amp)}"
            )

    def _forward_backward(
        self, i: int, x: torch.Tensor, y: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, bool]:
        """Micro-batch ``i``: forward, loss and backward; (loss, logits, ends a step)."""
        accum = self.cfg.grad_accum
        in_group = min(accum, self.micro_per_epoch - (i // accum) * accum)
        last_micro = (i + 1) % accum == 0 or i + 1 == self.micro_per_epoch
        # Micro-batches before the last one of a step only accumulate locally.
        sync = nullcontext() if last_micro else dist_lib.no_sync(self.net)
        with sync:
            with self._autocast():
                logits = self.net(x)
                loss = F.cross_entropy(
                    logits.float(), y, label_smoothing=self.cfg.label_smoothing
                )
            self._check_finite(loss)
            self.scaler.scale(loss / in_group).backward()
        return loss, logits, last_micro

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
                self._check_finite(norm, "the gradient norm")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.scheduler.step_update(num_updates=self.step)
        if self.coupling is not None:
            self.coupling.step()

    def train_epoch(self) -> Dict[str, Any]:
        from tqdm import tqdm

        cfg = self.cfg
        self.net.train()
        self.sampler.set_epoch(self.epoch)
        sums = torch.zeros(3, dtype=torch.float64)  # loss * n, correct, n
        t0, seen = time.perf_counter(), 0
        bar = tqdm(
            self.train_loader,
            desc=f"epoch {self.epoch + 1}/{cfg.epochs}",
            disable=not cfg.progress or self.dist.rank != 0,
            dynamic_ncols=True,
            leave=True,
        )
        self.optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(bar):
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                break
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            loss, logits, last_micro = self._forward_backward(i, x, y)
            n = y.shape[0]
            sums += torch.tensor(
                [loss.item() * n, (logits.argmax(-1) == y).sum().item(), n],
                dtype=torch.float64,
            )
            seen += n
            if not last_micro:
                continue
            self._optimizer_step()
            self.step_losses.append(loss.item())
            rate = seen * self.dist.world_size / (time.perf_counter() - t0)
            bar.set_postfix(
                loss=f"{sums[0].item() / sums[2].item():.4f}",
                lr=f"{self.optimizer.param_groups[0]['lr']:.2e}",
                samples_s=f"{rate:.0f}",
                mem_mb=f"{peak_mem_mb(self.device):.0f}",
                refresh=False,
            )
        bar.close()
        sums = dist_lib.all_reduce(sums, self.dist)
        elapsed = time.perf_counter() - t0
        return {
            "train_loss": sums[0].item() / max(sums[2].item(), 1),
            "train_acc": sums[1].item() / max(sums[2].item(), 1),
            "lr": self.optimizer.param_groups[0]["lr"],
            "time_s": elapsed,
            "samples_per_s": sums[2].item() / elapsed,
        }

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Loss (plain cross-entropy) and accuracy on the validation set, over all processes."""
        self.net.eval()
        sums = torch.zeros(3, dtype=torch.float64)
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
            sums += torch.tensor(
                [loss.item(), (logits.argmax(-1) == y).sum().item(), y.shape[0]],
                dtype=torch.float64,
            )
        sums = dist_lib.all_reduce(sums, self.dist)
        return {
            "val_loss": sums[0].item() / sums[2].item(),
            "val_acc": sums[1].item() / sums[2].item(),
        }

