"""Scalar element types. One table; every other module asks it instead of re-deriving facts."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np


@dataclass(frozen=True, eq=False)  # singletons: identity equality and a C-level hash
class DType:
    name: str  # numpy name, also the blob's name for it
    itemsize: int
    kind: str  # "b" bool, "i" signed, "u" unsigned, "f" float, "x" index
    cname: str  # C spelling
    count: int = 1  # lanes; > 1 for vector types made by vec()
    base: DType | None = None  # the scalar type of a vector type

    def vec(self, n: int) -> DType:
        """The n-lane vector of this scalar type (one object per (type, n), so identity works)."""
        key = (self, n)
        if key not in _VECTORS:
            _VECTORS[key] = DType(self.name, self.itemsize * n, self.kind, f"{self.name}x{n}", n,
                                  self)
        return _VECTORS[key]

    @property
    def scalar(self) -> DType:
        return self.base or self

    def __repr__(self) -> str:
        return f"dtypes.{self.name}" if self.count == 1 else f"dtypes.{self.name}.vec({self.count})"

    def __reduce__(self):
        """Unpickle to the same singleton: dtypes compare by identity."""
        return (_lookup, (self.scalar.name, self.scalar.kind, self.count))

    @property
    def np(self) -> np.dtype:
        return np.dtype(self.name)

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in "iux"

    @property
    def is_unsigned(self) -> bool:
        return self.kind == "u"

    @property
    def bits(self) -> int:
        return self.itemsize * 8

    @property
    def min(self):
        if self.kind == "b":
            return False
        if self.kind == "f":
            return -float("inf")
        return 0 if self.kind == "u" else -(1 << (self.bits - 1))

    @property
    def max(self):
        if self.kind == "b":
            return True
        if self.kind == "f":
            return float("inf")
        return (1 << self.bits) - 1 if self.kind == "u" else (1 << (self.bits - 1)) - 1


_VECTORS: dict = {}


class dtypes:
    bool = DType("bool", 1, "b", "_Bool")
    int8 = DType("int8", 1, "i", "signed char")
    int16 = DType("int16", 2, "i", "short")
    int32 = DType("int32", 4, "i", "int")
    int64 = DType("int64", 8, "i", "long long")
    uint8 = DType("uint8", 1, "u", "unsigned char")
    uint16 = DType("uint16", 2, "u", "unsigned short")
    uint32 = DType("uint32", 4, "u", "unsigned int")
    uint64 = DType("uint64", 8, "u", "unsigned long long")
    float16 = DType("float16", 2, "f", "_Float16")
    float32 = DType("float32", 4, "f", "float")
    float64 = DType("float64", 8, "f", "double")
    # Index arithmetic inside kernels. 32-bit: every buffer keel plans is < 2**31 elements, and
    # 32-bit math vectorises twice as wide on every target we render for. (C renders scalar
    # indexes pointer-wide, so addresses need no sign extension: CRenderer.dtype.)
    index = DType("int32", 4, "x", "int")
    void = DType("void", 0, "v", "void")

    all = (bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16, float32, float64)

    @staticmethod
    @cache  # asked for every argument of every launch the entry points render
    def from_np(dt) -> DType:
        name = np.dtype(dt).name
        for d in dtypes.all:
            if d.name == name:
                return d
        raise KeyError(f"no keel dtype for numpy dtype {name}")


def _lookup(name: str, kind: str, count: int) -> DType:
    scalar = dtypes.index if kind == "x" else dtypes.void if kind == "v" else \
        next(d for d in dtypes.all if d.name == name)
    return scalar.vec(count) if count > 1 else scalar

