"""Context parallelism on torch.distributed: one long sequence split over the ranks of a process group.

key = magi_attn_flex_key(...) (or magi_attn_varlen_key) plans once per (mask, shapes, group, config);
local_x = dispatch(x, key); out, lse = calc_attn(q, k, v, key) (differentiable); x = undispatch(local_x, key).
NCCL groups run on the GPUs through the library's NCCL engine (its id broadcast over the group); gloo groups
run on the CPU, the library's host collectives carried by torch.distributed. Launch with torchrun or mpirun
(init_distributed reads either's variables).
"""
from __future__ import annotations

import atexit
import datetime
import importlib
import math
import os
import weakref
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from . import _C, _build
from ._attention import _flag, _number
from ._functools import infer_attn_mask_from_cu_seqlens
from ._mask import Mask
from .torch_ops import _first_order_only

DISPATCH_ALGORITHMS = ("greedy", "greedy_swap", "locality")


# ---- launch ----


def _launcher_value(names) -> Optional[int]:
    for name in names:
        text = os.environ.get(name)
        if text is not None:
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"{name}={text!r}: not an integer") from None
    return None


def _timeout(seconds) -> float:
    value = _number(seconds, "timeout_seconds")
    if not 0 < value <= 86400 * 365:
        raise ValueError(f"timeout_seconds: {seconds} (allowed: 0 < seconds <= one year)")
    return value


