/* keel's DSP-side runtime: one freestanding Hexagon v65 program that holds a compiled graph
   (a `dsp` blob's programs section) and runs the whole graph once per invoke.

   Loaded once per Model.load. It receives one shared buffer holding the weights, the arena and
   every io slot (offsets given at start), so an invoke passes no buffers at all: FastRPC's
   per-call buffer cap never applies. Per invoke it runs each launch of the blob's launch table
   shared between its worker threads through keel_launch_part (or keel_graph on one thread,
   FLAG_SERIAL), with, when the host asks for per-kernel costs, each worker's counters read
   around its share: the Hexagon cycle counter (UPCYCLE) on the DSP; under qemu (KEEL_QEMU),
   qemu's own packet and HVX-instruction counters, which the emulator keeps in control registers
   c20 and c22 (reserved on the hardware) per thread (dsp/graph_runner.h, "Threads").

   This build is the emulated DSP (sim/dsp/mock.py, KEEL_FASTRPC=mock): a static Hexagon Linux
   executable for qemu-hexagon, with the same kernels the DSP runs.

     runtime PROGRAMS_FD PROGRAMS_BYTES SHM_FD SHM_BYTES TABLE_FD TABLE_BYTES WEIGHTS_OFF
             ARENA_OFF IO_OFF...

   The fds are inherited memfds; the shared buffer SHM is mapped MAP_SHARED by both sides (the
   stand-in for the ION / dma-buf buffer FastRPC maps). TABLE is the launch table as u32 words:
   per launch, its argument count, then each argument: its byte offset in SHM, or IO_ARG | its io
   slot (graph_runner.h). Invokes arrive on stdin as a Request {seq, flags, first, end, patches}
   and its {slot, offset} patches, and are answered on stdout with {u32 seq, u32 status,
   u32 nticks, u32 0, u64 ticks[nticks]}; a first answer with seq 0 says the library is loaded.
   A profiled invoke answers 2 * MAX_WORKERS * (end - first) ticks: per worker, per launch its
   cost (cycles, or qemu's packets), then per worker, per launch its HVX instructions (qemu
   only; 0 on the DSP).
   It runs the cDSP library itself: dsp/skel.c is included and its entry,
   keel_dsp_skel_handle_invoke, gets the LOAD and every RUN with remote_args and sc as FastRPC
   passes them. What stands in for the user PD around it: the ELF loader below (the PD's dlopen
   of the programs library, which the skel asks for by name), malloc and free, the workers'
   threads, the pipe loop (the FastRPC invokes) and the division helpers (the DSP C library's).
   Exit status: 0 host closed stdin, 2 usage, 3 file, 4 object it cannot load (or the skel
   refused it). */
#include <stddef.h>
#include <stdint.h>

enum { SYS_close = 57, SYS_read = 63, SYS_write = 64, SYS_exit = 93, SYS_exit_group = 94,
       SYS_futex = 98, SYS_munmap = 215, SYS_clone = 220, SYS_mmap2 = 222 };
enum { PROT_RWX = 7, MAP_SHARED = 1, MAP_PRIVATE_ANON = 0x02 | 0x20 };
enum { FLAG_HANG = 2, FLAG_FAULT = 4 };  /* injected faults; FLAG_PROFILE is graph_runner.h's */
enum { FIRST_SLOT = 9 };

/* Linux on Hexagon: trap0(#1), number in r6, arguments in r0-r5, result in r0 */
static long sys6(long n, long a, long b, long c, long d, long e, long f) {
  register long r6 __asm__("r6") = n, r0 __asm__("r0") = a, r1 __asm__("r1") = b;
  register long r2 __asm__("r2") = c, r3 __asm__("r3") = d, r4 __asm__("r4") = e;
  register long r5 __asm__("r5") = f;
  __asm__ volatile("trap0(#1)" : "+r"(r0) : "r"(r6), "r"(r1), "r"(r2), "r"(r3), "r"(r4), "r"(r5)
                   : "memory");
  return r0;
}
#define SYS(n, a, b, c) sys6(n, (long)(a), (long)(b), (long)(c), 0, 0, 0)
#define NAME "dsp runtime"
#include "freestanding.h"  /* memcpy, memmove, memset (kernels may import them), len, same, die */

