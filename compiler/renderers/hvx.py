"""HVX text for the C renderer on `hvx` targets (Hexagon v65, 128-byte vectors): clang's
builtins for what plain C vectors cannot say."""


def l2fetch(address: str, width: int, height: int, stride: int) -> str:
    """Boxes of up to 255 rows take the 32-bit descriptor (stride 31:16, width 15:8, height
    7:0), larger ones the 64-bit one (stride 47:32, width 31:16, height 15:0). clang's builtin,
    not inline asm: a volatile asm statement bounds the scheduler's region and costs packets where
    the builtin saves them (docs/perf.md, "Issue 36, item 2")."""
    if width < 256 and height < 256:
        return f"__builtin_HEXAGON_Y4_l2fetch((void *)({address}), " \
               f"0x{stride << 16 | width << 8 | height:x}u);"
    return f"__builtin_HEXAGON_Y5_l2fetch((void *)({address}), " \
           f"0x{stride << 32 | width << 16 | height:x}ull);"


def fill32(v: str, n: int) -> str:
    """An n-lane 32-bit vector (n <= 32) repeated to fill a 128-byte HVX register."""
    return v if n == 32 else \
        f"__builtin_shufflevector({v}, {v}, {', '.join(str(i % n) for i in range(32))})"


def first(v: str, n: int) -> str:
    """The first n lanes of a 32-lane vector."""
    return v if n == 32 else f"__builtin_shufflevector({v}, {v}, {', '.join(map(str, range(n)))})"
