/* Runs one keel cpu-aarch64 programs section once, the way runner/cpu.py does on a device.

   harness PROGRAMS WEIGHTS IO OUT ARENA_BYTES THREADS SLOT_OFFSET...

   PROGRAMS is the blob's shared object, WEIGHTS its weights section. IO holds every io slot
   (inputs, then room for the outputs) at the given byte offsets; after the graph returns, the
   whole IO image is written to OUT. THREADS 1 calls keel_graph; n > 1 calls keel_graph_mt on n
   threads (clone), the calling one as thread 0, as the runner's Pool does.

   A static executable with no libc (CI has no aarch64 sysroot), so it is its own loader: it maps
   the object's segments, applies its relocations and finds keel_graph in .dynsym. The memcpy and
   memset that clang may call for large copies come from here, as the runner takes them from the
   libc in its process. Exit status: 0 ran, 2 usage, 3 file, 4 object it cannot load. */
#include <stddef.h>
#include <stdint.h>

enum { AT_FDCWD = -100, O_WRITE_NEW = 01 | 0100 | 01000 };  /* O_WRONLY | O_CREAT | O_TRUNC */
enum { SYS_openat = 56, SYS_close = 57, SYS_lseek = 62, SYS_read = 63, SYS_write = 64,
       SYS_exit = 93, SYS_exit_group = 94, SYS_futex = 98, SYS_sched_yield = 124,
       SYS_mmap = 222, SYS_mprotect = 226 };
enum { PROT_R = 1, PROT_W = 2, PROT_X = 4, MAP_PRIVATE_ANON = 0x02 | 0x20, PAGE = 4096 };

static long sys6(long n, long a, long b, long c, long d, long e, long f) {
  register long x8 __asm__("x8") = n, x0 __asm__("x0") = a, x1 __asm__("x1") = b;
  register long x2 __asm__("x2") = c, x3 __asm__("x3") = d, x4 __asm__("x4") = e;
  register long x5 __asm__("x5") = f;
  __asm__ volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5)
                   : "memory");
  return x0;
}
#define SYS(n, a, b, c) sys6(n, (long)(a), (long)(b), (long)(c), 0, 0, 0)
#define NAME "harness"
#include "freestanding.h"  /* memcpy, memmove, memset (the object may import them), len, same, die */
#include "keel_abi.h"  /* the entry points and keel_sync, as every C blob exports them */

/* ---- arguments, files and threads ------------------------------------------------------------ */

static uint64_t number(const char *s) {
  uint64_t n = 0;
  if (!*s) die(2, "expected a number, got an empty argument", "");
  for (const char *p = s; *p; p++) {
    if (*p < '0' || *p > '9') die(2, "expected a number, got ", s);
    n = n * 10 + (uint64_t)(*p - '0');
  }
  return n;
}

static void *map(uint64_t n) {
  long p = sys6(SYS_mmap, 0, (long)(n ? n : 1), PROT_R | PROT_W, MAP_PRIVATE_ANON, -1, 0);
  if (p < 0 && p > -4096) die(3, "mmap failed", "");
  return (void *)p;
}

/* the whole file in fresh page-aligned memory (as the runner's blob mapping is) */
static char *slurp(const char *path, uint64_t *size) {
  long fd = SYS(SYS_openat, AT_FDCWD, path, 0);
  if (fd < 0) die(3, "cannot open ", path);
  long n = SYS(SYS_lseek, fd, 0, 2);
  if (n < 0 || SYS(SYS_lseek, fd, 0, 0) != 0) die(3, "cannot seek ", path);
  char *buf = map((uint64_t)n);
  for (long got = 0, r; got < n; got += r) {
    r = SYS(SYS_read, fd, buf + got, n - got);
    if (r <= 0) die(3, "short read from ", path);
  }
  SYS(SYS_close, fd, 0, 0);
  *size = (uint64_t)n;
  return buf;
}

static void spill(const char *path, const char *buf, uint64_t n) {
  long fd = SYS(SYS_openat, AT_FDCWD, path, O_WRITE_NEW), w;
  if (fd < 0) die(3, "cannot create ", path);
  for (uint64_t put = 0; put < n; put += (uint64_t)w) {
    w = SYS(SYS_write, fd, buf + put, n - put);
    if (w <= 0) die(3, "short write to ", path);
  }
  SYS(SYS_close, fd, 0, 0);
}