/* ---- what a kernel object may import (the DSP's C library provides them on the device) ----- */
/* Hexagon has no divide instruction: clang calls these (C semantics: truncate toward zero).
   Shift-subtract from n's highest set bit (a kernel's share of its loop, tid * n / nt, divides
   a small number: a few steps, not 64), so nothing here calls them back. */
static uint64_t udivmod(uint64_t n, uint64_t d, uint64_t *rem) {
  uint64_t q = 0, r = 0;
  for (int i = n ? 63 - __builtin_clzll(n) : -1; i >= 0; i--) {
    r = r << 1 | (n >> i & 1);
    if (r >= d) r -= d, q |= 1ull << i;
  }
  *rem = r;
  return q;
}
static int64_t sdivmod(int64_t n, int64_t d, int64_t *rem) {
  uint64_t r, q = udivmod(n < 0 ? -(uint64_t)n : (uint64_t)n, d < 0 ? -(uint64_t)d : (uint64_t)d,
                          &r);
  *rem = n < 0 ? -(int64_t)r : (int64_t)r;
  return (n < 0) != (d < 0) ? -(int64_t)q : (int64_t)q;
}
uint32_t __hexagon_udivsi3(uint32_t n, uint32_t d) { uint64_t r; return udivmod(n, d, &r); }
uint32_t __hexagon_umodsi3(uint32_t n, uint32_t d) { uint64_t r; udivmod(n, d, &r); return r; }
int32_t __hexagon_divsi3(int32_t n, int32_t d) { int64_t r; return sdivmod(n, d, &r); }
int32_t __hexagon_modsi3(int32_t n, int32_t d) { int64_t r; sdivmod(n, d, &r); return r; }
uint64_t __hexagon_udivdi3(uint64_t n, uint64_t d) { uint64_t r; return udivmod(n, d, &r); }
uint64_t __hexagon_umoddi3(uint64_t n, uint64_t d) { uint64_t r; udivmod(n, d, &r); return r; }
int64_t __hexagon_divdi3(int64_t n, int64_t d) { int64_t r; return sdivmod(n, d, &r); }
int64_t __hexagon_moddi3(int64_t n, int64_t d) { int64_t r; sdivmod(n, d, &r); return r; }

static uint32_t number(const char *s) {
  uint64_t n = 0;
  if (!*s) die(2, "expected a number, got an empty argument", "");
  for (const char *p = s; *p; p++) {
    if (*p < '0' || *p > '9' || (n = n * 10 + (uint64_t)(*p - '0')) > 0xffffffffu)
      die(2, "expected a 32-bit unsigned number, got ", s);
  }
  return (uint32_t)n;
}
static char *map(long n, long prot, long flags, long fd) {
  long p = sys6(SYS_mmap2, 0, n ? n : 1, prot, flags, fd, 0);
  if (p < 0 && p > -4096) die(3, "mmap failed", "");
  return (char *)p;
}
static void io_all(long nr, long fd, char *buf, size_t n) {  /* read or write exactly n bytes */
  for (size_t done = 0; done < n;) {
    long r = SYS(nr, fd, buf + done, n - done);
    if (r == 0 && nr == SYS_read && done == 0) SYS(SYS_exit_group, 0, 0, 0);  /* host closed */
    if (r <= 0) die(3, nr == SYS_read ? "short read" : "short write", "");
    done += (size_t)r;
  }
}

/* ---- ELF32 Hexagon shared object loading --------------------------------------------------- */
typedef struct {
  unsigned char ident[16];
  uint16_t type, machine;
  uint32_t version, entry, phoff, shoff, flags;
  uint16_t ehsize, phentsize, phnum, shentsize, shnum, shstrndx;
} Ehdr;
typedef struct { uint32_t type, offset, vaddr, paddr, filesz, memsz, flags, align; } Phdr;
typedef struct { int32_t tag; uint32_t val; } Dyn;
typedef struct { uint32_t name, value, size; unsigned char info, other; uint16_t shndx; } Sym;
typedef struct { uint32_t offset, info; int32_t addend; } Rela;

enum { PT_LOAD = 1, PT_DYNAMIC = 2, PT_TLS = 7, EM_HEXAGON = 164, ET_DYN = 3 };
enum { DT_NULL = 0, DT_PLTRELSZ = 2, DT_HASH = 4, DT_STRTAB = 5, DT_SYMTAB = 6, DT_RELA = 7,
       DT_RELASZ = 8, DT_INIT = 12, DT_JMPREL = 23, DT_INIT_ARRAY = 25 };
