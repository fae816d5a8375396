"""Time ``pareprop.load_pretrained`` on synthetic full-size files in the published layouts.

The real files cannot be downloaded here, so this writes files with the published key names
and shapes (PySlowFast's ``{"model_state", "optimizer_state", "epoch", "cfg"}`` container),
filled with a model's random weights, and times reading, key mapping and copying into a fresh
model (median of ``--repeats``). The file's size matches the real one's model state; the real
files may also carry optimizer state, which makes them larger and slower to read.

    python benchmarks/load_pretrained.py --models rev_vit_small_patch16_224 \\
        rev_vit_base_patch16_224 rev_mvit_base --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Dict

import torch

import pareprop
from pareprop.models.rev_mvit import RevMViTv1

_BLOCK = {
    "norm1": "F.norm", "attn": "F.attn", "norm2": "G.norm", "mlp": "G.mlp",
    "fuse": "pre_q_fuse.fuse_fn",
}


def to_pyslowfast(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The model's weights under PySlowFast's names and shapes (the inverse of the loaders)."""
    paths = model.block_paths() if isinstance(model, RevMViTv1) else None
    out: Dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key.startswith("head."):
            out["head.projection." + key[5:]] = value
            continue
        block = None
        if key.startswith("stack.blocks."):
            i, rest = key[len("stack.blocks."):].split(".", 1)
            block = int(i)
        elif paths is not None and key.startswith("stages."):
            block = next(i for i, p in enumerate(paths) if key.startswith(p + "."))
            rest = key[len(paths[block]) + 1:]
        if block is None:
            out[key] = value
            continue
        head, tail = rest.split(".", 1)
        prefix = f"rev_backbone.layers.{block}.{_BLOCK[head]}."
        if tail.startswith("qkv."):
            for name, part in zip("qkv", value.chunk(3, dim=0)):
                out[prefix + name + tail[3:]] = part.clone()
        elif tail.startswith("pool_"):
            out[prefix + tail] = value.unsqueeze(2)  # Conv3d over one frame
        else:
            out[prefix + tail] = value
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(pareprop.pretrained.PUBLISHED))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            torch.manual_seed(0)
            source = pareprop.create_model(name)
            path = os.path.join(tmp, name + ".pyth")
            torch.save({"epoch": 300, "model_state": to_pyslowfast(source), "cfg": ""}, path)
            times = []
            for _ in range(args.repeats):
                model = pareprop.create_model(name)
                start = time.perf_counter()
                pareprop.load_pretrained(model, path)
                times.append(time.perf_counter() - start)
            same = all(torch.equal(a, b) for a, b in zip(
                source.state_dict().values(), model.state_dict().values()))
            results.append({
                "model": name,
                "file_mib": round(os.path.getsize(path) / 2**20, 1),
                "load_s_median": round(statistics.median(times), 3),
                "repeats": args.repeats,
                "weights_identical": same,
            })
            print(json.dumps(results[-1]))


if __name__ == "__main__":
    main()
