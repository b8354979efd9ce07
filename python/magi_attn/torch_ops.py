"""torch integration: flex_flash_attn_func as torch custom ops (magi_attn::flex_fwd, magi_attn::flex_bwd) with
fake implementations and autograd, so that torch.compile(fullgraph=True) traces through it; in eager mode the
same implementation runs under a torch.autograd.Function (or directly when nothing needs a gradient), which
skips the custom-op dispatch (~15 us a call). Work runs on torch's current stream; outputs come from torch's
allocator, and so does the scratch while a CUDA graph is captured, so the graph captures forward + backward."""
from __future__ import annotations

import weakref
from typing import Optional, Tuple

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor

from . import _C
from ._attention import _check_options, _flag, _number
from ._mask import Mask

# ---- masks from range tensors, cached by tensor identity and version (no host sync after the first call) ----


def _require_ranges(x, name: str, n: Optional[int], ndim: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name}: expected an int32 tensor, got {x.dtype}")
    shape = "[n, 2]" if ndim == 2 else "[n]"
    if x.dim() != ndim or (ndim == 2 and x.shape[1] != 2) or (n is not None and x.shape[0] != n):
        raise ValueError(f"{name}: expected shape {shape}{'' if n is None else f' with n = {n}'}, got {list(x.shape)}")


class _MaskCache:
    """Range tensors -> Mask. CPU range tensors are keyed by content on every call (a write through `.data` or a
    numpy view leaves torch's version counter alone, so identity and version would miss it). CUDA range tensors
    are keyed by the tensors themselves (alive, same version), so that a hit reads nothing back: such a tensor is
    read to the host once, on its first use, and checked then (a hit means these very tensors passed)."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self.by_identity: dict = {}
        self.by_content: dict = {}

    def get(self, q_ranges: Tensor, k_ranges: Tensor, types: Tensor, total_q: int, total_k: int):
        tensors = (q_ranges, k_ranges, types)
        key = (id(q_ranges), id(k_ranges), id(types), total_q, total_k)
        on_host = any(t.device.type == "cpu" for t in tensors if isinstance(t, Tensor))
        hit = None if on_host else self.by_identity.get(key)
        if hit is not None:
            refs, versions, mask = hit
            if (refs[0]() is q_ranges and refs[1]() is k_ranges and refs[2]() is types
                    and versions == (q_ranges._version, k_ranges._version, types._version)):
                return mask
        _require_ranges(q_ranges, "q_ranges", None, 2)
        _require_ranges(k_ranges, "k_ranges", q_ranges.shape[0], 2)
        _require_ranges(types, "attn_type_map", q_ranges.shape[0], 1)
        host = [t.detach().cpu() for t in tensors]
        content = (tuple(h.numpy().tobytes() for h in host), total_q, total_k)
        mask = self.by_content.get(content)
        if mask is None:
            mask = Mask(host[0].numpy(), host[1].numpy(), host[2].numpy(), total_q, total_k)._c
            self.by_content[content] = mask
            if len(self.by_content) > self.capacity:
                self.by_content.pop(next(iter(self.by_content)))
        self.by_identity[key] = (tuple(weakref.ref(t) for t in tensors), tuple(t._version for t in tensors), mask)
        if len(self.by_identity) > self.capacity:
            self.by_identity.pop(next(iter(self.by_identity)))
        return mask


_masks = _MaskCache()
_full_types: dict = {}


def _all_full(n: int, device: torch.device) -> Tensor:
    """attn_type_map = None: one cached zeros tensor per (n, device), so the mask cache keeps hitting."""
    key = (n, device)
    t = _full_types.get(key)
    if t is None:
        t = _full_types[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return t


def _new(like: Tensor, shape=None, dtype: Optional[torch.dtype] = None) -> Tensor:
    """Every output of the ops (tests poison them through this one place); like `like` unless told otherwise.
    (empty_like is the cheapest allocation torch offers: ~0.6 us against ~1.9 for torch.empty(shape, ...).)"""
    if shape is None:
        return torch.empty_like(like, dtype=dtype)
    return like.new_empty(shape, dtype=dtype or like.dtype)


def _stream(t: Tensor) -> int:
    """torch's current stream on t's device (the raw handle; the public accessor costs ~5 us a call)."""
    return torch._C._cuda_getCurrentRawStream(t.get_device()) if t.is_cuda else 0


def _workspace(bytes_needed, like: Tensor) -> Optional[Tensor]:
    """Scratch from torch's caching allocator while a CUDA graph is being captured (so from the graph's pool,
    on whatever stream captures); otherwise None: the backend's own per-stream scratch, allocated once."""
    if not (like.is_cuda and torch._C._cuda_isCurrentStreamCapturing()):
        return None
    nbytes = bytes_needed()
    return torch.empty((nbytes + 3) // 4, dtype=torch.float32, device=like.device) if nbytes > 0 else None


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ---- the ops ----


def _forward(q, k, v, q_ranges, k_ranges, attn_type_map, sink, softmax_scale, softcap, sink_layout, deterministic,
             out_fp32, return_max_logits):
    mask = _masks.get(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0])
    out = _new(q, dtype=torch.float32 if out_fp32 else None)
    lse = _new(q, q.shape[:2], _lse_dtype(q))
    max_logits = _new(q, q.shape[1:2], torch.float32) if return_max_logits else None
    workspace = _workspace(lambda: _C.forward_workspace_bytes(q, "auto"), q)
    _C.forward(mask, q, k, v, out, lse, max_logits, sink, None, None, softmax_scale, softcap, sink_layout, "auto",
               deterministic, workspace, _stream(q))
    return out, lse, max_logits