enum { R_HEX_32 = 6, R_HEX_GLOB_DAT = 33, R_HEX_JMP_SLOT = 34, R_HEX_RELATIVE = 35 };

typedef struct { char *base; const Sym *syms; const char *strs; uint32_t nsyms, span; } Image;

#define EXPORT(f) {#f, (uintptr_t)f}
static const struct { const char *name; uintptr_t at; } LIBC[] = {
  EXPORT(memcpy), EXPORT(memmove), EXPORT(memset), EXPORT(__hexagon_udivsi3),
  EXPORT(__hexagon_umodsi3), EXPORT(__hexagon_divsi3), EXPORT(__hexagon_modsi3),
  EXPORT(__hexagon_udivdi3), EXPORT(__hexagon_umoddi3), EXPORT(__hexagon_divdi3),
  EXPORT(__hexagon_moddi3)};

static uintptr_t resolve(const Image *im, uint32_t index) {
  const Sym *s = &im->syms[index];
  const char *name = im->strs + s->name;
  if (s->shndx) return (uintptr_t)im->base + s->value;
  for (size_t i = 0; i < sizeof LIBC / sizeof *LIBC; i++)
    if (same(name, LIBC[i].name)) return LIBC[i].at;
  die(4, "programs import a symbol the DSP runtime does not provide: ", name);
}

static void relocate(const Image *im, const Rela *r, uint32_t bytes) {
  for (const Rela *end = r + bytes / sizeof *r; r < end; r++) {
    uint32_t *at = (uint32_t *)(im->base + r->offset), type = r->info & 0xff, sym = r->info >> 8;
    if (type == R_HEX_RELATIVE) *at = (uintptr_t)im->base + (uint32_t)r->addend;
    else if (type == R_HEX_32 || type == R_HEX_GLOB_DAT || type == R_HEX_JMP_SLOT)
      *at = resolve(im, sym) + (uint32_t)r->addend;
    else die(4, "programs use a relocation type the DSP runtime does not apply", "");
  }
}

static void link_dynamic(Image *im, const Dyn *d) {
  const Rela *rela = 0, *plt = 0;
  uint32_t rela_size = 0, plt_size = 0;
  for (; d->tag != DT_NULL; d++) {
    switch (d->tag) {
      case DT_SYMTAB: im->syms = (const Sym *)(im->base + d->val); break;
      case DT_STRTAB: im->strs = im->base + d->val; break;
      case DT_HASH: im->nsyms = ((const uint32_t *)(im->base + d->val))[1]; break;  /* nchain */
      case DT_RELA: rela = (const Rela *)(im->base + d->val); break;
      case DT_RELASZ: rela_size = d->val; break;
      case DT_JMPREL: plt = (const Rela *)(im->base + d->val); break;
      case DT_PLTRELSZ: plt_size = d->val; break;
      case DT_INIT: case DT_INIT_ARRAY: die(4, "programs have initializers; keel's never do", "");
    }
  }
  if (!im->syms || !im->strs || !im->nsyms) die(4, "programs have no dynamic symbol table", "");
  if (rela) relocate(im, rela, rela_size);
  if (plt) relocate(im, plt, plt_size);
}

static void *symbol(const Image *im, const char *name) {
  for (uint32_t j = 1; j < im->nsyms; j++)
    if (im->syms[j].shndx && same(im->strs + im->syms[j].name, name))
      return im->base + im->syms[j].value;
  return 0;
}

static Image load_elf(const char *file, uint32_t size) {
  const Ehdr *eh = (const Ehdr *)file;
  if (size < sizeof *eh || eh->ident[0] != 0x7f || eh->ident[1] != 'E' || eh->ident[4] != 1 ||
      eh->type != ET_DYN || eh->machine != EM_HEXAGON)
    die(4, "programs are not an ELF32 Hexagon shared object", "");
  if (eh->phoff + (uint32_t)eh->phnum * sizeof(Phdr) > size) die(4, "program headers past EOF", "");
  const Phdr *ph = (const Phdr *)(file + eh->phoff);
  uint32_t span = 0;
  for (int i = 0; i < eh->phnum; i++) {
    if (ph[i].type == PT_TLS) die(4, "programs use thread-local storage", "");
    if (ph[i].type == PT_LOAD && ph[i].vaddr + ph[i].memsz > span) span = ph[i].vaddr + ph[i].memsz;
  }
  /* one read-write-execute mapping: the emulator keeps no separate instruction cache */
  Image im = {map(span, PROT_RWX, MAP_PRIVATE_ANON, -1), 0, 0, 0, span};
  const Dyn *dyn = 0;
  for (int i = 0; i < eh->phnum; i++) {
    if (ph[i].type == PT_DYNAMIC) dyn = (const Dyn *)(im.base + ph[i].vaddr);
    if (ph[i].type != PT_LOAD) continue;
    if (ph[i].offset + ph[i].filesz > size) die(4, "segment past EOF", "");
    memcpy(im.base + ph[i].vaddr, file + ph[i].offset, ph[i].filesz);  /* bss stays zero */
  }
  if (!dyn) die(4, "programs have no dynamic section", "");
  link_dynamic(&im, dyn);
  return im;
}


