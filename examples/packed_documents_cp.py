"""packed_documents.py's block trained with context parallelism: the packed sequence split over the ranks of
a process group, attention by magi_attn.calc_attn (each rank computes its share, fetching only the keys its
queries need). Launch with torchrun or mpirun; CPU ranks use gloo, GPU ranks NCCL:

    torchrun --nproc-per-node 2 examples/packed_documents_cp.py [--steps 200]
    mpirun -np 2 python examples/packed_documents_cp.py

Every rank draws the same batch; each computes the loss of its own tokens, the gradients of the parameters
are summed over the ranks, and the loss printed is the whole sequence's. --check compares the first step's
loss and gradients with one device computing everything.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import magi_attn as ma  # noqa: E402
from packed_documents import BLOCK, Block, flex_attention, packed_batch  # noqa: E402


def distributed_step(model, ids, labels, positions, cu, device, dtype):
    """The whole sequence's mean loss; parameter gradients summed over the ranks (every rank gets them)."""
    mask = ma.masks.varlen_block_causal(cu, BLOCK)
    key = ma.magi_attn_flex_key(mask.q_ranges, mask.k_ranges, mask.attn_type_map, mask.total_q, mask.total_k,
                                4, 4, 16, chunk_size=64, device=device)
    local_ids, local_labels, local_positions = (ma.dispatch(x.to(device), key) for x in (ids, labels, positions))
    local_labels = torch.where(ma.get_position_ids(key) < mask.total_q, local_labels, -100)  # padding rows

    def attend(q, k, v):
        out, _ = ma.calc_attn(q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous(), key)
        return out.float()

    logits = model(local_ids, local_positions, attend)
    counted = (labels != -100).sum()
    loss = nn.functional.cross_entropy(logits, local_labels, ignore_index=-100, reduction="sum") / counted
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--check", action="store_true", help="compare step 0 with one device")
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl where CUDA is available")
    args = parser.parse_args()
    rank, cp, _ = ma.init_distributed(args.backend)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = Block().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        ids, labels, positions, cu = packed_batch(args.tokens, generator)
        optimizer.zero_grad()
        losses.append(distributed_step(model, ids, labels, positions, cu, device, dtype))
        if args.check and step == 0:
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            mask = ma.masks.varlen_block_causal(cu, BLOCK)
            ranges = [torch.from_numpy(a).to(device) for a in (mask.q_ranges, mask.k_ranges, mask.attn_type_map)]
            logits = model(ids.to(device), positions.to(device), flex_attention(*ranges, dtype))
            single = nn.functional.cross_entropy(logits, labels.to(device), ignore_index=-100)
            single.backward()
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            assert abs(single.item() - losses[0]) <= tol * abs(single.item()), (single.item(), losses[0])
            for p, g in zip(model.parameters(), grads):
                torch.testing.assert_close(g, p.grad, rtol=tol, atol=tol)
            for p, g in zip(model.parameters(), grads):
                p.grad.copy_(g)
            if rank == 0:
                print(f"check: step 0 loss {losses[0]:.6f} = one device's {single.item():.6f}; gradients agree")
        optimizer.step()
        if rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        print(f"cp {cp}: loss {first:.4f} -> {last:.4f} (mean of the first and last 10 steps)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
