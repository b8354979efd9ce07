"""Arrays of the caller's framework: which framework an input belongs to, outputs allocated in it on the same
device, and the stream a GPU call runs on. The extension reads every array through DLPack, zero-copy."""
from __future__ import annotations

import importlib
import sys

import numpy as np

from . import _C

DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp64")
_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
            "fp32": "fp32", "float32": "fp32", "float": "fp32", "fp64": "fp64", "float64": "fp64", "double": "fp64"}


def dtype_name(dtype, name: str) -> str:
    """'bf16' | 'fp16' | 'fp32' | 'fp64' from a name or a numpy / torch / JAX / CuPy dtype."""
    text = str(dtype).lower()
    if text.startswith("<class '"):  # a scalar type: numpy.float32, jax.numpy.float32, ml_dtypes.bfloat16
        text = text.rsplit(".", 1)[-1]
    for prefix in ("torch.", "dtype('"):
        text = text.removeprefix(prefix)
    text = text.rstrip("')>")
    if text in _ALIASES:
        return _ALIASES[text]
    raise ValueError(f"{name}: unknown dtype {dtype!r} (allowed: bfloat16, float16, float32, float64)")


class Framework:
    """How to allocate and order work for arrays like `like` (one framework's conventions)."""

    def __init__(self, kind: str, module):
        self.kind, self.module = kind, module

    # -- inspection --
    def device(self, x) -> tuple:
        """('cpu' | 'cuda', index)."""
        if self.kind == "torch":
            return (x.device.type if x.device.type in ("cpu", "cuda") else x.device.type, x.device.index or 0)
        dev_type, index = x.__dlpack_device__()
        return ("cuda", int(index)) if int(dev_type) == 2 else ("cpu", 0)

    def dtype(self, x, name: str) -> str:
        return dtype_name(x.dtype, name)

    def shape(self, x) -> tuple:
        return tuple(int(s) for s in x.shape)

    def contiguous(self, x) -> bool:
        """Row-major contiguous as far as the framework tells (numpy and CuPy flags, torch); True where it cannot
        (the extension checks every array again)."""
        if self.kind == "torch":
            return x.is_contiguous()
        flags = getattr(x, "flags", None)
        return bool(getattr(flags, "c_contiguous", True))

    def for_extension(self, x):
        """The object the extension reads through DLPack (torch: detached, so tensors needing grad pass). By the
        array's own type, not q's framework: the other inputs may come from another DLPack framework."""
        return x.detach() if type(x).__module__.split(".")[0] == "torch" else x

    # -- allocation and streams --
    def empty(self, shape, dtype: str, device: tuple):
        """A new array of this framework, or (for frameworks without mutable arrays) a library array that
        `wrap` turns into one after the call."""
        if self.kind == "torch":
            import torch
            return torch.empty(shape, dtype=_TORCH_DTYPES[dtype](), device=torch.device(*device))
        if self.kind == "numpy" and dtype != "bf16":
            return np.empty(shape, dtype=np.dtype({"fp16": "float16", "fp32": "float32", "fp64": "float64"}[dtype]))
        if self.kind == "cupy" and dtype != "bf16":
            with self.module.cuda.Device(device[1]):
                return self.module.empty(shape, dtype={"fp16": "float16", "fp32": "float32", "fp64": "float64"}[dtype])
        return _C.empty(list(shape), dtype, device[0], device[1])

    def wrap(self, array):
        """An array from `empty` as this framework's array (zero-copy)."""
        if type(array).__module__.split(".")[0] == self.kind:
            return array
        if self.kind == "jax":
            import jax.dlpack
            return jax.dlpack.from_dlpack(array)
        if self.kind == "numpy":
            return np.from_dlpack(array)
        from_dlpack = getattr(self.module, "from_dlpack", None)
        return from_dlpack(array) if from_dlpack is not None else array

    def stream(self, device: tuple) -> int:
        """The stream the call runs on (0 = the legacy default stream); host arrays: 0."""
        if device[0] != "cuda":
            return 0
        if self.kind == "torch":
            import torch
            return torch._C._cuda_getCurrentRawStream(device[1])  # the public accessor costs ~5 us
        if self.kind == "cupy":
            return self.module.cuda.get_current_stream().ptr
        return 0

    def finish(self, device: tuple, stream: int) -> None:
        """Frameworks that do not order by streams (JAX, other DLPack producers) get finished results."""
        if device[0] == "cuda" and self.kind not in ("torch", "cupy"):
            _C.cuda_synchronize(device[1], stream)


def _torch_dtype(name):
    def get():
        import torch
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[name]
    return get


_TORCH_DTYPES = {name: _torch_dtype(name) for name in DTYPE_NAMES}
_FRAMEWORKS: dict = {}


def framework_of(x, name: str) -> Framework:
    """The framework of array `x`; TypeError naming `name` for anything that is not an array."""
    top = type(x).__module__.split(".")[0]
    # Not every object of an array module is an array (numpy scalars, torch.Size, JAX tracers).
    if not (hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__") and hasattr(x, "shape")):
        got = type(x).__name__ if top == "builtins" else f"{type(x).__module__}.{type(x).__name__}"
        raise TypeError(f"{name}: expected an array (numpy, torch, JAX, CuPy or any DLPack producer), got {got}")
    kind = {"torch": "torch", "numpy": "numpy", "cupy": "cupy", "jax": "jax", "jaxlib": "jax"}.get(top, top)
    fw = _FRAMEWORKS.get(kind)
    if fw is None:
        fw = _FRAMEWORKS[kind] = Framework(kind, sys.modules.get(kind) or importlib.import_module(kind))
    return fw