/* ---- the user PD around the skel ---------------------------------------------------------- */
#include "skel.c"  /* the cDSP library: keel_dsp_skel_handle_invoke and graph_runner.h */

/* The workers (graph_runner.h, "Threads") as Linux threads: qemu-hexagon's user mode runs each
   on its own host thread with its own CPU state, so its packet and HVX counters count that
   worker alone. The SD845's HVX contexts are emulated as a count (qemu has no such limit). */
enum { CLONE_THREAD_FLAGS = 0x50f00, /* VM, FS, FILES, SIGHAND, THREAD, SYSVSEM */
       FUTEX_WAIT_PRIVATE = 128, FUTEX_WAKE_PRIVATE = 129, WORKER_STACK = 1 << 20,
       SD845_HVX_CONTEXTS = 2 };

/* clone: the child starts on its own stack in the middle of this asm with fn and arg in r16
   and r17 (callee-saved, copied with the registers), calls fn(arg) and ends its thread */
static int start_worker(void (*fn)(void *), void *arg) {
  char *stack = map(WORKER_STACK, 3, MAP_PRIVATE_ANON, -1);
  register long r6 __asm__("r6") = SYS_clone, r0 __asm__("r0") = CLONE_THREAD_FLAGS;
  register long r1 __asm__("r1") = (long)(stack + WORKER_STACK), r2 __asm__("r2") = 0;
  register long r3 __asm__("r3") = 0, r4 __asm__("r4") = 0;
  register long r16 __asm__("r16") = (long)fn, r17 __asm__("r17") = (long)arg;
  __asm__ volatile("trap0(#1)\n"
                   "p0 = cmp.eq(r0, #0)\n"
                   "if (!p0) jump 1f\n"
                   "r0 = r17\n"
                   "callr r16\n"
                   "r0 = #0\n"
                   "r6 = #93\n"  /* SYS_exit: this thread only */
                   "trap0(#1)\n"
                   "1:\n"
                   : "+r"(r0) : "r"(r6), "r"(r1), "r"(r2), "r"(r3), "r"(r4), "r"(r16), "r"(r17)
                   : "memory", "p0", "r28", "r31");
  return r0 < 0;
}
static void wait_word(volatile uint32_t *word, uint32_t seen) {
  sys6(SYS_futex, (long)word, FUTEX_WAIT_PRIVATE, (long)seen, 0, 0, 0);
}
static void wake_word(volatile uint32_t *word) {
  sys6(SYS_futex, (long)word, FUTEX_WAKE_PRIVATE, MAX_WORKERS, 0, 0, 0);
}
static uint32_t hvx_contexts(void) { return SD845_HVX_CONTEXTS; }
static void hold_hvx(int on) { (void)on; }  /* qemu runs HVX on any thread */

static const char *programs_file, *programs_name = "libkeel_programs.so";  /* dsp/fastrpc.py's */
static uint32_t programs_size;
static Image programs;

void *dlopen(const char *name, int mode) {
  (void)mode;
  if (!same(name, programs_name) || programs.base) return 0;
  programs = load_elf(programs_file, programs_size);
  return &programs;
}
void *dlsym(void *lib, const char *name) { return symbol(lib, name); }
int dlclose(void *lib) {
  SYS(SYS_munmap, ((Image *)lib)->base, ((Image *)lib)->span, 0);
  *(Image *)lib = (Image){0};
  return 0;
}
void *malloc(size_t n) {  /* 8 bytes of header keep the block's size and its alignment */
  long p = sys6(SYS_mmap2, 0, (long)n + 8, 3, MAP_PRIVATE_ANON, -1, 0);
  if (p < 0 && p > -4096) return 0;
  *(size_t *)p = n + 8;
  return (char *)p + 8;
}
void free(void *p) {
  if (p) SYS(SYS_munmap, (char *)p - 8, *(size_t *)((char *)p - 8), 0);
}

