"""A plain (non-reversible) reference of detectron2's ViTDet and MViTv2 backbones, for tests.

It mirrors the forward of detectron2's published code at commit
02b5c4e295e990042a714712c21dc79b731e8833 (``detectron2/modeling/backbone/{vit,mvit,fpn,utils}.py``,
``detectron2/layers/{wrappers,batch_norm}.py``) step by step, residual sums and in-place
additions included, with detectron2's module and parameter names, so that a state dict made
for detectron2's ``model.backbone`` loads into it and into pareprop's backbone alike. It is
written for these tests (detectron2 cannot be installed here) and keeps only what the
configurations of projects/ViTDet and projects/MViTv2 use: no residual conv blocks, no
activation checkpointing, no ``avg`` fusion.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath, Mlp


def window_partition(x, window_size):
    B, H, W, C = x.shape
    pad_h = (window_size - H % window_size) % window_size
    pad_w = (window_size - W % window_size) % window_size
    if pad_h > 0 or pad_w > 0:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    Hp, Wp = H + pad_h, W + pad_w
    x = x.view(B, Hp // window_size, window_size, Wp // window_size, window_size, C)
    windows = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, window_size, window_size, C)
    return windows, (Hp, Wp)


def window_unpartition(windows, window_size, pad_hw, hw):
    Hp, Wp = pad_hw
    H, W = hw
    B = windows.shape[0] // (Hp * Wp // window_size // window_size)
    x = windows.view(B, Hp // window_size, Wp // window_size, window_size, window_size, -1)
    x = x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, Hp, Wp, -1)
    if Hp > H or Wp > W:
        x = x[:, :H, :W, :].contiguous()
    return x


def get_rel_pos(q_size, k_size, rel_pos):
    max_rel_dist = int(2 * max(q_size, k_size) - 1)
    if rel_pos.shape[0] != max_rel_dist:
        resized = F.interpolate(rel_pos.reshape(1, rel_pos.shape[0], -1).permute(0, 2, 1),
                                size=max_rel_dist, mode="linear")
        resized = resized.reshape(-1, max_rel_dist).permute(1, 0)
    else:
        resized = rel_pos
    q_coords = torch.arange(q_size)[:, None] * max(k_size / q_size, 1.0)
    k_coords = torch.arange(k_size)[None, :] * max(q_size / k_size, 1.0)
    relative = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
    return resized[relative.long()]


def add_decomposed_rel_pos(attn, q, rel_pos_h, rel_pos_w, q_size, k_size):
    q_h, q_w = q_size
    k_h, k_w = k_size
    Rh = get_rel_pos(q_h, k_h, rel_pos_h)
    Rw = get_rel_pos(q_w, k_w, rel_pos_w)
    B, _, dim = q.shape
    r_q = q.reshape(B, q_h, q_w, dim)
    rel_h = torch.einsum("bhwc,hkc->bhwk", r_q, Rh)
    rel_w = torch.einsum("bhwc,wkc->bhwk", r_q, Rw)
    attn = (attn.view(B, q_h, q_w, k_h, k_w) + rel_h[:, :, :, :, None]
            + rel_w[:, :, :, None, :]).view(B, q_h * q_w, k_h * k_w)
    return attn


def get_abs_pos(abs_pos, has_cls_token, hw):
    h, w = hw
    if has_cls_token:
        abs_pos = abs_pos[:, 1:]
    xy_num = abs_pos.shape[1]
    size = int(math.sqrt(xy_num))
    assert size * size == xy_num
    if size != h or size != w:
        new = F.interpolate(abs_pos.reshape(1, size, size, -1).permute(0, 3, 1, 2),
                            size=(h, w), mode="bicubic", align_corners=False)
        return new.permute(0, 2, 3, 1)
    return abs_pos.reshape(1, h, w, -1)


class PatchEmbed(nn.Module):
    def __init__(self, kernel_size, stride, padding=(0, 0), in_chans=3, embed_dim=768):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=kernel_size, stride=stride,
                              padding=padding)

    def forward(self, x):
        return self.proj(x).permute(0, 2, 3, 1)


class LayerNorm(nn.Module):  # detectron2.layers.LayerNorm: over dim 1 of (B, C, H, W)
    def __init__(self, normalized_shape, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class Conv2d(nn.Conv2d):  # detectron2.layers.Conv2d with a norm
    def __init__(self, *args, norm=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm = norm

    def forward(self, x):
        x = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                     self.groups)
        if self.norm is not None:
            x = self.norm(x)
        return x


# -- ViTDet ----------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=True, use_rel_pos=False, input_size=None):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.use_rel_pos = use_rel_pos
        if use_rel_pos:
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * input_size[0] - 1, head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * input_size[1] - 1, head_dim))

    def forward(self, x):
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H * W, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, B * self.num_heads, H * W, -1).unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if self.use_rel_pos:
            attn = add_decomposed_rel_pos(attn, q, self.rel_pos_h, self.rel_pos_w, (H, W), (H, W))
        attn = attn.softmax(dim=-1)
        x = (attn @ v).view(B, self.num_heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(
            B, H, W, -1)
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=True, drop_path=0.0,
                 norm_eps=1e-6, use_rel_pos=False, window_size=0, input_size=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias, use_rel_pos,
                              input_size if window_size == 0 else (window_size, window_size))
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio))
        self.window_size = window_size

    def forward(self, x):
        shortcut = x
        x = self.norm1(x)
        if self.window_size > 0:
            H, W = x.shape[1], x.shape[2]
            x, pad_hw = window_partition(x, self.window_size)
        x = self.attn(x)
        if self.window_size > 0:
            x = window_unpartition(x, self.window_size, pad_hw, (H, W))
        x = shortcut + self.drop_path(x)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


class ViT(nn.Module):
    def __init__(self, img_size=1024, patch_size=16, in_chans=3, embed_dim=768, depth=12,
                 num_heads=12, mlp_ratio=4.0, qkv_bias=True, drop_path_rate=0.0, norm_eps=1e-6,
                 use_abs_pos=True, use_rel_pos=False, window_size=0, window_block_indexes=(),
                 pretrain_img_size=224, pretrain_use_cls_token=True):
        super().__init__()
        self.pretrain_use_cls_token = pretrain_use_cls_token
        self.patch_embed = PatchEmbed((patch_size, patch_size), (patch_size, patch_size),
                                      in_chans=in_chans, embed_dim=embed_dim)
        if use_abs_pos:
            n = (pretrain_img_size // patch_size) ** 2
            self.pos_embed = nn.Parameter(
                torch.zeros(1, n + 1 if pretrain_use_cls_token else n, embed_dim))
        else:
            self.pos_embed = None
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth, device="cpu")]
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias, dpr[i], norm_eps, use_rel_pos,
                  window_size if i in window_block_indexes else 0,
                  (img_size // patch_size, img_size // patch_size))
            for i in range(depth))
        self.embed_dim, self.patch_size = embed_dim, patch_size

    def forward(self, x):
        x = self.patch_embed(x)
        if self.pos_embed is not None:
            x = x + get_abs_pos(self.pos_embed, self.pretrain_use_cls_token,
                                (x.shape[1], x.shape[2]))
        for blk in self.blocks:
            x = blk(x)
        return {"last_feat": x.permute(0, 3, 1, 2)}


class SimpleFeaturePyramid(nn.Module):
    def __init__(self, net, out_channels=256, scale_factors=(4.0, 2.0, 1.0, 0.5)):
        super().__init__()
        dim = net.embed_dim
        strides = [int(net.patch_size / s) for s in scale_factors]
        self.stages = []
        for scale, stride in zip(scale_factors, strides):
            out_dim = dim
            if scale == 4.0:
                layers = [nn.ConvTranspose2d(dim, dim // 2, kernel_size=2, stride=2),
                          LayerNorm(dim // 2), nn.GELU(),
                          nn.ConvTranspose2d(dim // 2, dim // 4, kernel_size=2, stride=2)]
                out_dim = dim // 4
            elif scale == 2.0:
                layers = [nn.ConvTranspose2d(dim, dim // 2, kernel_size=2, stride=2)]
                out_dim = dim // 2
            elif scale == 1.0:
                layers = []
            else:
                layers = [nn.MaxPool2d(kernel_size=2, stride=2)]
            layers += [Conv2d(out_dim, out_channels, kernel_size=1, bias=False,
                              norm=LayerNorm(out_channels)),
                       Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False,
                              norm=LayerNorm(out_channels))]
            layers = nn.Sequential(*layers)
            stage = int(math.log2(stride))
            self.add_module(f"simfp_{stage}", layers)
            self.stages.append(layers)
        self.net = net
        self._out_features = [f"p{int(math.log2(s))}" for s in strides] + [
            f"p{int(math.log2(strides[-1])) + 1}"]

    def forward(self, x):
        features = self.net(x)["last_feat"]
        results = [stage(features) for stage in self.stages]
        results.append(F.max_pool2d(results[-1], kernel_size=1, stride=2, padding=0))
        return {f: r for f, r in zip(self._out_features, results)}


# -- MViTv2 ----------------------------------------------------------------------------------


def attention_pool(x, pool, norm=None):
    x = x.permute(0, 3, 1, 2)
    x = pool(x)
    x = x.permute(0, 2, 3, 1)
    if norm:
        x = norm(x)
    return x


class MultiScaleAttention(nn.Module):
    def __init__(self, dim, dim_out, num_heads, qkv_bias=True, norm_eps=1e-6, pool_kernel=(3, 3),
                 stride_q=1, stride_kv=1, residual_pooling=True, window_size=0,
                 use_rel_pos=False, input_size=None):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim_out // num_heads
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim_out * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim_out, dim_out)
        pad = [k // 2 for k in pool_kernel]
        dim_conv = dim_out // num_heads
        self.pool_q = nn.Conv2d(dim_conv, dim_conv, pool_kernel, stride=stride_q, padding=pad,
                                groups=dim_conv, bias=False)
        self.norm_q = nn.LayerNorm(dim_conv, eps=norm_eps)
        self.pool_k = nn.Conv2d(dim_conv, dim_conv, pool_kernel, stride=stride_kv, padding=pad,
                                groups=dim_conv, bias=False)
        self.norm_k = nn.LayerNorm(dim_conv, eps=norm_eps)
        self.pool_v = nn.Conv2d(dim_conv, dim_conv, pool_kernel, stride=stride_kv, padding=pad,
                                groups=dim_conv, bias=False)
        self.norm_v = nn.LayerNorm(dim_conv, eps=norm_eps)
        self.window_size = window_size
        if window_size:
            self.q_win_size = window_size // stride_q
            self.kv_win_size = window_size // stride_kv
        self.residual_pooling = residual_pooling
        self.use_rel_pos = use_rel_pos
        if use_rel_pos:
            size = input_size[0]
            rel_dim = 2 * max(size // stride_q, size // stride_kv) - 1
            self.rel_pos_h = nn.Parameter(torch.zeros(rel_dim, head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(rel_dim, head_dim))

    def forward(self, x):
        B, H, W, _ = x.shape
        qkv = self.qkv(x).reshape(B, H, W, 3, self.num_heads, -1).permute(3, 0, 4, 1, 2, 5)
        q, k, v = qkv.reshape(3, B * self.num_heads, H, W, -1).unbind(0)
        q = attention_pool(q, self.pool_q, self.norm_q)
        k = attention_pool(k, self.pool_k, self.norm_k)
        v = attention_pool(v, self.pool_v, self.norm_v)
        ori_q = q
        if self.window_size:
            q, q_hw_pad = window_partition(q, self.q_win_size)
            k, kv_hw_pad = window_partition(k, self.kv_win_size)
            v, _ = window_partition(v, self.kv_win_size)
            q_hw = (self.q_win_size, self.q_win_size)
            kv_hw = (self.kv_win_size, self.kv_win_size)
        else:
            q_hw = q.shape[1:3]
            kv_hw = k.shape[1:3]
        q = q.view(q.shape[0], np.prod(q_hw), -1)
        k = k.view(k.shape[0], np.prod(kv_hw), -1)
        v = v.view(v.shape[0], np.prod(kv_hw), -1)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        if self.use_rel_pos:
            attn = add_decomposed_rel_pos(attn, q, self.rel_pos_h, self.rel_pos_w, q_hw, kv_hw)
        attn = attn.softmax(dim=-1)
        x = attn @ v
        x = x.view(x.shape[0], q_hw[0], q_hw[1], -1)
        if self.window_size:
            x = window_unpartition(x, self.q_win_size, q_hw_pad, ori_q.shape[1:3])
        if self.residual_pooling:
            x += ori_q
        H, W = x.shape[1], x.shape[2]
        x = x.view(B, self.num_heads, H, W, -1).permute(0, 2, 3, 1, 4).reshape(B, H, W, -1)
        return self.proj(x)


class MultiScaleBlock(nn.Module):
    def __init__(self, dim, dim_out, num_heads, mlp_ratio=4.0, qkv_bias=True, drop_path=0.0,
                 norm_eps=1e-6, qkv_pool_kernel=(3, 3), stride_q=1, stride_kv=1,
                 residual_pooling=True, window_size=0, use_rel_pos=False, input_size=None):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = MultiScaleAttention(dim, dim_out, num_heads, qkv_bias, norm_eps,
                                        qkv_pool_kernel, stride_q, stride_kv, residual_pooling,
                                        window_size, use_rel_pos, input_size)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim_out, eps=norm_eps)
        self.mlp = Mlp(in_features=dim_out, hidden_features=int(dim_out * mlp_ratio),
                       out_features=dim_out)
        if dim != dim_out:
            self.proj = nn.Linear(dim, dim_out)
        if stride_q > 1:
            kernel_skip = stride_q + 1
            self.pool_skip = nn.MaxPool2d(kernel_skip, stride_q, int(kernel_skip // 2),
                                          ceil_mode=False)

    def forward(self, x):
        x_norm = self.norm1(x)
        x_block = self.attn(x_norm)
        if hasattr(self, "proj"):
            x = self.proj(x_norm)
        if hasattr(self, "pool_skip"):
            x = attention_pool(x, self.pool_skip)
        x = x + self.drop_path(x_block)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


class MViT(nn.Module):
    def __init__(self, img_size=224, patch_kernel=(7, 7), patch_stride=(4, 4),
                 patch_padding=(3, 3), in_chans=3, embed_dim=96, depth=16, num_heads=1,
                 last_block_indexes=(0, 2, 11, 15), qkv_pool_kernel=(3, 3), adaptive_kv_stride=4,
                 adaptive_window_size=56, residual_pooling=True, mlp_ratio=4.0, qkv_bias=True,
                 drop_path_rate=0.0, norm_eps=1e-6, use_abs_pos=False, use_rel_pos=True,
                 pretrain_img_size=224, pretrain_use_cls_token=True):
        super().__init__()
        self.pretrain_use_cls_token = pretrain_use_cls_token
        self.patch_embed = PatchEmbed(patch_kernel, patch_stride, patch_padding, in_chans,
                                      embed_dim)
        if use_abs_pos:
            n = (pretrain_img_size // patch_stride[0]) * (pretrain_img_size // patch_stride[1])
            self.pos_embed = nn.Parameter(
                torch.zeros(1, n + 1 if pretrain_use_cls_token else n, embed_dim))
        else:
            self.pos_embed = None
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth, device="cpu")]
        dim_out = embed_dim
        stride_kv = adaptive_kv_stride
        window_size = adaptive_window_size
        input_size = (img_size // patch_stride[0], img_size // patch_stride[1])
        stage, stride = 2, patch_stride[0]
        self.out_feature_channels, self.out_feature_strides = {}, {}
        self.blocks = nn.ModuleList()
        for i in range(depth):
            if i == last_block_indexes[1] or i == last_block_indexes[2]:
                stride_kv_ = stride_kv * 2
            else:
                stride_kv_ = stride_kv
            window_size_ = 0 if i in last_block_indexes[1:] else window_size
            self.blocks.append(MultiScaleBlock(
                embed_dim, dim_out, num_heads, mlp_ratio, qkv_bias, dpr[i], norm_eps,
                qkv_pool_kernel, 2 if i - 1 in last_block_indexes else 1, stride_kv_,
                residual_pooling, window_size_, use_rel_pos, input_size))
            embed_dim = dim_out
            if i in last_block_indexes:
                name = f"scale{stage}"
                self.out_feature_channels[name] = dim_out
                self.out_feature_strides[name] = stride
                self.add_module(f"{name}_norm", nn.LayerNorm(dim_out, eps=norm_eps))
                dim_out *= 2
                num_heads *= 2
                stride_kv = max(stride_kv // 2, 1)
                stride *= 2
                stage += 1
            if i - 1 in last_block_indexes:
                window_size = window_size // 2
                input_size = [s // 2 for s in input_size]
        self._last_block_indexes = last_block_indexes

    def forward(self, x):
        x = self.patch_embed(x)
        if self.pos_embed is not None:
            x = x + get_abs_pos(self.pos_embed, self.pretrain_use_cls_token, x.shape[1:3])
        outputs = {}
        stage = 2
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i in self._last_block_indexes:
                name = f"scale{stage}"
                outputs[name] = getattr(self, f"{name}_norm")(x).permute(0, 3, 1, 2)
                stage += 1
        return outputs


class FPN(nn.Module):
    def __init__(self, bottom_up, in_features=("scale2", "scale3", "scale4", "scale5"),
                 out_channels=256):
        super().__init__()
        strides = [bottom_up.out_feature_strides[f] for f in in_features]
        lateral_convs, output_convs = [], []
        for f, s in zip(in_features, strides):
            lateral = Conv2d(bottom_up.out_feature_channels[f], out_channels, kernel_size=1)
            output = Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
            stage = int(math.log2(s))
            self.add_module(f"fpn_lateral{stage}", lateral)
            self.add_module(f"fpn_output{stage}", output)
            lateral_convs.append(lateral)
            output_convs.append(output)
        self.lateral_convs = lateral_convs[::-1]
        self.output_convs = output_convs[::-1]
        self.in_features = tuple(in_features)
        self.bottom_up = bottom_up
        self._out_features = [f"p{int(math.log2(s))}" for s in strides] + [
            f"p{int(math.log2(strides[-1])) + 1}"]

    def forward(self, x):
        bottom_up_features = self.bottom_up(x)
        results = []
        prev_features = self.lateral_convs[0](bottom_up_features[self.in_features[-1]])
        results.append(self.output_convs[0](prev_features))
        for idx, (lateral_conv, output_conv) in enumerate(
                zip(self.lateral_convs, self.output_convs)):
            if idx > 0:
                features = bottom_up_features[self.in_features[-idx - 1]]
                top_down = F.interpolate(prev_features, scale_factor=2.0, mode="nearest")
                prev_features = lateral_conv(features) + top_down
                results.insert(0, output_conv(prev_features))
        results.append(F.max_pool2d(results[-1], kernel_size=1, stride=2, padding=0))
        return {f: r for f, r in zip(self._out_features, results)}


# -- weights and files in the publisher's layout ---------------------------------------------


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter drawn at random (norm weights around 1), so that no table or bias sits
    at a zero that would hide a mistake."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.2
            if name.endswith("weight") and p.ndim == 1:
                noise = noise + 1.0
            p.copy_(noise.to(p.dtype))
    return module


def write_zoo_pickle(path, backbone_state, heads=None):
    """A detectron2 model-zoo file: a pickle of ``{"model": {name: numpy array}, ...}`` with
    the backbone under ``backbone.``."""
    import pickle

    model = {f"backbone.{k}": v.detach().cpu().numpy() for k, v in backbone_state.items()}
    model.update({k: v.detach().cpu().numpy() for k, v in (heads or {}).items()})
    with open(path, "wb") as f:
        pickle.dump({"model": model, "__author__": "pareprop tests", "matching_heuristics": False},
                    f)
    return path


# -- comparisons the backbones' tests share ---------------------------------------------------


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def zoo_file_outputs(tmp_path, reference: nn.Module, load, x: torch.Tensor):
    """``reference`` written as a model-zoo file and read back by ``load(path)``, which must find
    every tensor in it; then both run on ``x`` in eval mode without gradients.

    Returns:
        The loaded model, the reference's pyramid and the model's.
    """
    path = write_zoo_pickle(tmp_path / "model_final.pkl", reference.state_dict())
    model = load(os.fspath(path)).eval()
    assert model.load_report.layout == "zoo" and not model.load_report.left_at_init
    with torch.no_grad():
        return model, reference.eval()(x), model(x)


def check_pyramid(got, want, shapes, tol: float) -> None:
    """``got`` is pareprop's pyramid (levels ``p2`` .. ``p6`` of the given sizes), within
    ``tol`` of the reference's ``want`` at every level."""
    assert list(got) == ["p2", "p3", "p4", "p5", "p6"]
    assert [tuple(v.shape[-2:]) for v in got.values()] == shapes
    for name in want:
        assert relative(got[name], want[name]) < tol, name


def training_step_grads(reference: nn.Module, model: nn.Module, x: torch.Tensor, seed: int = 5):
    """One training step of ``reference`` and of ``model`` on ``x``, each from ``seed`` (so that
    drop-path draws the same masks in the same order), their outputs checked equal to 1e-10.

    Returns:
        ``{name: (model's gradient, reference's gradient)}`` for every reference parameter,
        by detectron2's name (the model's state-dict name).
    """
    outputs = []
    for net in (reference, model):
        torch.manual_seed(seed)
        out = net(x)
        loss = sum((v * torch.linspace(-1, 1, v.numel(), dtype=v.dtype).view_as(v)).sum()
                   for v in out.values())
        loss.backward()
        outputs.append(out)
    for name in outputs[0]:
        assert relative(outputs[1][name], outputs[0][name]) < 1e-10, name
    theirs = dict(reference.named_parameters())
    ours = {n: p for n, p in model.state_dict(keep_vars=True).items() if n in theirs}
    assert set(ours) == set(theirs)
    return {name: (ours[name].grad, p.grad) for name, p in theirs.items()}
