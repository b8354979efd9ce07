#!/usr/bin/env python3
"""Peers for bench/cuda/flash_bench, on the same GPU in the same run: torch SDPA (cuDNN and flash backends)
for batch full/causal, torch's FA2 kernel through its varlen op for the document masks it expresses (varlen full
and causal, sliding window), and compiled FlexAttention for the document masks.

With --large-d (flash_bench --large-d's cases, D > 256): torch SDPA's memory-efficient backend (sdpa_mem) and
ffpa-attn 0.2.4 (ffpa, its Triton forward and its own backward routing; the wheel from build-deps/wheels is
pip-installed without dependencies into a temporary directory: the device has no network) on full and causal.

Reads the cases JSON written by flash_bench (--cases) and prints CSV rows in flash_bench's format.
FLOPs use the same accounting (SPEC section 6): fwd = 4 * area * H * D, bwd = 2.5 * fwd, where area is
the mask's kept-cell count from the JSON.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import torch


# Back-to-back calls before each measurement, as flash_bench's --warm-ms (its time_ms says why): every case is
# timed at the clocks the GPU settles at under its power cap, whatever ran before. Two calls stay in flight.
WARM_MS = 300


def median_ms(fn, reps):
    """Median GPU time of one call: the timed calls queued back to back with an event between each two and one wait
    at the end (flash_bench's time_ms), so the host's launch latency is hidden wherever the host keeps ahead."""
    warm_until = time.monotonic() + WARM_MS / 1000.0
    in_flight = [torch.cuda.Event(), torch.cuda.Event()]
    calls = 0
    while calls < 3 or time.monotonic() < warm_until:
        if calls >= 2:
            in_flight[calls % 2].synchronize()
        fn()
        in_flight[calls % 2].record()
        calls += 1
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    marks[0].record()
    for i in range(reps):
        fn()
        marks[i + 1].record()
    marks[-1].synchronize()
    times = sorted(marks[i].elapsed_time(marks[i + 1]) for i in range(reps))
    n = len(times)
    return times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])


def measure(fwd, reps):
    """fwd() -> (out, inputs); returns (fwd_ms, bwd_ms)."""
    fwd_ms = median_ms(lambda: fwd(), reps)
    out, inputs = fwd()
    dout = torch.randn_like(out)

    def bwd():
        torch.autograd.grad(out, inputs, dout, retain_graph=True)

    return fwd_ms, median_ms(bwd, reps)


def row(impl, name, tokens, d, area, heads, fwd_ms, bwd_ms):
    flops = 4.0 * area * heads * d
    print(f"{impl},{name},{tokens},{d},{flops / fwd_ms / 1e9:.1f},{2.5 * flops / bwd_ms / 1e9:.1f},"
          f"{fwd_ms:.3f},{bwd_ms:.3f}", flush=True)


def varlen_peers(name, case, cu, total, d, heads, reps):
    """Torch's FA2 kernel on the document masks it expresses, through its varlen op (cumulative sequence lengths,
    [total, H, D] tensors): varlen full, varlen causal, the sliding window (a left window). Not measured (H100,
    torch 2.11): SDPA on nested (jagged) tensors spent 3-5 ms per call on the host, and cuDNN's varlen op 50-85 ms
    per call; both timed torch, not the kernels."""
    q, k, v = (torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    causal = name != "varlen_full"
    longest = max(b - a for a, b in zip(case["cu_seqlens"], case["cu_seqlens"][1:]))
    window = {"window_size_left": case["window"], "window_size_right": 0} if name.startswith("sliding_window") else {}

    def fwd():
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, causal, False, **window)
        return out[0], (q, k, v)
    try:
        row("sdpa_flash", name, total, d, case["area"], heads, *measure(fwd, reps))
    except Exception as e:  # noqa: BLE001
        print(f"# sdpa_flash {name} D{d}: {e}", file=sys.stderr)


def import_ffpa():
    """ffpa_attn from its wheel in build-deps/wheels (pip install --no-deps into a temporary target), or None with
    the reason on stderr."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wheels = sorted(glob.glob(os.path.join(root, "build-deps", "wheels", "ffpa_attn-*.whl")))
    if not wheels:
        print("# ffpa unavailable: no build-deps/wheels/ffpa_attn-*.whl", file=sys.stderr)
        return None
    target = tempfile.mkdtemp(prefix="ffpa_")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", target,
                        wheels[-1]], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"# ffpa unavailable: pip install failed: {r.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    sys.path.insert(0, target)
    try:
        import ffpa_attn
        return ffpa_attn
    except Exception as e:  # noqa: BLE001
        print(f"# ffpa unavailable: import failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def large_d_peers(spec, reps):
    """D > 256 peers on full / causal: SDPA memory-efficient, ffpa-attn (Triton forward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    ffpa = import_ffpa()
    seq, batch, heads = spec["seq"], spec["batch"], spec["heads"]
    for d in spec["dims"]:
        for case in spec["cases"]:
            name, area = case["name"], case["area"]
            if name not in ("full", "causal"):
                continue
            causal = name == "causal"
            q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))

            def sdpa_mem():
                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v)

            def ffpa_fwd():
                return ffpa.ffpa_attn_func(q, k, v, is_causal=causal, forward_backend="triton"), (q, k, v)
            peers = [("sdpa_mem", sdpa_mem)] + ([("ffpa", ffpa_fwd)] if ffpa is not None else [])
            for label, fwd in peers:
                try:
                    row(label, name, seq * batch, d, area, heads, *measure(fwd, reps))
                except Exception as e:  # noqa: BLE001
                    print(f"# {label} {name} D{d}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            del q, k, v
            torch.cuda.empty_cache()


def main():
    global WARM_MS
    parser = argparse.ArgumentParser()
    parser.add_argument("cases")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warm-ms", type=int, default=WARM_MS, help="back-to-back calls before each measurement")
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--skip-all", action="store_true", help="print only the CSV header")
    parser.add_argument("--flex-dims", default="128")
    parser.add_argument("--large-d", action="store_true", help="the D > 256 peers (sdpa_mem, ffpa) only")
    args = parser.parse_args()
    if args.reps <= 0 or args.warm_ms < 0:
        parser.error(f"--reps {args.reps} must be positive and --warm-ms {args.warm_ms} not negative")
    WARM_MS = args.warm_ms
    print("impl,mask,tokens,head_dim,fwd_tflops,bwd_tflops,fwd_ms,bwd_ms", flush=True)
    if args.skip_all:
        return
    spec = json.load(open(args.cases))
    if args.large_d:
        large_d_peers(spec, args.reps)
        return
    seq, batch, heads = spec["seq"], spec["batch"], spec["heads"]
    total = seq * batch
    dev = "cuda"
    import torch  # main's own name too (the flex branch imports torch._dynamo): --no-flex left it unbound
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    flex = None
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            import torch._dynamo
            torch._dynamo.config.cache_size_limit = 64
            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as e:  # noqa: BLE001
            print(f"# flex unavailable: {e}", file=sys.stderr)
    flex_dims = {int(x) for x in args.flex_dims.split(",") if x}

    for d in spec["dims"]:
        for case in spec["cases"]:
            name, area = case["name"], case["area"]
            if name in ("full", "causal"):
                causal = name == "causal"
                q, k, v = (torch.randn(batch, heads, seq, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                for label, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                    try:
                        def fwd():
                            with sdpa_kernel([backend]):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v)
                        row(label, name, total, d, area, heads, *measure(fwd, args.reps))
                    except Exception as e:  # noqa: BLE001
                        print(f"# {label} {name} D{d}: {e}", file=sys.stderr)
            cu = torch.tensor(case["cu_seqlens"], device=dev, dtype=torch.int32)
            if name in ("varlen_full", "varlen_causal") or name.startswith("sliding_window"):
                varlen_peers(name, case, cu, total, d, heads, args.reps)
            if flex is None or d not in flex_dims or name == "full":
                continue
            lengths = cu[1:] - cu[:-1]
            doc = torch.repeat_interleave(torch.arange(len(lengths), device=dev, dtype=torch.int32), lengths)
            pos = torch.arange(total, device=dev, dtype=torch.int32) - cu[:-1][doc.long()]
            window, block = case["window"], case["block"]
            if name == "causal" or name == "varlen_causal":
                def mask_mod(b, h, qi, ki):
                    return (doc[qi] == doc[ki]) & (ki <= qi)
            elif name == "varlen_full":
                def mask_mod(b, h, qi, ki):
                    return doc[qi] == doc[ki]
            elif name.startswith("sliding_window"):
                def mask_mod(b, h, qi, ki):
                    return (doc[qi] == doc[ki]) & (ki <= qi) & (qi - ki <= window)
            elif name.startswith("varlen_block_causal"):
                def mask_mod(b, h, qi, ki):
                    return (doc[qi] == doc[ki]) & (pos[ki] // block <= pos[qi] // block)
            elif name == "shared_question":
                def mask_mod(b, h, qi, ki):
                    return (ki <= qi) & ((doc[ki] == 0) | (doc[ki] == doc[qi]))
            else:
                continue
            try:
                block_mask = create_block_mask(mask_mod, 1, None, total, total, device=dev)
                q, k, v = (torch.randn(1, heads, total, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))

                def fwd():
                    return flex(q, k, v, block_mask=block_mask), (q, k, v)
                row("flex", name, total, d, area, heads, *measure(fwd, args.reps))
            except Exception as e:  # noqa: BLE001
                print(f"# flex {name} D{d}: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
