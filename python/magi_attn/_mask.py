"""Masks as lists of slices (q_range, k_range, type): the Python face of include/magi/mask.hpp."""
from __future__ import annotations

import os

import numpy as np

from . import _C

TYPE_NAMES = ("full", "causal", "inv_causal", "bi_causal")  # ids 0..3
_TYPE_IDS = {name: i for i, name in enumerate(TYPE_NAMES)}


def _host_array(x, name: str) -> np.ndarray:
    """Any sequence or array (numpy, torch on any device, JAX, ...) as a numpy array on the host."""
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except Exception as e:  # ragged lists, objects without an array form
        raise TypeError(f"{name}: expected an array or a sequence of numbers, got {type(x).__name__} ({e})") from None


def _integers(x, name: str) -> np.ndarray:
    if x is None:
        raise TypeError(f"{name}: expected an array or a sequence of integers, got None")
    a = _host_array(x, name)
    if a.size and a.dtype == object and all(isinstance(v, int) and not isinstance(v, bool) for v in a.ravel()):
        big = max((int(v) for v in a.ravel()), key=abs)  # Python ints past int64 (numpy keeps them as objects)
        raise ValueError(f"{name}: {big} does not fit int64 (allowed: -2^63 .. 2^63-1)")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if a.size and a.dtype.kind == "u" and int(a.max()) >= 2**63:  # would wrap to a negative int64
        raise ValueError(f"{name}: {int(a.max())} does not fit int64 (allowed: -2^63 .. 2^63-1)")
    return a.astype(np.int64, copy=False)


def _pairs(x, name: str) -> np.ndarray:
    a = _integers(x, name)
    if a.shape == (0,):  # [] (no slices); other empty shapes ([1, 0], [0, 3]) are wrong shapes
        a = a.reshape(0, 2)
    if a.ndim != 2 or a.shape[1] != 2:
        raise ValueError(f"{name}: expected shape [n, 2] (one [start, end) pair per slice), got {list(a.shape)}")
    return np.ascontiguousarray(a)


def type_id(t, name: str) -> int:
    """A mask type given as a name ('full', 'causal', 'inv_causal', 'bi_causal', any case) or an id 0..3."""
    if isinstance(t, str):
        tid = _TYPE_IDS.get(t.lower())
        if tid is None and t.isdigit():
            tid = int(t)
    elif isinstance(t, (int, np.integer)) and not isinstance(t, bool):
        tid = int(t)
    else:
        raise TypeError(f"{name}: expected a mask type name or id, got {type(t).__name__}")
    if tid is None or not 0 <= tid <= 3:
        raise ValueError(f"{name}: unknown mask type {t!r} (allowed: full, causal, inv_causal, bi_causal or 0..3)")
    return tid


def _types(types, n: int, name: str) -> np.ndarray:
    if types is None:
        return np.zeros(n, dtype=np.int64)
    if isinstance(types, (str, int, np.integer)):
        return np.full(n, type_id(types, name), dtype=np.int64)
    if isinstance(types, (dict, set, frozenset)):  # no order to pair with the slices
        raise TypeError(f"{name}: expected one type per slice in order (a list or array), got {type(types).__name__}")
    if hasattr(types, "__array__") or hasattr(types, "__dlpack__") or type(types).__module__.startswith("torch"):
        if getattr(getattr(types, "dtype", None), "kind", None) in ("U", "S", "O"):  # names, as a list takes them
            if types.ndim != 1:
                raise ValueError(f"{name}: expected shape [n] (one type per slice), got {list(types.shape)}")
            return _types(types.tolist(), n, name)
        a = _integers(types, name)
        if a.ndim != 1:
            raise ValueError(f"{name}: expected shape [n] (one type per slice), got {list(a.shape)}")
        for i, t in enumerate(a.tolist()):
            type_id(t, f"{name}[{i}]")
        return np.ascontiguousarray(a)
    return np.array([type_id(t, f"{name}[{i}]") for i, t in enumerate(types)], dtype=np.int64)


def _optional_size(value, name: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}")
    return _int64(int(value), name)


