"""magi_attn: attention whose mask is any list of (q_range, k_range, type) slices, on CPUs and GPUs, and
context parallelism over many GPUs. A Python layer over the C++ library (include/magi/).

Framework-neutral (numpy, torch, JAX, CuPy or any DLPack producer, CPU or CUDA, zero-copy):
    mask = magi_attn.Mask(q_ranges=[[0, 512], [512, 1024]], k_ranges=[[0, 512], [0, 1024]],
                          types=["full", "causal"])
    out, lse = magi_attn.forward(mask, q, k, v)
    dq, dk, dv = magi_attn.backward(mask, q, k, v, out, lse, do)
torch (autograd, torch.compile, CUDA graphs): magi_attn.flex_flash_attn_func(...)
Context parallelism on torch.distributed: magi_attn.magi_attn_flex_key(...), dispatch, calc_attn, undispatch.
"""
import atexit as _atexit
import importlib as _importlib
import importlib.util as _importlib_util
import sys as _sys

from . import _build

if _build.nccl and "torch" not in _sys.modules and _importlib_util.find_spec("torch") is not None:
    # The extension links NCCL by its soname; loading torch first makes its NCCL the one both use.
    import torch as _torch  # noqa: F401

from . import _C

# Cached distributed runtimes hold communicators driven from Python: release them while Python still runs.
_atexit.register(_C.clear_runtime_cache, None)
from ._attention import backward, forward
from ._functools import (compute_pad_size, infer_attn_mask_from_cu_seqlens, infer_attn_mask_from_sliding_window,
                         squash_batch_dim)
from ._mask import Mask, masks

CommError = _C.CommError
__version__ = _build.version

# Names that need torch, imported on first use so that numpy or JAX users never load it.
_TORCH_NAMES = {
    "flex_flash_attn_func": "torch_ops",
    "magi_attn_flex_key": "distributed",
    "magi_attn_varlen_key": "distributed",
    "make_flex_key_for_new_mask_after_dispatch": "distributed",
    "magi_attn_flex_dispatch": "distributed",
    "magi_attn_varlen_dispatch": "distributed",
    "dispatch": "distributed",
    "undispatch": "distributed",
    "roll": "distributed",
    "calc_attn": "distributed",
    "get_position_ids": "distributed",
    "get_most_recent_key": "distributed",
    "clear_cache": "distributed",
    "init_distributed": "distributed",
    "DistAttnKey": "distributed",
}


def __getattr__(name):
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'magi_attn' has no attribute '{name}'")
    return getattr(_importlib.import_module(f".{module}", __name__), name)


def env_table() -> str:
    """Every MAGI_ATTENTION_* variable with its type, default, status and current value (as `magi-attn env`)."""
    return _C.env_table()


def build_info() -> dict:
    """What this installation was built with: version, CUDA kernels, their architectures and head-dim tiles (head
    dims up to the largest tile run, multiples of 8), NCCL engine."""
    return {"version": _build.version, "cuda": _build.cuda, "cuda_architectures": _build.cuda_architectures,
            "cuda_head_dim_tiles": [int(t) for t in _build.cuda_head_dim_tiles.split(",") if t],
            "nccl": _build.nccl}


__all__ = ["Mask", "masks", "forward", "backward", "CommError", "env_table", "build_info",
           "infer_attn_mask_from_cu_seqlens", "infer_attn_mask_from_sliding_window", "compute_pad_size",
           "squash_batch_dim", *_TORCH_NAMES]
