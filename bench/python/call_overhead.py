"""What a call through the Python package adds to the C++ call (issue 21's target: < 15 us at 1k tokens).

The same case as bench/cuda/api_overhead_bench (full mask, 1k tokens, 16 heads, D 128, bf16, one GPU): host
time to enqueue one call (calls back to back, no sync inside; median of 5 repetitions) and wall time per
call with the final sync, for the binding alone (magi_attn._C.forward), the framework-neutral
magi_attn.forward, and flex_flash_attn_func (forward without and with inputs that need a gradient; forward +
backward through autograd, whose engine the C++ loop does not have). With --cpp
(the C++ program's path) it runs that too and prints the difference.

    python bench/python/call_overhead.py [--cpp build/bench/cuda/api_overhead_bench] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time

import torch

import magi_attn as ma
from magi_attn import _C


def timed(name, fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return name, statistics.median(host), statistics.median(wall)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpp", help="path of api_overhead_bench (the C++ baseline)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=100, help="calls a repetition (few: the launch queue never fills)")
    args = parser.parse_args()
    t, h, d = args.tokens, args.heads, args.dim
    q, k, v, do = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mask = ma.masks.full(t)
    qr, kr, tm = (torch.from_numpy(a).cuda() for a in (mask.q_ranges, mask.k_ranges, mask.attn_type_map))
    out, lse = torch.empty_like(q), torch.empty(t, h, device="cuda")
    workspace = torch.empty(_C.forward_workspace_bytes(q, "auto") // 4 + 1, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    rows = [
        timed("binding _C.forward", lambda: _C.forward(mask._c, q, k, v, out, lse, None, None, None, None, None, 0.0,
                                                       "sh", "auto", None, workspace, stream), args.calls),
        timed("magi_attn.forward", lambda: ma.forward(mask, q, k, v), args.calls),
        timed("flex_flash_attn_func fwd", lambda: ma.flex_flash_attn_func(q, k, v, qr, kr, tm), args.calls),
    ]
    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    rows.append(timed("flex_flash_attn_func fwd (grad)", lambda: ma.flex_flash_attn_func(ql, kl, vl, qr, kr, tm),
                      args.calls))

    def forward_backward():
        o, _ = ma.flex_flash_attn_func(ql, kl, vl, qr, kr, tm)
        o.backward(do)

    rows.append(timed("flex_flash_attn_func fwd+bwd", forward_backward, args.calls // 2))
    cpp = {}
    if args.cpp:
        text = subprocess.run([args.cpp, "--tokens", str(t), "--heads", str(h), "--dim", str(d), "--calls",
                               str(args.calls)], capture_output=True, text=True, check=True).stdout
        for name, host, wall in re.findall(r"cpp (\S+) host_us=([0-9.]+) wall_us=([0-9.]+)", text):
            cpp[name] = (float(host), float(wall))
            rows.append((f"C++ magi::{name}", float(host), float(wall)))
    print(f"\ncall overhead: full mask, {t} tokens, {h} heads, D {d}, bf16, {torch.cuda.get_device_name()}")
    print(f"{'path':34s} {'host us':>9s} {'wall us':>9s} {'added host us':>14s}")
    for name, host, wall in rows:
        base = cpp.get("forward_backward" if "bwd" in name else "forward")
        added = f"{host - base[0]:14.2f}" if base and not name.startswith("C++") else f"{'':14s}"
        print(f"{name:34s} {host:9.2f} {wall:9.2f} {added}")


if __name__ == "__main__":
    main()