/* ---- ELF64 shared object loading ------------------------------------------------------------ */
typedef struct {
  unsigned char ident[16];
  uint16_t type, machine;
  uint32_t version;
  uint64_t entry, phoff, shoff;
  uint32_t flags;
  uint16_t ehsize, phentsize, phnum, shentsize, shnum, shstrndx;
} Ehdr;
typedef struct { uint32_t type, flags; uint64_t offset, vaddr, paddr, filesz, memsz, align; } Phdr;
typedef struct { uint32_t name, type; uint64_t flags, addr, offset, size; uint32_t link, info;
                 uint64_t align, entsize; } Shdr;
typedef struct { int64_t tag; uint64_t val; } Dyn;
typedef struct {
  uint32_t name;
  unsigned char info, other;
  uint16_t shndx;
  uint64_t value, size;
} Sym;
typedef struct { uint64_t offset, info; int64_t addend; } Rela;

enum { PT_LOAD = 1, PT_DYNAMIC = 2, PT_TLS = 7, SHT_DYNSYM = 11, EM_AARCH64 = 183, ET_DYN = 3 };
enum { DT_NULL = 0, DT_PLTRELSZ = 2, DT_STRTAB = 5, DT_SYMTAB = 6, DT_RELA = 7, DT_RELASZ = 8,
       DT_INIT = 12, DT_JMPREL = 23, DT_INIT_ARRAY = 25 };
enum { R_ABS64 = 257, R_GLOB_DAT = 1025, R_JUMP_SLOT = 1026, R_RELATIVE = 1027 };

typedef struct { char *base; const Sym *syms; const char *strs; } Image;

static uint64_t resolve(const Image *im, uint32_t index) {
  const Sym *s = &im->syms[index];
  const char *name = im->strs + s->name;
  if (s->shndx) return (uint64_t)im->base + s->value;
  if (same(name, "memcpy")) return (uint64_t)memcpy;
  if (same(name, "memmove")) return (uint64_t)memmove;
  if (same(name, "memset")) return (uint64_t)memset;
  die(4, "programs import a symbol the harness does not provide: ", name);
}

static void relocate(const Image *im, const Rela *r, uint64_t bytes) {
  for (const Rela *end = r + bytes / sizeof *r; r < end; r++) {
    uint64_t *at = (uint64_t *)(im->base + r->offset);
    uint32_t type = (uint32_t)r->info, sym = (uint32_t)(r->info >> 32);
    if (type == R_RELATIVE) *at = (uint64_t)im->base + (uint64_t)r->addend;
    else if (type == R_ABS64 || type == R_GLOB_DAT || type == R_JUMP_SLOT)
      *at = resolve(im, sym) + (uint64_t)r->addend;
    else die(4, "programs use a relocation type the harness does not apply", "");
  }
}

static void link_dynamic(Image *im, const Dyn *d) {
  const Rela *rela = 0, *plt = 0;
  uint64_t rela_size = 0, plt_size = 0;
  for (; d->tag != DT_NULL; d++) {
    switch (d->tag) {
      case DT_SYMTAB: im->syms = (const Sym *)(im->base + d->val); break;
      case DT_STRTAB: im->strs = im->base + d->val; break;
      case DT_RELA: rela = (const Rela *)(im->base + d->val); break;
      case DT_RELASZ: rela_size = d->val; break;
      case DT_JMPREL: plt = (const Rela *)(im->base + d->val); break;
      case DT_PLTRELSZ: plt_size = d->val; break;
      case DT_INIT: case DT_INIT_ARRAY: die(4, "programs have initializers; keel's never do", "");
    }
  }
  if (rela) relocate(im, rela, rela_size);
  if (plt) relocate(im, plt, plt_size);
}

/* the new code must be seen by instruction fetch: clean D-cache lines to the point of
   unification, then invalidate the I-cache over them (a no-op cost under qemu) */
