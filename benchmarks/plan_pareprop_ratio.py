"""PaReprop against Reprop in planned memory at one batch, without a largest-batch search.

An 80 GiB largest-batch plan of a chunked Rev-Swin-T or Rev-MViTv2-B takes 20-30 minutes on a
2-core CPU; one plan at a middle batch takes under a minute. The batch-dependent part of the
peak (peak minus parameters, optimizer state and inputs) grows linearly with the batch, so
its ratio between the two engines approximates the ratio of their largest batches.

    PYTHONPATH=src python benchmarks/plan_pareprop_ratio.py rev_swin_tiny 512 --chunk-at 8374
"""

import argparse

from pareprop.memory.plan import plan_memory
from pareprop.memory.units import parse_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("batch_size", type=int)
    parser.add_argument("--chunk-at", type=int, required=True,
                        help="scale the chunk size so that it is --chunk-bytes at this batch")
    parser.add_argument("--chunk-bytes", default="1GiB")
    args = parser.parse_args()
    if args.batch_size < 1 or args.chunk_at < 1:
        parser.error(f"expected a batch size and --chunk-at of at least 1, got "
                     f"{args.batch_size} and {args.chunk_at}")
    chunk = parse_memory(args.chunk_bytes) * args.batch_size // args.chunk_at
    varying = {}
    for engine in ("reversible", "pareprop"):
        r = plan_memory(args.model, args.batch_size, engine, amp="bf16", grad_checkpointing=True,
                        chunk_bytes=chunk, img_size=224)
        varying[engine] = r.peak - r.parameters - r.optimizer_state - r.inputs
        print(f"{args.model} batch {args.batch_size} {engine}: peak {r.peak / 2**30:.3f} GiB, "
              f"batch-dependent {varying[engine] / 2**30:.3f} GiB")
    print(f"largest batch, pareprop / reversible ~ "
          f"{varying['reversible'] / varying['pareprop']:.2f}x")


if __name__ == "__main__":
    main()
