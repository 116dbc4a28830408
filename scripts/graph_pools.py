#!/usr/bin/env python3
"""How much GPU memory each padded length's CUDA graphs keep, for a 24-layer BERT-large masked LM with
`substation.inject(model)` (graphed, length_multiple=64) trained one step per length under AMP fp16: the memory
reserved after each length's first (capturing) step, less the reserved memory before it, with the caching allocator
emptied in between, and the memory allocated likewise. Every training shape's graphs share one pool, in which a
shape's saved tensors live from its forward to its backward: allocated memory hardly grows with each new length,
reserved memory by what the pool's free blocks could not take. `--order falling` trains the longest length first,
rising the shortest. The first length's step also makes AdamW's state, the gradient buffers and the weights' float16
copy.

    python scripts/graph_pools.py --size bert-large-b8-l512 --out layouts/h200-graph-pools.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import train_mlm  # noqa: E402  (a sibling script: the model and its data are its)

from substation.sizes import get_size  # noqa: E402


def memory_gb() -> tuple[float, float]:
    """(allocated, reserved) GiB with the caching allocator emptied: a graph pool's blocks count as allocated while a
    tensor of the capture holds them (the forward's saved tensors), as reserved in any case."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="bert-large-b8-l512")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=30528)
    parser.add_argument("--order", choices=["rising", "falling"], default="rising",
                        help="the lengths' order: shortest or longest first")
    parser.add_argument("--out", required=True, metavar="JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_pools.py: error: needs an NVIDIA GPU, and torch sees none", file=sys.stderr)
        return 2
    size, device = get_size(args.size), torch.device("cuda")
    model, forward = train_mlm.prepare("substation_defaults", train_mlm.initial_model(size, args.layers, args.vocab, 0),
                                       args.size, device, seed=0)
    optimizer = train_mlm.make_optimizer("fused", model.parameters(), 1e-4, device)
    scaler = torch.amp.GradScaler("cuda")
    rows, generator = [], torch.Generator().manual_seed(0)
    lengths = list(range(64, size.L + 1, 64))[::1 if args.order == "rising" else -1]
    for length in lengths + lengths[-1:]:  # the last length again: a replay, which keeps nothing new
        ids, labels = train_mlm.mask_tokens(generator, train_mlm.token_stream(generator, size.B, length, args.vocab),
                                            args.vocab)
        before = memory_gb()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = forward(input_ids=ids.to(device), labels=labels.to(device)).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        after = memory_gb()
        rows.append({"length": length, "allocated_gib": after[0], "reserved_gib": after[1],
                     "allocated_added_gib": after[0] - before[0], "reserved_added_gib": after[1] - before[1]})
        print(f"L={length:4d}  allocated {after[0]:6.2f} GiB (+{after[0] - before[0]:5.2f})  reserved {after[1]:6.2f} "
              f"GiB (+{after[1] - before[1]:5.2f})")
    Path(args.out).write_text(json.dumps({"size": args.size, "layers": args.layers, "order": args.order,
                                          "rows": rows}, indent=1),
                              encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
