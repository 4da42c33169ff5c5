"""GPU virtual memory: VM context 0's four-level page table, built on the host and copied into
VRAM by the driver (am/driver.py); the mock MMU (sim/am/mock_device.py's Space) walks the same
bytes.

gfx11's walk (gmc_v11_0.c with amdgpu_vm.h; tinygrad's AM driver programs the same on an RX
7900): GCVM_CONTEXT0_CNTL PAGE_TABLE_DEPTH 3, PAGE_TABLE_BLOCK_SIZE 0, so a 48-bit address,
taken relative to PAGE_TABLE_START_ADDR, is split 9/9/9/9/12: PDB2 (bits 47:39) -> PDB1
(38:30) -> PDB0 (29:21) -> PTB (20:12) -> the 4 KiB page. Every table is 512 64-bit entries
(4 KiB). A directory entry is the next table's physical address | VALID (gmc_v11_0_get_vm_pde
turns it into a physical one: the VRAM offset plus GCMC_VM_FB_OFFSET). A leaf has VALID,
SYSTEM, SNOOPED, EXECUTABLE, READABLE, WRITEABLE (bits 0, 1, 2, 4, 5, 6) and the page's
address in 47:12. A PDB0 entry with AMDGPU_PDE_PTE (bit 54, gfx10/11; gfx12 moved it to 63)
is itself the leaf of a 2 MiB page, so a 2 MiB-aligned run of VRAM needs no PTB. The fragment
field (AMDGPU_PTE_FRAG, bits 11:7, a TLB hint) is left 0: always correct, never faster.
"""
from __future__ import annotations

from runner.errors import DeviceError

PAGE, ENTRIES = 4096, 512
SHIFTS = (39, 30, 21, 12)  # PDB2, PDB1, PDB0, PTB: the address bits each level indexes from
DEPTH = len(SHIFTS) - 1  # GCVM_CONTEXT0_CNTL.PAGE_TABLE_DEPTH
HUGE = 1 << 21  # a PDB0 leaf maps this much
VALID, SYSTEM, SNOOPED = 1, 1 << 1, 1 << 2
EXECUTABLE, READABLE, WRITEABLE = 1 << 4, 1 << 5, 1 << 6
PDE_PTE = 1 << 54
ADDRESS = ((1 << 48) - 1) & ~0xFFF
RWX = VALID | EXECUTABLE | READABLE | WRITEABLE


def index(rel: int, level: int, depth: int = DEPTH) -> int:
    """The entry `rel` (an offset from PAGE_TABLE_START_ADDR) uses at `level` (0 = root) of a
    table `depth` levels deep; the root takes every bit above it (depth 0: a flat table)."""
    shift = 12 + 9 * (depth - level)
    return rel >> shift if level == 0 else rel >> shift & (ENTRIES - 1)


class PageTable:
    """Tables live in a VRAM pool at [pool, pool + pool_bytes) (VRAM offsets); `phys` is added to
    a table's offset wherever an entry names it (GCMC_VM_FB_OFFSET). Changes are kept as writes
    the driver has still to make: `fresh()` pages (new tables, whole: VRAM holds garbage) and
    `spans()` of changed entries."""

    def __init__(self, start: int, pool: int, pool_bytes: int, phys: int = 0):
        self.start, self.pool, self.end, self.phys = start, pool, pool + pool_bytes, phys
        self.tables: dict[int, bytearray] = {}
        self.new: list[int] = []
        self.changed: dict[int, list[int]] = {}  # table -> [first, last] changed entry
        self.root = self._table()

    def _table(self) -> int:
        at = self.pool + PAGE * len(self.tables)
        if at + PAGE > self.end:
            raise DeviceError(f"GPU page tables: the {(self.end - self.pool) >> 10} KiB pool is "
                              f"full ({len(self.tables)} tables)")
        self.tables[at] = bytearray(PAGE)
        self.new.append(at)
        return at

    def _set(self, table: int, i: int, entry: int) -> None:
        self.tables[table][8 * i:8 * i + 8] = entry.to_bytes(8, "little")
        span = self.changed.setdefault(table, [i, i])
        span[0], span[1] = min(span[0], i), max(span[1], i)

    def entry(self, table: int, i: int) -> int:
        return int.from_bytes(self.tables[table][8 * i:8 * i + 8], "little")

    def map(self, va: int, addr: int, n: int, flags: int) -> None:
        """[va, va + n) -> [addr, addr + n): 2 MiB PDB0 leaves where both are 2 MiB aligned and
        the run covers the page, 4 KiB PTEs elsewhere. `addr` is a physical VRAM address, or a
        bus address with SYSTEM in `flags`."""
        if va % PAGE or addr % PAGE or va < self.start:
            raise ValueError(f"map 0x{va:x} -> 0x{addr:x}: expected page-aligned addresses at "
                             f"or above 0x{self.start:x}")
        done = 0
        while done < n:
            v, a = va + done, addr + done
            huge = v % HUGE == 0 and a % HUGE == 0 and n - done >= HUGE
            table = self._walk(v - self.start, 2 if huge else 3)
            leaf = a & ADDRESS | flags | (PDE_PTE if huge else 0)
            self._set(table, index(v - self.start, 2 if huge else 3), leaf)
            done += HUGE if huge else PAGE

    def _walk(self, rel: int, level: int) -> int:
        """The table at `level` on `rel`'s path, making the directories down to it."""
        table = self.root
        for lv in range(level):
            i = index(rel, lv)
            e = self.entry(table, i)
            if e & PDE_PTE:
                raise ValueError(f"0x{self.start + rel:x} is inside a 2 MiB page already mapped")
            if not e & VALID:
                nxt = self._table()
                self._set(table, i, self.phys + nxt | VALID)
                e = self.entry(table, i)
            table = (e & ADDRESS) - self.phys
        return table

    def fresh(self) -> list[tuple[int, bytes]]:
        """(VRAM offset, 4 KiB) of every table made since the last call: whole, zeros and all."""
        out = [(t, bytes(self.tables[t])) for t in self.new]
        for t in self.new:
            self.changed.pop(t, None)
        self.new = []
        return out

    def spans(self, new_too: bool = False) -> list[tuple[int, bytes]]:
        """(VRAM offset, bytes) of the changed entries of tables already in VRAM; `new_too`:
        of new tables as well, which stay for `fresh()` (the bring-up writes just the entries
        before anything can clear whole tables)."""
        out = [(t + 8 * lo, bytes(self.tables[t][8 * lo:8 * hi + 8]))
               for t, (lo, hi) in self.changed.items() if new_too or t not in self.new]
        if not new_too:
            self.changed = {t: s for t, s in self.changed.items() if t in self.new}
        return out