@torch.library.custom_op("magi_attn::flex_fwd", mutates_args=())
def flex_fwd(q: Tensor, k: Tensor, v: Tensor, q_ranges: Tensor, k_ranges: Tensor, attn_type_map: Tensor,
             sink: Optional[Tensor], softmax_scale: float, softcap: float, sink_layout: str,
             deterministic: Optional[bool], out_fp32: bool, return_max_logits: bool) -> Tuple[Tensor, Tensor, Tensor]:
    out, lse, max_logits = _forward(q, k, v, q_ranges, k_ranges, attn_type_map, sink, softmax_scale, softcap,
                                    sink_layout, deterministic, out_fp32, return_max_logits)
    return out, lse, max_logits if max_logits is not None else q.new_empty(0, dtype=torch.float32)


@flex_fwd.register_fake
def _flex_fwd_fake(q, k, v, q_ranges, k_ranges, attn_type_map, sink, softmax_scale, softcap, sink_layout,
                   deterministic, out_fp32, return_max_logits):
    return (q.new_empty(q.shape, dtype=torch.float32 if out_fp32 else q.dtype),
            q.new_empty(q.shape[:2], dtype=_lse_dtype(q)),
            q.new_empty(q.shape[1] if return_max_logits else 0, dtype=torch.float32))


def _backward(do, q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, sink, softmax_scale, softcap, sink_layout,
              deterministic):
    mask = _masks.get(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0])
    dq, dk, dv = _new(q), _new(k), _new(v)
    dsink = _new(sink) if sink is not None else q.new_empty(0, dtype=torch.float32)
    workspace = _workspace(lambda: _C.backward_workspace_bytes(q, do, dq, "auto", deterministic), q)
    _C.backward(mask, q, k, v, out, lse, do, dq, dk, dv, sink, dsink if sink is not None else None, softmax_scale,
                softcap, sink_layout, "auto", deterministic, False, workspace, _stream(q))
    return dq, dk, dv, dsink


@torch.library.custom_op("magi_attn::flex_bwd", mutates_args=())
def flex_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_ranges: Tensor,
             k_ranges: Tensor, attn_type_map: Tensor, sink: Optional[Tensor], softmax_scale: float, softcap: float,
             sink_layout: str, deterministic: Optional[bool]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward(do, q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, sink, softmax_scale, softcap,
                     sink_layout, deterministic)


@flex_bwd.register_fake
def _flex_bwd_fake(do, q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, sink, softmax_scale, softcap,
                   sink_layout, deterministic):
    dsink = torch.empty_like(sink) if sink is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _setup_context(ctx, inputs, output):
    (q, k, v, q_ranges, k_ranges, attn_type_map, sink, softmax_scale, softcap, sink_layout, deterministic, _, _) = inputs
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, sink)
    ctx.options = (softmax_scale, softcap, sink_layout, deterministic)


class _FirstOrderOnly(torch.autograd.Function):
    """The gradients, unchanged, as a node whose own backward raises: differentiating them again (create_graph=True)
    must fail, where it would contribute nothing, silently. (once_differentiable does not do: its error node hangs
    off copies of the inputs, so autograd.grad(..., inputs) never reaches it.)"""

    @staticmethod
    def forward(ctx, count, *tensors):  # the first `count` tensors are the gradients, the rest what they depend on
        return tuple(t.detach() for t in tensors[:count])  # not views: the caller may change them in place

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("magi_attn: attention gradients are not differentiable (a double backward, through a "
                           "gradient taken with create_graph=True, is not supported)")


def _first_order_only(grads: tuple, *inputs) -> tuple:
    """`grads` (None where absent) tied to `inputs` (dout and the saved inputs) under create_graph=True."""
    inputs = [x for x in inputs if isinstance(x, Tensor) and x.requires_grad]
    if not torch.is_grad_enabled() or not inputs:  # create_graph=False: nothing can differentiate them
        return grads
    at = [i for i, g in enumerate(grads) if isinstance(g, Tensor)]
    tied = list(grads)
    for i, g in zip(at, _FirstOrderOnly.apply(len(at), *(grads[i] for i in at), *inputs)):
        tied[i] = g
    return tuple(tied)


def _gradients(ctx, dout, backward_fn):
    # Gradients flow through out only: lse and max_logits are statistics (as in the reference system).
    q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, sink = ctx.saved_tensors
    dq, dk, dv, dsink = backward_fn(dout.contiguous(), q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, sink,
                                    *ctx.options)
    return dq, dk, dv, None, None, None, (dsink if sink is not None else None), None, None, None, None, None, None


