"""torchvision's video MViTs as baselines: ``mvit_v1_b`` (MViT-B 16x4, the non-reversible twin
of Rev-MViT-B 16x4: 36.6M parameters, Kinetics-400 top-1 78.48 as torchvision publishes it)
and ``mvit_v2_s``, in the two modes the catalog compares reversible models with: ``plain``
(autograd) and ``checkpointed`` (every block under ``torch.utils.checkpoint``, as timm's
``set_grad_checkpointing()`` does for image models).

They are not in pareprop's registry (they are torchvision's models); the catalog builds them
by name (:data:`TORCHVISION_VIDEO_MODELS`) through :func:`create_torchvision_video`.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["TORCHVISION_VIDEO_MODELS", "TorchvisionVideo", "create_torchvision_video"]

TORCHVISION_VIDEO_MODELS = ("mvit_v1_b", "mvit_v2_s")


class TorchvisionVideo(nn.Module):
    """A torchvision video MViT with pareprop's model interface: ``example_inputs``,
    ``set_grad_checkpointing``, ``num_classes`` and a ``pretrained_cfg`` giving its clip size.

    Args:
        name: ``mvit_v1_b`` or ``mvit_v2_s``.
        num_classes: classes of its head (400: Kinetics-400).
        num_frames: frames per clip (16).
        img_size: side of the square frames (224). ``mvit_v1_b`` takes other clip sizes (its
            position embedding is rebuilt for the new grid); ``mvit_v2_s``'s relative positions
            are sized at construction for 16 x 224 x 224 only.
    """

    def __init__(self, name: str, num_classes: int = 400, num_frames: int = 16,
                 img_size: int = 224):
        super().__init__()
        from torchvision.models import video  # heavy, and only baselines need it

        if name not in TORCHVISION_VIDEO_MODELS:
            raise ValueError(f"expected one of {TORCHVISION_VIDEO_MODELS}, got {name!r}")
        self.net = getattr(video, name)(num_classes=num_classes)
        self.name = name
        self.num_classes = num_classes
        self.clip_size = (num_frames, img_size, img_size)
        if self.clip_size != (16, 224, 224):
            self._resize(video)
        self.grad_checkpointing = False
        self.in_chans = 3
        self.pretrained_cfg: Dict[str, Any] = {
            "input_size": (3, *self.clip_size),
            "num_classes": num_classes,
            "mean": (0.45, 0.45, 0.45),
            "std": (0.225, 0.225, 0.225),
            "frame_stride": 4,
            "classifier": "net.head",
        }

    def _resize(self, video: Any) -> None:
        if self.name != "mvit_v1_b":
            raise ValueError(
                f"{self.name} has relative position tables sized for 16 x 224 x 224 clips; only "
                "mvit_v1_b takes other num_frames and img_size"
            )
        enc = self.net.pos_encoding
        conv = self.net.conv_proj
        # The patch embedding's output grid: (16, 224, 224) -> (8, 56, 56); 3 frames -> 2.
        T, H, W = (
            (s + 2 * p - k) // st + 1
            for s, p, k, st in zip(self.clip_size, conv.padding, conv.kernel_size, conv.stride)
        )
        self.net.pos_encoding = video.mvit.PositionalEncoding(
            enc.spatial_pos.shape[-1], (H, W), T, rel_pos_embed=False
        )

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Run every block under ``torch.utils.checkpoint`` (non-reentrant)."""
        self.grad_checkpointing = bool(enable)

    def example_inputs(
        self, batch_size: int = 2, device: Any = None, dtype: torch.dtype = torch.float32
    ) -> Tuple[torch.Tensor]:
        """A random batch of clips ``(B, 3, T, H, W)``."""
        return (torch.randn(batch_size, 3, *self.clip_size, device=device, dtype=dtype),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchvision's MViT.forward, with each block optionally checkpointed.
        net = self.net
        x = net.conv_proj(x).flatten(2).transpose(1, 2)  # (B, T'H'W', C)
        x = net.pos_encoding(x)  # (B, 1 + T'H'W', C): class token prepended
        thw = (net.pos_encoding.temporal_size,) + tuple(net.pos_encoding.spatial_size)
        for block in net.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x, thw = checkpoint(block, x, thw, use_reentrant=False)
            else:
                x, thw = block(x, thw)
        x = net.norm(x)
        return net.head(x[:, 0])


def create_torchvision_video(name: str, **kwargs: Any) -> TorchvisionVideo:
    """Build torchvision's ``name`` (``mvit_v1_b``, ``mvit_v2_s``) as a :class:`TorchvisionVideo`;
    ``kwargs``: ``num_classes``, ``num_frames``, ``img_size``."""
    return TorchvisionVideo(name, **kwargs)