class Mask:
    """An attention mask: slices (q_range [qs, qe), k_range [ks, ke), type) over total_q x total_k tokens.

    Types: full, causal (bottom-right aligned), inv_causal (top-left aligned), bi_causal (both), by name or id.
    Slices may share query rows (their keys merge exactly); their kept areas must not overlap. Totals default
    to the largest range end. Invalid masks raise ValueError naming the slice.
    """

    __slots__ = ("_c",)

    def __init__(self, q_ranges, k_ranges, types=None, total_q=None, total_k=None):
        qr, kr = _pairs(q_ranges, "q_ranges"), _pairs(k_ranges, "k_ranges")
        tm = _types(types, len(qr), "types")
        self._c = _C.Mask.from_arrays(qr, kr, tm, _optional_size(total_q, "total_q"),
                                      _optional_size(total_k, "total_k"))

    @classmethod
    def _wrap(cls, c) -> "Mask":
        mask = cls.__new__(cls)
        mask._c = c
        return mask

    @classmethod
    def from_json(cls, text: str) -> "Mask":
        """{"q_ranges": [[s, e], ...], "k_ranges": [...], "attn_type_map": [0 | "causal", ...], "total_q"?, "total_k"?}"""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a JSON string, got {type(text).__name__}")
        return cls._wrap(_C.Mask.from_json(text))

    def to_json(self) -> str:
        return self._c.to_json()

    def describe(self) -> str:
        """Slices, area, density and a text picture (what `magi-attn mask` prints)."""
        return self._c.describe()

    def to_png(self, path) -> None:
        """A picture: white = kept, black = masked, grey = partly kept where downsampled (<= 1024 px a side)."""
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}")
        path = os.fspath(path)
        if not isinstance(path, str) or "\0" in path:
            raise ValueError(f"path: {path!r} is not a file name (allowed: text without NUL characters)")
        self._c.to_png(path)

    @property
    def total_q(self) -> int:
        return self._c.total_q

    @property
    def total_k(self) -> int:
        return self._c.total_k

    @property
    def area(self) -> int:
        """Number of kept (q, k) cells."""
        return self._c.area

    @property
    def density(self) -> float:
        return self._c.density

    @property
    def q_ranges(self) -> np.ndarray:
        return self._c.q_ranges

    @property
    def k_ranges(self) -> np.ndarray:
        return self._c.k_ranges

    @property
    def attn_type_map(self) -> np.ndarray:
        return self._c.attn_type_map

    @property
    def types(self) -> list:
        return [TYPE_NAMES[t] for t in self._c.attn_type_map.tolist()]

    def __len__(self) -> int:
        return len(self._c)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mask) and self._c == other._c

    __hash__ = None

    def __repr__(self) -> str:
        return f"Mask({len(self)} slices, total_q={self.total_q}, total_k={self.total_k}, area={self.area})"


def _cu(x, name: str) -> list:
    a = _integers(x, name)
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got shape {list(a.shape)}")
    if a.size and (a.min() < -2**31 or a.max() >= 2**31):
        raise ValueError(f"{name}: values must fit int32")
    return a.tolist()


def _size(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return _int64(int(value), name)


def _int64(value: int, name: str) -> int:
    """The C++ side takes int64 and checks its own bounds, naming the argument; past int64 it could not."""
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{name}: {value} does not fit int64 (allowed: -2^63 .. 2^63-1)")
    return value


class masks:  # noqa: N801 (a namespace, as in C++)
    """The builders of include/magi/mask.hpp (same names); each returns a valid Mask."""

    @staticmethod
    def full(total_q: int, total_k: int | None = None) -> Mask:
        tq = _size(total_q, "total_q")
        return Mask._wrap(_C.masks.full(tq, tq if total_k is None else _size(total_k, "total_k")))

    @staticmethod
    def causal(total_q: int, total_k: int | None = None) -> Mask:
        """k <= q + (total_k - total_q): bottom-right aligned."""
        tq = _size(total_q, "total_q")
        return Mask._wrap(_C.masks.causal(tq, tq if total_k is None else _size(total_k, "total_k")))

    @staticmethod
    def varlen_full(cu_seqlens_q, cu_seqlens_k=None) -> Mask:
        """Documents from cumulative lengths (starting at 0); q and k share them unless cu_seqlens_k is given."""
        q = _cu(cu_seqlens_q, "cu_seqlens_q")
        return Mask._wrap(_C.masks.varlen_full(q, q if cu_seqlens_k is None else _cu(cu_seqlens_k, "cu_seqlens_k")))

    @staticmethod
    def varlen_causal(cu_seqlens_q, cu_seqlens_k=None) -> Mask:
        q = _cu(cu_seqlens_q, "cu_seqlens_q")
        return Mask._wrap(_C.masks.varlen_causal(q, q if cu_seqlens_k is None else _cu(cu_seqlens_k, "cu_seqlens_k")))

    @staticmethod
    def sliding_window(total: int, left: int, right: int = 0) -> Mask:
        """Query q keeps q - left <= k <= q + right (negative = unbounded)."""
        return Mask._wrap(_C.masks.sliding_window(_size(total, "total"), _size(left, "left"), _size(right, "right")))

    @staticmethod
    def varlen_sliding_window(cu_seqlens, left: int, right: int = 0) -> Mask:
        return Mask._wrap(_C.masks.varlen_sliding_window(_cu(cu_seqlens, "cu_seqlens"), _size(left, "left"),
                                                         _size(right, "right")))

    @staticmethod
    def block_causal(total: int, block: int) -> Mask:
        return Mask._wrap(_C.masks.block_causal(_size(total, "total"), _size(block, "block")))

    @staticmethod
    def varlen_block_causal(cu_seqlens, block: int) -> Mask:
        return Mask._wrap(_C.masks.varlen_block_causal(_cu(cu_seqlens, "cu_seqlens"), _size(block, "block")))

    @staticmethod
    def shared_question(question: int, answers) -> Mask:
        return Mask._wrap(_C.masks.shared_question(_size(question, "question"), _cu(answers, "answers")))

    @staticmethod
    def global_sliding_window(total: int, global_tokens: int, window: int) -> Mask:
        return Mask._wrap(_C.masks.global_sliding_window(_size(total, "total"), _size(global_tokens, "global_tokens"),
                                                         _size(window, "window")))