static char *map_fd(const char *fd, uint32_t size, long prot, long flags) {
  static char empty[8];  /* qemu-user refuses a mapping wholly past a file's end */
  char *p = size ? map(size, prot, flags, number(fd)) : empty;
  SYS(SYS_close, number(fd), 0, 0);
  return p;
}

#define SC(method, ins, outs) ((uint32_t)(method) << 24 | (ins) << 16 | (outs) << 8)
static const char *const LOAD_FAILURES[] = {"", "bad arguments", "no programs library",
  "programs without keel_graph, keel_launch_part or keel_split", "a bad launch table",
  "out of memory"};

/* the skel's LOAD, as FastRPC passes it: {shm, bytes, weights, arena, slots, offsets...}, the
   programs' name, the launch table; out: the status */
static void load_skel(int argc, char **argv) {
  static uint32_t head[5 + MAX_SLOTS];
  int32_t status = -1;
  uint32_t shm_size = number(argv[4]), n = (uint32_t)(argc - FIRST_SLOT);
  programs_size = number(argv[2]);
  programs_file = map_fd(argv[1], programs_size, 1, 2);  /* PROT_READ, MAP_PRIVATE */
  head[0] = (uint32_t)(uintptr_t)map_fd(argv[3], shm_size, 3, MAP_SHARED);
  head[1] = shm_size, head[2] = number(argv[7]), head[3] = number(argv[8]), head[4] = n;
  for (uint32_t i = 0; i < n; i++) head[5 + i] = number(argv[FIRST_SLOT + i]);
  remote_arg pra[4] = {{.buf = {head, 4 * (5 + n)}},
                       {.buf = {(void *)programs_name, len(programs_name) + 1}},
                       {.buf = {map_fd(argv[5], number(argv[6]), 1, 2), number(argv[6])}},
                       {.buf = {&status, 4}}};
  if (keel_dsp_skel_handle_invoke(0, SC(LOAD, 3, 1), pra) || status)
    die(4, "the skel refused the programs: ",
        status > 0 && status < 6 ? LOAD_FAILURES[status] : "its entry failed");
}

static int serve(int argc, char **argv) {
  static Reply reply[1 + MAX_WORKERS * MAX_LAUNCHES];  /* the header, then 2 * MAX_WORKERS u64
                                                          per launch */
  if (argc < FIRST_SLOT || argc - FIRST_SLOT > MAX_SLOTS)
    die(2, "usage: runtime PROGRAMS_FD PROGRAMS_BYTES SHM_FD SHM_BYTES TABLE_FD TABLE_BYTES "
        "WEIGHTS_OFF ARENA_OFF IO_OFF...", "");
  load_skel(argc, argv);
  io_all(SYS_write, 1, (char *)reply, sizeof *reply);  /* loaded: seq 0 */
  for (;;) {
    static uint32_t req[5 + 2 * MAX_SLOTS];  /* a Request, then its patches */
    io_all(SYS_read, 0, (char *)req, sizeof(Request));
    if (req[4] > MAX_SLOTS) die(4, "RUN with too many patches", "");
    io_all(SYS_read, 0, (char *)(req + 5), 8 * req[4]);
    if (req[1] & FLAG_HANG) for (;;) __asm__ volatile("" ::: "memory");  /* never answers */
    remote_arg pra[2] = {{.buf = {req, sizeof(Request) + 8 * req[4]}},
                         {.buf = {reply, sizeof reply}}};
    if (req[1] & FLAG_FAULT) *reply = (Reply){req[0], 1, 0, 0};
    else if (keel_dsp_skel_handle_invoke(0, SC(RUN, 1, 1), pra)) die(4, "RUN refused", "");
    io_all(SYS_write, 1, (char *)reply, sizeof *reply + reply->nticks * 8);
  }
}

/* the kernel enters with sp at argc, then argv[] */
void start(long *sp) { SYS(SYS_exit_group, serve((int)sp[0], (char **)(sp + 1)), 0, 0); }
__asm__(".globl _start\n_start:\n\t{ r0 = r29 }\n\tcall start\n");