def init_distributed(backend: Optional[str] = None, timeout_seconds: float = 300.0):
    """Initialises torch.distributed from the launcher: torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or mpirun
    (OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK, or PMI_RANK / PMI_SIZE), with MASTER_ADDR defaulting to
    127.0.0.1 and MASTER_PORT to 29500 (one node). backend: 'nccl' where CUDA is available, else 'gloo'. On
    GPUs each rank takes device LOCAL_RANK. Returns (rank, world_size, local_rank); a second call only
    returns them."""
    rank = _launcher_value(("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"))
    size = _launcher_value(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
    local = _launcher_value(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local if local is not None else dist.get_rank()
    if rank is None or size is None:
        raise ValueError("init_distributed: no launcher variables (allowed: run under torchrun, which sets RANK and "
                         "WORLD_SIZE, or mpirun, which sets OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE)")
    if not 0 <= rank < size:
        raise ValueError(f"init_distributed: rank {rank} is outside world size {size}")
    local = rank if local is None else local
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: {backend!r} (allowed: 'nccl', 'gloo', None)")
    if backend == "nccl":
        torch.cuda.set_device(local % torch.cuda.device_count())
    # torch._dynamo's first import (an optimizer's first use brings it) pins the default group in torch 2.x when it
    # comes after init_process_group: destroy_process_group() then leaves gloo's threads running into interpreter
    # exit, where one may take the GIL and abort the process. Imported first, it pins nothing.
    importlib.import_module("torch._dynamo")  # (an `import torch._dynamo` here would make `torch` a local name)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=_timeout(timeout_seconds)))
    return rank, size, local


# ---- communicators: one per (group, device kind) ----


class _Work:
    def __init__(self, work):
        self.work = work

    def wait(self, timeout_seconds: float):
        self.work.wait(timeout=datetime.timedelta(seconds=timeout_seconds))


def _live(group_ref):
    group = group_ref()
    if group is None:
        raise RuntimeError("cp_group: the key's process group was destroyed (torch.distributed.destroy_process_group); "
                           "make a new key on a live group")
    return group


class _TorchEngine:
    """The library's host collectives (packed uint8 buffers) carried by a torch.distributed group. It holds the
    group weakly: destroy_process_group() must end the group (and join gloo's threads) while Python still runs."""

    def __init__(self, group):
        self._group = weakref.ref(group)

    @property
    def group(self):
        return _live(self._group)

    def all_to_all_v(self, send, send_counts, recv, recv_counts):
        return _Work(dist.all_to_all_single(torch.from_numpy(recv), torch.from_numpy(send), list(recv_counts),
                                            list(send_counts), group=self.group, async_op=True))

    def allgather(self, send, recv):
        parts = list(torch.from_numpy(recv).view(dist.get_world_size(self.group), -1).unbind(0))
        dist.all_gather(parts, torch.from_numpy(send), group=self.group)

    def barrier(self):
        dist.barrier(group=self.group)


# group -> {device: communicator}. Weak: the library never keeps a group alive; when torch drops one, its
# communicators and their planned runtimes go with it (_forget).
_communicators: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _forget(comms: dict) -> None:
    for comm in comms.values():
        _C.clear_runtime_cache(comm)
    comms.clear()


def _group(cp_group):
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised (call magi_attn.init_distributed() or "
                           "torch.distributed.init_process_group first)")
    return dist.group.WORLD if cp_group is None else cp_group


def _key_device(group, device) -> torch.device:
    if device is not None:
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: {device} (allowed: cpu, cuda)")
        return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _communicator(group, device: torch.device, timeout: float):
    comms = _communicators.get(group)
    if comms is None:
        comms = _communicators[group] = {}
        weakref.finalize(group, _forget, comms)
    comm = comms.get(device)
    if comm is not None:
        return comm
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if device.type == "cuda":
        if not _build.nccl:
            raise NotImplementedError("CUDA tensors: this magi_attn was built without the NCCL engine (allowed: a gloo "
                                      "group on the CPU; rebuild with NCCL, MAGI_ATTENTION_SKIP_MAGI_ATTN_COMM_BUILD unset)")
        if "nccl" not in str(dist.get_backend(group)).lower() and "gloo" not in str(dist.get_backend(group)).lower():
            raise ValueError(f"cp_group: backend {dist.get_backend(group)} cannot broadcast the NCCL id")
        box = [_C.nccl_unique_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        comm = _C.nccl_communicator(box[0], rank, size, device.index, timeout)
    else:
        comm = _C.python_communicator(_TorchEngine(group), rank, size, f"torch.distributed:{dist.get_backend(group)}")
    comms[device] = comm
    return comm


# ---- keys ----


class DistAttnKey:
    """A planned distributed-attention problem on one process group (the runtime key of the C++ API)."""

    def __init__(self, runtime, mask: Mask, group, device: torch.device, comm, config: dict, dispatched=None):
        self._runtime, self.mask, self.device, self._comm = runtime, mask, device, comm
        self._group = weakref.ref(group)  # weak, as the engine's
        self._config = config  # make_runtime_key's options, for variants with other attention options
        self._dispatched = dispatched  # the key whose dispatch this one keeps (a new mask after dispatch), or None
        self._variants: dict = {}
        self._position_ids: dict = {}

    @property
    def group(self):
        """The process group (RuntimeError once torch.distributed has destroyed it)."""
        return _live(self._group)

    @property
    def local_q_tokens(self) -> int:
        return self._runtime.local_q_tokens

    @property
    def local_k_tokens(self) -> int:
        return self._runtime.local_k_tokens

    def summary(self) -> str:
        """Each rank's mask area against the lower bound, and the kv rows fetched against ring attention."""
        return self._runtime.summary()

    def _runtime_for(self, softmax_scale, softcap, sink_layout):
        """The runtime with these attention options (collective on first use; cached)."""
        wanted = (softmax_scale, float(softcap), sink_layout)
        if wanted == (self._config["softmax_scale"], self._config["softcap"], self._config["sink_layout"]):
            return self._runtime
        runtime = self._variants.get(wanted)
        if runtime is None:
            if self._dispatched is not None:  # the same options on the kept dispatch
                runtime = _C.make_runtime_key_for_new_mask(self._dispatched._runtime_for(*wanted), self.mask._c)
            else:
                config = dict(self._config, softmax_scale=softmax_scale, softcap=float(softcap),
                              sink_layout=sink_layout)
                runtime = _C.make_runtime_key(self.mask._c, comm=self._comm, **config)
            self._variants[wanted] = runtime
        return runtime

    def __repr__(self) -> str:
        return (f"DistAttnKey({self.mask!r}, cp={self._comm.size}, device={self.device}, "
                f"local_q_tokens={self.local_q_tokens})")


_recent: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> its latest key


def magi_attn_flex_key(q_ranges, k_ranges, attn_type_map, total_seqlen_q: int, total_seqlen_k: int,
                       num_heads_q: int, num_heads_kv: int, head_dim: int, cp_group=None, *, chunk_size: int = 512,
                       overlap_degree: int = 1, dispatch: str = "locality", softmax_scale: Optional[float] = None,
                       softcap: float = 0.0, sink_layout: Optional[str] = None, deterministic: Optional[bool] = None,
                       device=None, timeout_seconds: float = 300.0) -> DistAttnKey:
    """Plans attention over the slices (q_ranges[i], k_ranges[i], attn_type_map[i]) of a total_seqlen_q x
    total_seqlen_k sequence split over cp_group (default: the world): chunks of chunk_size tokens balanced over
    the ranks by `dispatch` (greedy, greedy_swap, locality), remote kv fetched in overlap_degree stages.
    Collective: every rank passes the same arguments. sink_layout ('sh' / 'ssh') if calc_attn gets a sink.
    device: 'cuda' (NCCL engine) or 'cpu' (host engine); default from the group's backend."""
    group = _group(cp_group)
    if dispatch not in DISPATCH_ALGORITHMS:
        raise ValueError(f"dispatch: unknown algorithm {dispatch!r} (allowed: {', '.join(DISPATCH_ALGORITHMS)})")
    if sink_layout not in (None, "sh", "ssh"):
        raise ValueError(f"sink_layout: unknown layout {sink_layout!r} (allowed: None, 'sh', 'ssh')")
    for name, value in (("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("head_dim", head_dim),
                        ("chunk_size", chunk_size), ("overlap_degree", overlap_degree)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        # The extension takes int32: past it, its own check (naming the allowed range) could not run.
        if not -2**31 <= int(value) < 2**31:
            raise ValueError(f"{name}: {int(value)} does not fit int32 (allowed: -2^31 .. 2^31-1)")
    num_heads_q, num_heads_kv, head_dim, chunk_size, overlap_degree = (
        int(x) for x in (num_heads_q, num_heads_kv, head_dim, chunk_size, overlap_degree))
    mask = Mask(q_ranges, k_ranges, attn_type_map, total_seqlen_q, total_seqlen_k)
    timeout = _timeout(timeout_seconds)
    key_device = _key_device(group, device)
    comm = _communicator(group, key_device, timeout)
    config = dict(heads_q=num_heads_q, heads_kv=num_heads_kv, head_dim=head_dim, chunk_size=chunk_size,
                  overlap_degree=overlap_degree, dispatch=dispatch,
                  softmax_scale=_number(softmax_scale, "softmax_scale", optional=True),
                  softcap=_number(softcap, "softcap"), sink_layout=sink_layout or "none", backend="auto",
                  deterministic=_flag(deterministic, "deterministic", optional=True),
                  timeout=timeout)
    runtime = _C.make_runtime_key(mask._c, comm=comm, **config)
    key = DistAttnKey(runtime, mask, group, key_device, comm, config)
    _recent[group] = key
    return key


def make_flex_key_for_new_mask_after_dispatch(q_ranges, k_ranges, attn_type_map, key: DistAttnKey) -> DistAttnKey:
    """A key for another mask over the same sequences (key.mask's totals) that keeps `key`'s dispatch, so that the
    tensors dispatched with `key` serve layers whose masks differ (calc_attn with the new key, dispatch / undispatch
    with either). Same heads, group, device and options; its own communication plan. Collective."""
    if not isinstance(key, DistAttnKey):
        raise TypeError(f"key: expected a DistAttnKey, got {type(key).__name__}")
    mask = Mask(q_ranges, k_ranges, attn_type_map, key.mask.total_q, key.mask.total_k)
    runtime = _C.make_runtime_key_for_new_mask(key._runtime, mask._c)
    new = DistAttnKey(runtime, mask, key.group, key.device, key._comm, key._config, dispatched=key)
    _recent[key.group] = new
    return new


def magi_attn_varlen_key(cu_seqlens_q, cu_seqlens_k, num_heads_q: int, num_heads_kv: int, head_dim: int,
                         cp_group=None, *, causal: bool = False, window_size=(-1, -1), **options) -> DistAttnKey:
    """magi_attn_flex_key for packed documents (cumulative lengths), full / causal / sliding window inside each."""
    q_ranges, k_ranges, types, total_q, total_k = infer_attn_mask_from_cu_seqlens(cu_seqlens_q, cu_seqlens_k, causal,
                                                                                  window_size)
    return magi_attn_flex_key(q_ranges, k_ranges, types, total_q, total_k, num_heads_q, num_heads_kv, head_dim,
                              cp_group, **options)


def magi_attn_flex_dispatch(x: Tensor, *args, **kwargs):
    """(dispatch(x, key), key) with key = magi_attn_flex_key(*args, **kwargs)."""
    key = magi_attn_flex_key(*args, **kwargs)
    return dispatch(x, key), key


def magi_attn_varlen_dispatch(x: Tensor, *args, **kwargs):
    """(dispatch(x, key), key) with key = magi_attn_varlen_key(*args, **kwargs)."""
    key = magi_attn_varlen_key(*args, **kwargs)
    return dispatch(x, key), key


def get_most_recent_key(cp_group=None) -> DistAttnKey:
    group = _group(cp_group)
    key = _recent.get(group)
    if key is None:
        raise ValueError("get_most_recent_key: no key was made on this group yet (call magi_attn_flex_key first)")
    return key


def clear_cache(cp_group=None) -> None:
    """Drops the planned runtimes and communicators (of one group, or of every group when cp_group is None). They
    also go by themselves when torch.distributed destroys their group: the library holds groups weakly."""
    if cp_group is not None and not isinstance(cp_group, dist.ProcessGroup):  # (any other value forgot nothing)
        raise TypeError(f"cp_group: expected a torch.distributed.ProcessGroup or None, got {type(cp_group).__name__}")
    for group, comms in list(_communicators.items()):
        if cp_group is None or group is cp_group:
            _forget(comms)
            del _communicators[group]
            _recent.pop(group, None)
    if cp_group is None:
        _recent.clear()
        _C.clear_runtime_cache(None)


atexit.register(clear_cache)  # groups (and their threads) end while Python still runs


def get_position_ids(key: DistAttnKey, axis: str = "q") -> Tensor:
    """Global token index of each local row (int64, on the key's device; >= the real length for padding)."""
    _check_key(key)
    ids = key._position_ids.get(axis)
    if ids is None:
        ids = key._position_ids[axis] = torch.tensor(key._runtime.position_ids(axis), dtype=torch.int64,
                                                     device=key.device)
    return ids


# ---- dispatch / undispatch / calc_attn, differentiable ----


def _stream(key: DistAttnKey) -> int:
    return torch.cuda.current_stream(key.device).cuda_stream if key.device.type == "cuda" else 0


def _check_key(key) -> None:
    if not isinstance(key, DistAttnKey):
        raise TypeError(f"key: expected a DistAttnKey (from magi_attn_flex_key / magi_attn_varlen_key), "
                        f"got {type(key).__name__}")
    _live(key._group)


def _check_tensor(x, name: str, key: DistAttnKey) -> None:
    """A tensor on the key's device, contiguous (never copied behind the caller's back), with a row axis."""
    _check_key(key)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name}: expected a tensor with a row (token) axis, got a 0-dim tensor")
    if x.device != key.device:
        raise ValueError(f"{name}: on {x.device}, but the key's tensors live on {key.device} (allowed: {key.device})")
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (make a contiguous copy first, e.g. .contiguous())")


def _dispatch(x: Tensor, key: DistAttnKey, axis: str) -> Tensor:
    tokens = key.local_q_tokens if axis == "q" else key.local_k_tokens
    local = torch.empty((tokens, *x.shape[1:]), dtype=x.dtype, device=key.device)
    _C.dispatch(key._runtime, axis, x.detach(), local, _stream(key))
    return local


def _undispatch(x: Tensor, key: DistAttnKey, axis: str) -> Tensor:
    total = key.mask.total_q if axis == "q" else key.mask.total_k
    out = torch.empty((total, *x.shape[1:]), dtype=x.dtype, device=key.device)
    _C.undispatch(key._runtime, axis, x.detach(), out, _stream(key))
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, axis):
        ctx.key, ctx.axis = key, axis
        return _dispatch(x, key, axis)

    @staticmethod
    def backward(ctx, grad):  # through the Function: a double backward (create_graph) keeps its graph
        return _Undispatch.apply(grad.contiguous(), ctx.key, ctx.axis), None, None


class _Undispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, axis):
        ctx.key, ctx.axis = key, axis
        return _undispatch(x, key, axis)

    @staticmethod
    def backward(ctx, grad):
        return _Dispatch.apply(grad.contiguous(), ctx.key, ctx.axis), None, None


def _roll(x: Tensor, key: DistAttnKey, axis: str, shift: int) -> Tensor:
    out = torch.empty_like(x)
    _C.roll(key._runtime, axis, x.detach(), out, shift, _stream(key))
    return out


class _Roll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key, axis, shift):
        ctx.key, ctx.axis, ctx.shift = key, axis, shift
        return _roll(x, key, axis, shift)

    @staticmethod
    def backward(ctx, grad):
        return _Roll.apply(grad.contiguous(), ctx.key, ctx.axis, -ctx.shift), None, None, None


def _check_axis(axis: str) -> None:
    if axis not in ("q", "k"):
        raise ValueError(f"axis: {axis!r} (allowed: 'q' for q-like tensors, 'k' for k / v when they differ)")


_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _moved_as_floats(move, x: Tensor) -> Tensor:
    """move(x) for a tensor of any dtype: dispatch moves whole rows of a float type, so other dtypes travel as their
    bytes (bit for bit: float8, bool, complex too), a row's bytes padded to an even count."""
    if x.dtype in _FLOATS:
        return move(x)
    rows = x.contiguous().view(x.shape[0], math.prod(x.shape[1:]))
    width = rows.shape[1] * x.element_size()
    rows = rows.view(torch.uint8) if width else torch.zeros(x.shape[0], 0, dtype=torch.uint8, device=x.device)
    if width % 2 or not width:
        rows = torch.cat([rows, rows.new_zeros(rows.shape[0], 2 - width % 2)], 1)
    unit = 8 if rows.shape[1] % 8 == 0 else 4 if rows.shape[1] % 4 == 0 else 2
    moved = move(rows.view({8: torch.float64, 4: torch.float32, 2: torch.float16}[unit])).view(torch.uint8)
    if not width:  # rows of no elements: only their count moved
        return x.new_empty((moved.shape[0], *x.shape[1:]))
    return moved[:, :width].contiguous().view(x.dtype).view(moved.shape[0], *x.shape[1:])


def dispatch(x: Tensor, key: DistAttnKey, axis: str = "q") -> Tensor:
    """This rank's rows of the global tensor x [T, ...] (T = total_seqlen_q, or total_seqlen_k with axis='k'),
    padding rows zero. Any dtype (token ids, labels too). Differentiable: the gradient is undispatched
    (gathered from every rank)."""
    _check_axis(axis)
    _check_tensor(x, "x", key)
    if x.is_complex():  # as float (real, imaginary) pairs: differentiable, and a lazy conj() resolved
        return torch.view_as_complex(dispatch(torch.view_as_real(x.resolve_conj()), key, axis))
    if x.dtype not in _FLOATS:
        return _moved_as_floats(lambda rows: _dispatch(rows, key, axis), x)
    return _Dispatch.apply(x, key, axis)


def roll(x: Tensor, shift: int, key: DistAttnKey, axis: str = "q") -> Tensor:
    """torch.roll(global, shift, 0) of a dispatched tensor, without undispatching it: the local rows of the rolled
    global tensor (e.g. labels for multi-token prediction: shift=-1), padding rows zero. Any dtype. Differentiable
    (the gradient is rolled back). Collective; host or device tensors."""
    _check_axis(axis)
    _check_tensor(x, "x", key)
    if isinstance(shift, bool) or not isinstance(shift, (int, np.integer)):
        raise TypeError(f"shift: expected an int, got {type(shift).__name__}")
    total = key.mask.total_q if axis == "q" else key.mask.total_k
    shift = int(shift) % total if total else 0  # a roll by the length is none (the extension takes int64)
    if x.is_complex():  # as float (real, imaginary) pairs: differentiable, and a lazy conj() resolved
        return torch.view_as_complex(roll(torch.view_as_real(x.resolve_conj()), shift, key, axis))
    if x.dtype not in _FLOATS:
        return _moved_as_floats(lambda rows: _roll(rows, key, axis, shift), x)
    return _Roll.apply(x, key, axis, shift)


def undispatch(x: Tensor, key: DistAttnKey, axis: str = "q") -> Tensor:
    """Collective inverse of dispatch: every rank gets the global tensor. Differentiable (gradient dispatched)."""
    _check_axis(axis)
    _check_tensor(x, "x", key)
    if x.is_complex():  # as float (real, imaginary) pairs: differentiable, and a lazy conj() resolved
        return torch.view_as_complex(undispatch(torch.view_as_real(x.resolve_conj()), key, axis))
    if x.dtype not in _FLOATS:
        return _moved_as_floats(lambda rows: _undispatch(rows, key, axis), x)
    return _Undispatch.apply(x, key, axis)


class _CalcAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, runtime, key, return_max_logits):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                          device=q.device)
        max_logits = torch.empty(q.shape[1], dtype=torch.float32, device=q.device) if return_max_logits else None
        _C.calc_attn(runtime, q.detach(), k.detach(), v.detach(), out, lse, max_logits,
                     None if sink is None else sink.detach(), _stream(key))
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.runtime, ctx.key = runtime, key
        ctx.mark_non_differentiable(lse)
        if max_logits is not None:
            ctx.mark_non_differentiable(max_logits)
            return out, lse, max_logits
        return out, lse

    @staticmethod
    def backward(ctx, dout, *unused):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsink = torch.empty_like(sink) if sink is not None else None
        _C.calc_attn_backward(ctx.runtime, q.detach(), k.detach(), v.detach(), out, lse, dout.contiguous(), dq, dk, dv,
                              None if sink is None else sink.detach(), dsink, _stream(ctx.key))
        return _first_order_only((dq, dk, dv, dsink, None, None, None), dout, q, k, v, sink)