static void sync_icache(char *p, uint64_t n) {
  uint64_t ctr, a;
  __asm__ volatile("mrs %0, ctr_el0" : "=r"(ctr));
  uint64_t dline = 4ull << ((ctr >> 16) & 15), iline = 4ull << (ctr & 15);
  for (a = (uint64_t)p & ~(dline - 1); a < (uint64_t)p + n; a += dline)
    __asm__ volatile("dc cvau, %0" : : "r"(a) : "memory");
  __asm__ volatile("dsb ish" : : : "memory");
  for (a = (uint64_t)p & ~(iline - 1); a < (uint64_t)p + n; a += iline)
    __asm__ volatile("ic ivau, %0" : : "r"(a) : "memory");
  __asm__ volatile("dsb ish\n\tisb" : : : "memory");
}

static void protect(const Image *im, const Phdr *ph, int n) {
  for (int i = 0; i < n; i++) {
    if (ph[i].type != PT_LOAD) continue;
    uint64_t lo = ph[i].vaddr & ~(uint64_t)(PAGE - 1), hi = ph[i].vaddr + ph[i].memsz;
    int prot = (ph[i].flags & 4 ? PROT_R : 0) | (ph[i].flags & 2 ? PROT_W : 0) |
               (ph[i].flags & 1 ? PROT_X : 0);
    if (prot & PROT_X) sync_icache(im->base + lo, hi - lo);
    if (SYS(SYS_mprotect, im->base + lo, hi - lo, prot) != 0) die(4, "mprotect failed", "");
  }
}

static const Sym *dynsym(const char *file, uint64_t size, const char *name, const Image *im) {
  const Ehdr *eh = (const Ehdr *)file;
  if (eh->shoff + (uint64_t)eh->shnum * sizeof(Shdr) > size) die(4, "section table past EOF", "");
  const Shdr *sh = (const Shdr *)(file + eh->shoff);
  for (int i = 0; i < eh->shnum; i++) {
    if (sh[i].type != SHT_DYNSYM) continue;
    for (uint64_t j = 1; j < sh[i].size / sizeof(Sym); j++)
      if (im->syms[j].shndx && same(im->strs + im->syms[j].name, name)) return &im->syms[j];
  }
  die(4, "programs do not export ", name);
}

static void *load(const char *file, uint64_t size, const char *entry) {
  const Ehdr *eh = (const Ehdr *)file;
  if (size < sizeof *eh || eh->ident[0] != 0x7f || eh->ident[1] != 'E' || eh->ident[4] != 2 ||
      eh->type != ET_DYN || eh->machine != EM_AARCH64)
    die(4, "programs are not an ELF64 aarch64 shared object", "");
  if (eh->phoff + (uint64_t)eh->phnum * sizeof(Phdr) > size) die(4, "program headers past EOF", "");
  const Phdr *ph = (const Phdr *)(file + eh->phoff);
  uint64_t span = 0;
  for (int i = 0; i < eh->phnum; i++) {
    if (ph[i].type == PT_TLS) die(4, "programs use thread-local storage", "");
    if (ph[i].type == PT_LOAD && ph[i].vaddr + ph[i].memsz > span) span = ph[i].vaddr + ph[i].memsz;
  }
  Image im = {map(span), 0, 0};
  const Dyn *dyn = 0;
  for (int i = 0; i < eh->phnum; i++) {
    if (ph[i].type == PT_DYNAMIC) dyn = (const Dyn *)(im.base + ph[i].vaddr);
    if (ph[i].type != PT_LOAD) continue;
    if (ph[i].offset + ph[i].filesz > size) die(4, "segment past EOF", "");
    memcpy(im.base + ph[i].vaddr, file + ph[i].offset, ph[i].filesz);  /* bss stays zero */
  }
  if (!dyn) die(4, "programs have no dynamic section", "");
  link_dynamic(&im, dyn);
  if (!im.syms || !im.strs) die(4, "programs have no dynamic symbol table", "");
  const Sym *s = dynsym(file, size, entry, &im);
  protect(&im, ph, eh->phnum);
  return im.base + s->value;
}

/* ---- threads ------------------------------------------------------------------------------ */
/* keel_sync with no clock, so no deadline: a barrier here waits as long as a share takes */
typedef __typeof__(keel_graph) graph_fn;
typedef __typeof__(keel_graph_mt) graph_mt_fn;
typedef struct {
  graph_mt_fn *graph;
  unsigned char *arena;
  const unsigned char *weights;
  void *const *io;
  int tid, nt;
  keel_sync *sync;
  volatile int alive;  /* the kernel zeroes it and wakes its futex when the thread exits */
} Share;
enum { MAX_THREADS = 64, STACK = 8 << 20, FUTEX_WAIT = 0 };

