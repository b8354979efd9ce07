"""forward / backward on any framework's arrays (numpy, torch, JAX, CuPy, DLPack producers), CPU or CUDA.
Outputs are allocated in the framework of q on q's device; the C++ API validates every argument."""
from __future__ import annotations

import numbers

import numpy as np

from . import _C
from ._arrays import dtype_name, framework_of
from ._mask import Mask

BACKENDS = ("auto", "cpu", "cuda", "reference")


def _check_mask(mask) -> None:
    if not isinstance(mask, Mask):
        raise TypeError(f"mask: expected a magi_attn.Mask, got {type(mask).__name__} (build one with magi_attn.Mask "
                        "or magi_attn.masks)")


def _number(value, name: str, optional: bool = False):
    """A float option: a real number (not a bool) that fits a double; None where optional."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number{' or None' if optional else ''}, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name}: too large for a double (allowed: finite numbers)") from None


def _flag(value, name: str, optional: bool = False):
    """A bool option (numpy's bool too); None where optional."""
    if value is None and optional:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool{' or None' if optional else ''}, got {type(value).__name__}")
    return bool(value)


def _check_options(softmax_scale, softcap, sink_layout, backend, deterministic) -> None:
    _number(softmax_scale, "softmax_scale", optional=True)
    _number(softcap, "softcap")
    if sink_layout not in ("sh", "ssh"):
        raise ValueError(f"sink_layout: unknown layout {sink_layout!r} (allowed: 'sh', 'ssh')")
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r} (allowed: {', '.join(BACKENDS)})")
    _flag(deterministic, "deterministic", optional=True)


def _require_contiguous(x, name: str) -> None:
    """Outputs are allocated in the shape of q (k, sink): a broadcast view (stride 0) of a huge shape must get the
    layout error, not a failed allocation of its virtual size first."""
    if not framework_of(x, name).contiguous(x):
        raise ValueError(f"{name}: must be row-major contiguous (make a contiguous copy first, e.g. .contiguous() or "
                         "numpy.ascontiguousarray)")


def _lse_dtype(qdt: str) -> str:
    return "fp64" if qdt == "fp64" else "fp32"


def forward(mask: Mask, q, k, v, softmax_scale=None, softcap=0.0, sink=None, sink_layout="sh", out_dtype=None,
            return_max_logits=False, deterministic=None, backend="auto"):
    """Attention over `mask`: returns (out, lse), and max_logits with return_max_logits.

    q [Tq, Hq, D], k and v [Tk, Hkv, D] (Hq a multiple of Hkv), all one dtype (bf16 / fp16 fast; fp32 / fp64 on
    the CPU and the reference engines) on one device. out [Tq, Hq, D] in q's dtype or out_dtype=float32, lse
    [Tq, Hq] fp32 (fp64 for fp64 inputs) natural log, -inf on rows that keep no key. sink: fp32 raw logits,
    [S, Hq] (sink_layout 'sh') or [Tq, S, Hq] ('ssh'). softmax_scale defaults to D^-0.5; softcap > 0 caps
    logits at softcap * tanh(s / softcap). max_logits [Hq] fp32: the largest logit of each head.
    """
    _check_mask(mask)
    _check_options(softmax_scale, softcap, sink_layout, backend, deterministic)
    deterministic = _flag(deterministic, "deterministic", optional=True)
    return_max_logits = _flag(return_max_logits, "return_max_logits")
    fw = framework_of(q, "q")
    framework_of(k, "k"), framework_of(v, "v")
    if sink is not None:
        framework_of(sink, "sink")
    device = fw.device(q)
    qdt = fw.dtype(q, "q")
    shape = fw.shape(q)
    if len(shape) != 3:
        raise ValueError(f"q: expected shape [Tq, Hq, D], got {list(shape)}")
    _require_contiguous(q, "q")
    odt = qdt if out_dtype is None else dtype_name(out_dtype, "out_dtype")
    if odt not in (qdt, "fp32"):
        raise ValueError(f"out_dtype: {odt} is not allowed for {qdt} inputs (allowed: {qdt}, fp32)")
    out = fw.empty(shape, odt, device)
    lse = fw.empty(shape[:2], _lse_dtype(qdt), device)
    max_logits = fw.empty((shape[1],), "fp32", device) if return_max_logits else None
    stream = fw.stream(device)
    ext = fw.for_extension
    _C.forward(mask._c, ext(q), ext(k), ext(v), out, lse, max_logits, None if sink is None else ext(sink), None, None,
               None if softmax_scale is None else float(softmax_scale), float(softcap), sink_layout, backend,
               deterministic, None, stream)
    fw.finish(device, stream)
    results = (fw.wrap(out), fw.wrap(lse))
    return results + (fw.wrap(max_logits),) if return_max_logits else results


def backward(mask: Mask, q, k, v, out, lse, do, softmax_scale=None, softcap=0.0, sink=None, sink_layout="sh",
             grad_dtype=None, deterministic=None, backend="auto"):
    """Gradients of forward's out: returns (dq, dk, dv), and dsink when a sink is given.

    out and lse as forward returned them (lse includes the sink); do like out. dq, dk, dv come in q's dtype, or
    grad_dtype=float32. Rows with lse = -inf get zero gradients.
    """
    _check_mask(mask)
    _check_options(softmax_scale, softcap, sink_layout, backend, deterministic)
    deterministic = _flag(deterministic, "deterministic", optional=True)
    fw = framework_of(q, "q")
    for name, x in (("k", k), ("v", v), ("out", out), ("lse", lse), ("do", do)):
        framework_of(x, name)
    if sink is not None:
        framework_of(sink, "sink")
    for name, x in (("q", q), ("k", k), ("sink", sink)):
        if x is not None:
            _require_contiguous(x, name)
    device = fw.device(q)
    qdt = fw.dtype(q, "q")
    qshape = fw.shape(q)
    kshape = framework_of(k, "k").shape(k)
    gdt = qdt if grad_dtype is None else dtype_name(grad_dtype, "grad_dtype")
    if gdt not in (qdt, "fp32"):
        raise ValueError(f"grad_dtype: {gdt} is not allowed for {qdt} inputs (allowed: {qdt}, fp32)")
    dq = fw.empty(qshape, gdt, device)
    dk = fw.empty(kshape, gdt, device)
    dv = fw.empty(kshape, gdt, device)
    dsink = fw.empty(framework_of(sink, "sink").shape(sink), "fp32", device) if sink is not None else None
    stream = fw.stream(device)
    ext = fw.for_extension
    try:
        _C.backward(mask._c, ext(q), ext(k), ext(v), ext(out), ext(lse), ext(do), dq, dk, dv,
                    None if sink is None else ext(sink), dsink, None if softmax_scale is None else float(softmax_scale),
                    float(softcap), sink_layout, backend, deterministic, False, None, stream)
    except ValueError as error:  # the C++ API calls out's gradient `dout`; here it is `do`
        message = str(error)
        if not message.startswith("dout:"):
            raise
        raise ValueError("do:" + message[len("dout:"):]) from None
    fw.finish(device, stream)
    grads = (fw.wrap(dq), fw.wrap(dk), fw.wrap(dv))
    return grads + (fw.wrap(dsink),) if sink is not None else grads
