"""A small transformer block trained on packed documents with magi_attn.flex_flash_attn_func.

Documents of different lengths are packed into one sequence; attention is block-causal inside each document
(a token sees its own block of 16 and the earlier blocks of its document, never another document): one
magi_attn mask instead of padding. The task suits blocks: each token predicts the token one block ahead, and
each document repeats its first two blocks, so that from the second block on the answer is the token one
block back; the loss falls below chance (ln 64 = 4.16) only if attention finds it.

    python examples/packed_documents.py [--device cpu|cuda] [--steps 200] [--compile]

packed_documents_cp.py trains the same block with the sequence split over ranks (context parallelism).
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import magi_attn as ma

VOCAB, DIM, HEADS, BLOCK, MAX_DOC = 64, 64, 4, 16, 128


def packed_batch(tokens: int, generator: torch.Generator):
    """Documents of 32..128 tokens (whole blocks) filling `tokens`: (token ids, labels, position in document,
    cu_seqlens). A label is the token one block ahead in the document (-100: none)."""
    ids, labels, positions, cu = [], [], [], [0]
    while cu[-1] < tokens:
        length = min(2 * BLOCK * int(torch.randint(1, MAX_DOC // (2 * BLOCK) + 1, (1,), generator=generator)),
                     tokens - cu[-1])
        period = torch.randint(0, VOCAB, (2 * BLOCK,), generator=generator)
        doc = period.repeat(MAX_DOC // (2 * BLOCK))[:length]
        ids.append(doc)
        labels.append(torch.cat([doc[BLOCK:], torch.full((min(BLOCK, length),), -100)]))
        positions.append(torch.arange(length))
        cu.append(cu[-1] + length)
    return torch.cat(ids), torch.cat(labels), torch.cat(positions), cu


class Block(nn.Module):
    """Embedding, one pre-norm attention + MLP block, output head. `attend(q, k, v)` is the attention."""

    def __init__(self):
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_DOC, DIM)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, positions, attend):
        x = self.embed(ids) + self.position(positions)
        q, k, v = self.qkv(self.norm1(x)).view(-1, 3, HEADS, DIM // HEADS).unbind(1)
        x = x + self.proj(attend(q, k, v).reshape(-1, DIM))
        return self.head(x + self.mlp(self.norm2(x)))


def flex_attention(q_ranges, k_ranges, types, dtype):
    """attend(q, k, v) over the mask's slices; bf16 on GPUs (the fast kernels' dtypes), fp32 on the CPU."""
    def attend(q, k, v):
        out, _ = ma.flex_flash_attn_func(q.to(dtype).contiguous(), k.to(dtype).contiguous(),
                                         v.to(dtype).contiguous(), q_ranges, k_ranges, types)
        return out.float()
    return attend


def train(device: str, steps: int, tokens: int, compile_model: bool, seed: int = 0):
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = Block().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    step_fn = torch.compile(model, fullgraph=True) if compile_model else model
    losses = []
    for step in range(steps):
        ids, labels, positions, cu = packed_batch(tokens, generator)
        mask = ma.masks.varlen_block_causal(cu, BLOCK)
        ranges = [torch.from_numpy(a).to(device) for a in (mask.q_ranges, mask.k_ranges, mask.attn_type_map)]
        logits = step_fn(ids.to(device), positions.to(device), flex_attention(*ranges, dtype))
        loss = nn.functional.cross_entropy(logits, labels.to(device), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:4d} loss {losses[-1]:.4f}", flush=True)
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per packed sequence")
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the block")
    args = parser.parse_args()
    losses = train(args.device, args.steps, args.tokens, args.compile)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"loss {first:.4f} -> {last:.4f} (mean of the first and last 10 steps)")


if __name__ == "__main__":
    main()