static int yield_cpu(void) { return (int)SYS(SYS_sched_yield, 0, 0, 0); }
static void run_share(Share *s) { s->graph(s->arena, s->weights, s->io, s->tid, s->nt, s->sync); }

/* long spawn(void *stack_top, void (*fn)(Share *), Share *arg, volatile int *alive):
   clone(VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|CHILD_CLEARTID, stack, 0, 0, alive); the child pops
   fn and arg from its new stack, calls fn(arg) and exits; the parent gets the tid or -errno. */
long spawn(void *stack_top, void (*fn)(Share *), Share *arg, volatile int *alive);
__asm__(".globl spawn\nspawn:\n"
        "\tstp x1, x2, [x0, #-16]!\n\tmov x4, x3\n\tmov x1, x0\n"
        "\tmovz x0, #0x0f00\n\tmovk x0, #0x25, lsl #16\n"
        "\tmov x2, xzr\n\tmov x3, xzr\n\tmov x8, #220\n\tsvc #0\n\tcbnz x0, 1f\n"
        "\tldp x1, x0, [sp], #16\n\tblr x1\n\tmov x0, xzr\n\tmov x8, #93\n\tsvc #0\n"
        "1:\tret\n");

static void run_threads(graph_mt_fn *graph, unsigned char *arena, const unsigned char *weights,
                        void *const *io, int nt) {
  static Share shares[MAX_THREADS];
  static keel_sync sync = {0, 0, yield_cpu};
  for (int t = 0; t < nt; t++) shares[t] = (Share){graph, arena, weights, io, t, nt, &sync, 1};
  for (int t = 1; t < nt; t++)
    if (spawn((char *)map(STACK) + STACK, run_share, &shares[t], &shares[t].alive) < 0)
      die(3, "clone failed", "");
  run_share(&shares[0]);  /* returns after the last barrier: every share is done */
  for (int t = 1, v; t < nt; t++)  /* ... but wait for the exits, so no thread outlives us */
    while ((v = shares[t].alive) != 0)
      sys6(SYS_futex, (long)&shares[t].alive, FUTEX_WAIT, v, 0, 0, 0);
}

/* ---- the run ------------------------------------------------------------------------------- */
enum { MAX_SLOTS = 256, FIRST_SLOT = 7 };

static int run(int argc, char **argv) {
  static void *io[MAX_SLOTS];
  if (argc < FIRST_SLOT || argc - FIRST_SLOT > MAX_SLOTS)
    die(2, "usage: harness PROGRAMS WEIGHTS IO OUT ARENA_BYTES THREADS SLOT_OFFSET...", "");
  uint64_t code_size, weights_size, io_size, nt = number(argv[6]);
  if (nt < 1 || nt > MAX_THREADS) die(2, "THREADS must be 1 to 64, got ", argv[6]);
  char *code = slurp(argv[1], &code_size);
  void *entry = load(code, code_size, nt == 1 ? "keel_graph" : "keel_graph_mt");
  unsigned char *weights = (unsigned char *)slurp(argv[2], &weights_size);
  char *image = slurp(argv[3], &io_size);
  for (int i = FIRST_SLOT; i < argc; i++) {
    uint64_t off = number(argv[i]);
    if (off > io_size) die(2, "slot offset past the IO image: ", argv[i]);
    io[i - FIRST_SLOT] = image + off;
  }
  unsigned char *arena = map(number(argv[5]));
  if (nt == 1) ((graph_fn *)entry)(arena, weights, io);
  else run_threads((graph_mt_fn *)entry, arena, weights, io, (int)nt);
  spill(argv[4], image, io_size);
  return 0;
}

/* the kernel enters with sp at argc, then argv[] */
void start(long *sp) { SYS(SYS_exit_group, run((int)sp[0], (char **)(sp + 1)), 0, 0); }
__asm__(".globl _start\n_start:\n\tmov x0, sp\n\tmov x29, xzr\n\tmov x30, xzr\n\tbl start\n");
