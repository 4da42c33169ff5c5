"""A msgpack decoder for the AMDGPU code object's metadata note (NT_AMDGPU_METADATA).

Only what the msgpack spec defines is decoded (nil, bool, ints, floats, str, bin, array, map);
the ext types never appear in AMDGPU metadata and are refused. Malformed or truncated input is a
ValueError naming the offset, never an IndexError deep inside.
"""
from __future__ import annotations

import struct

# first byte -> (struct format of the fixed-size value, or the kind of length prefix)
_FIXED = {0xc2: False, 0xc3: True}
_NUMS = {0xca: ">f", 0xcb: ">d", 0xcc: ">B", 0xcd: ">H", 0xce: ">I", 0xcf: ">Q",
         0xd0: ">b", 0xd1: ">h", 0xd2: ">i", 0xd3: ">q"}
_LENGTHS = {0xd9: ("str", ">B"), 0xda: ("str", ">H"), 0xdb: ("str", ">I"),
            0xc4: ("bin", ">B"), 0xc5: ("bin", ">H"), 0xc6: ("bin", ">I"),
            0xdc: ("array", ">H"), 0xdd: ("array", ">I"), 0xde: ("map", ">H"), 0xdf: ("map", ">I")}


def unpack(data: bytes):
    """The single msgpack value that is all of `data`."""
    value, end = _value(memoryview(data), 0)
    if end != len(data):
        raise ValueError(f"msgpack: {len(data) - end} trailing bytes after the value at {end}")
    return value


def _take(data: memoryview, pos: int, fmt: str) -> tuple:
    size = struct.calcsize(fmt)
    if pos + size > len(data):
        raise ValueError(f"msgpack: truncated at byte {pos}: need {size} more, have "
                         f"{len(data) - pos}")
    return struct.unpack_from(fmt, data, pos)[0], pos + size


def _value(data: memoryview, pos: int):
    b, pos = _take(data, pos, ">B")
    if b <= 0x7f or b >= 0xe0:  # positive / negative fixint
        return (b if b <= 0x7f else b - 0x100), pos
    if b == 0xc0:
        return None, pos
    if b in _FIXED:
        return _FIXED[b], pos
    if b in _NUMS:
        return _take(data, pos, _NUMS[b])
    if 0xa0 <= b <= 0xbf:
        kind, n = "str", b & 0x1f
    elif 0x90 <= b <= 0x9f:
        kind, n = "array", b & 0x0f
    elif 0x80 <= b <= 0x8f:
        kind, n = "map", b & 0x0f
    elif b in _LENGTHS:
        kind, fmt = _LENGTHS[b]
        n, pos = _take(data, pos, fmt)
    else:
        raise ValueError(f"msgpack: unsupported type byte 0x{b:02x} at {pos - 1}")
    return _compound(data, pos, kind, n)


def _compound(data: memoryview, pos: int, kind: str, n: int):
    if kind in ("str", "bin"):
        if pos + n > len(data):
            raise ValueError(f"msgpack: {kind} of {n} bytes at {pos} runs past the end")
        raw = bytes(data[pos:pos + n])
        return (raw.decode() if kind == "str" else raw), pos + n
    items = []
    for _ in range(n * (2 if kind == "map" else 1)):
        item, pos = _value(data, pos)
        items.append(item)
    if kind == "array":
        return items, pos
    keys = items[0::2]
    if any(isinstance(k, (list, dict)) for k in keys):
        raise ValueError(f"msgpack: map before {pos} has a container as a key")
    return dict(zip(keys, items[1::2])), pos