flex_fwd.register_autograd(lambda ctx, dout, dlse, dmax: _gradients(ctx, dout, flex_bwd), setup_context=_setup_context)


class _EagerFlexAttn(torch.autograd.Function):
    """The ops' implementation and autograd without the custom-op dispatch: what eager calls run."""

    @staticmethod
    def forward(ctx, *inputs):
        out, lse, max_logits = _forward(*inputs)
        _setup_context(ctx, inputs, (out, lse, max_logits))
        if max_logits is None:
            ctx.mark_non_differentiable(lse)
            return out, lse
        ctx.mark_non_differentiable(lse, max_logits)
        return out, lse, max_logits

    @staticmethod
    def backward(ctx, dout, *unused):
        return _first_order_only(_gradients(ctx, dout, _backward), dout, *ctx.saved_tensors)


# ---- the public function ----


_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def flex_flash_attn_func(q: Tensor, k: Tensor, v: Tensor, q_ranges: Tensor, k_ranges: Tensor,
                         attn_type_map: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                         softcap: float = 0.0, sink: Optional[Tensor] = None, sink_layout: str = "sh",
                         deterministic: bool = False, out_type: Optional[torch.dtype] = None,
                         return_max_logits: bool = False):
    """Flexible-mask attention, differentiable in q, k, v and sink. Returns (out, lse) or, with
    return_max_logits, (out, lse, max_logits).

    q [Tq, Hq, D], k / v [Tk, Hkv, D] (bf16 / fp16; fp32 / fp64 on the CPU); slice i pairs q_ranges[i] with
    k_ranges[i] ([n, 2] int32 tensors, half-open) under attn_type_map[i] (int32: 0 full, 1 causal, 2
    inv_causal, 3 bi_causal; None = all full). sink: fp32 [S, Hq] ('sh') or [Tq, S, Hq] ('ssh'). out in q's
    dtype or out_type=torch.float32; lse fp32 [Tq, Hq]; max_logits fp32 [Hq]. deterministic=True (or
    MAGI_ATTENTION_DETERMINISTIC_MODE=1) makes the backward bitwise reproducible: the same call (return_max_logits
    included, since the GPU forward then tracks exact row maxima) gives the same bits.

    Range tensors may live on the GPU: they are read once and the plan is cached by the tensor (keep passing
    the same tensors; an in-place torch operation on them is noticed, a write through `.data` is not: pass a new
    tensor then). Later calls do no host sync and allocate only through torch, so a CUDA graph can capture them.
    CPU range tensors are read on every call (their contents key the cache).
    """
    for name, x, optional in (("q", q, False), ("k", k, False), ("v", v, False), ("q_ranges", q_ranges, False),
                              ("k_ranges", k_ranges, False), ("attn_type_map", attn_type_map, True),
                              ("sink", sink, True)):
        if x is None and optional:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor{' or None' if optional else ''}, got {type(x).__name__}")
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}: tensors on {x.device.type} are not supported (allowed devices: cpu, cuda)")
        if name in ("q", "k", "v", "sink") and not x.is_contiguous():  # before outputs are allocated like them
            raise ValueError(f"{name}: must be row-major contiguous (make a contiguous copy first, e.g. .contiguous())")
    for name, x, shape in (("q", q, "[Tq, Hq, D]"), ("k", k, "[Tk, Hkv, D]"), ("v", v, "[Tk, Hkv, D]"),
                           ("q_ranges", q_ranges, "[n, 2]")):
        if x.dim() != len(shape.split(",")):
            raise ValueError(f"{name}: expected shape {shape}, got {list(x.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"q: dtype {q.dtype} is not supported (allowed: bfloat16, float16, float32, float64)")
    if attn_type_map is None:
        attn_type_map = _all_full(q_ranges.shape[0], q_ranges.device)
    _check_options(softmax_scale, softcap, sink_layout, "auto", None)
    if out_type is not None and out_type not in (q.dtype, torch.float32):
        raise ValueError(f"out_type: {out_type} is not allowed (allowed: None, q's dtype {q.dtype}, torch.float32)")
    deterministic = _flag(deterministic, "deterministic")
    return_max_logits = _flag(return_max_logits, "return_max_logits")
    # D = 0 is refused by the C++ API with the allowed values; the default scale must not divide by it first.
    scale = max(q.shape[-1], 1) ** -0.5 if softmax_scale is None else _number(softmax_scale, "softmax_scale")
    args = (q, k, v, q_ranges, k_ranges, attn_type_map, sink, scale, _number(softcap, "softcap"), sink_layout,
            True if deterministic else None, out_type == torch.float32, return_max_logits)
    if torch.compiler.is_compiling():
        results = flex_fwd(*args)
    elif (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                       or (sink is not None and sink.requires_grad))
          or getattr(_forward_ad, "_current_level", -1) >= 0):  # forward AD: torch's error, not a lost tangent
        results = _EagerFlexAttn.apply(*args)
    else:  # nothing to differentiate: the implementation straight away
        results = _forward(*args)
    return (results[0], results[1], results[2]) if return_max_logits else (results[0], results[1])