def calc_attn(q: Tensor, k: Tensor, v: Tensor, key: DistAttnKey, sink: Optional[Tensor] = None,
              sink_layout: Optional[str] = None, softmax_scale: Optional[float] = None, softcap: Optional[float] = None,
              return_max_logits: bool = False):
    """Distributed attention on dispatched tensors: local q [Lq, Hq, D], k / v [Lk, Hkv, D] -> (out, lse) equal to
    the local rows of the single-device result (and max_logits [Hq], the global maximum, when asked).
    Differentiable in q, k, v and sink. sink: 'sh' [S, Hq] (the same on every rank; its gradient is this rank's
    part unless MAGI_ATTENTION_DSINK_ALL_REDUCE_OP says otherwise) or 'ssh' [Lq, S, Hq] (dispatched).
    sink_layout / softmax_scale / softcap default to the key's; other values plan a variant once (collective)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(x, name, key)
    if sink is not None:
        _check_tensor(sink, "sink", key)
    layout = sink_layout or (key._config["sink_layout"] if key._config["sink_layout"] != "none" else "sh")
    if sink is None:
        layout = "none"
    elif layout not in ("sh", "ssh"):
        raise ValueError(f"sink_layout: unknown layout {layout!r} (allowed: 'sh', 'ssh')")
    scale = key._config["softmax_scale"] if softmax_scale is None else _number(softmax_scale, "softmax_scale")
    cap = key._config["softcap"] if softcap is None else _number(softcap, "softcap")
    runtime = key._runtime_for(scale, cap, layout)
    return _CalcAttn.apply(q, k, v, sink, runtime, key, _flag(return_max_logits, "return_max_logits"))
