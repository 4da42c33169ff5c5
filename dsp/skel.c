/* keel's DSP-side library for the cDSP (libkeel_dsp_skel.so): what a user protection domain
   loads when the host opens "file:///libkeel_dsp_skel.so?keel_dsp_skel_handle_invoke&..." with
   remotectl (dsp/fastrpc.py). The PD's loader reads the file from the host by reverse RPC (the
   host's listener serves it from memory) and calls the entry named in that URI for every invoke
   on the handle:

     int keel_dsp_skel_handle_invoke(remote_handle64 h, uint32_t sc, remote_arg *pra)

   sc is REMOTE_SCALARS_MAKEX: method in bits 24-28, in buffers 16-23, out buffers 8-15, in and
   out handles 4-7 and 0-3; pra holds the in buffers, then the out buffers. Methods:
     0, 1  open, close: a handle64 interface's own (nothing to set up or tear down)
     2     LOAD, 3 in 1 out: {shm, shm bytes, weights off, arena off, slots, slot off...},
           the programs' library name, the launch table (u32 words); out: i32 status
     3     RUN, 1 in 1 out: a Request {seq, flags, first, end, patches} and `patches` {io slot,
           offset} pairs (graph_runner.h); out: {seq, status, nticks, 0}, nticks u64
   The emulated DSP (sim/dsp/runtime.c, under qemu-hexagon) includes this file and calls this entry
   for its load and every invoke, with remote_args built as FastRPC builds them: the same code
   path, with its own loader standing in for the PD's dlopen.

   No Hexagon SDK header: what the library imports from the PD, declared here by hand, and why:
     dlopen, dlsym, dlclose  the programs (the blob's kernels) are a second library, loaded by
                             the same loader (the PD maps code; keel never writes code itself)
     malloc, free            the launch table outlives LOAD's in buffer
   and, for the workers (graph_runner.h, "Threads"), QuRT's (qurt_thread.h, qurt_futex.h,
   qurt_hvx.h; signatures as the Hexagon SDK declares them, which Halide's mini_qurt.h repeats):
     qurt_thread_create      workers 1..3, started at the first threaded invoke
     qurt_futex_wait, _wake  a worker sleeps between launches, the invoking thread until the
                             launch's shares are done
     qurt_hvx_lock, _unlock  a thread takes a 128-byte HVX context before running HVX code;
     qurt_hvx_get_units      bits 15:8: how many such contexts the DSP has */
#include <stddef.h>
#include <stdint.h>
#include "graph_runner.h"

typedef uint64_t remote_handle64;
typedef union {
  struct { void *pv; uint32_t len; } buf;
  struct { int fd; uint32_t offset; } dma;
} remote_arg;
void *dlopen(const char *name, int mode);
void *dlsym(void *lib, const char *name);
int dlclose(void *lib);
void *malloc(size_t n);
void free(void *p);

#ifndef KEEL_QEMU  /* the cDSP: QuRT threads (the emulated DSP has Linux's, sim/dsp/runtime.c) */
typedef unsigned int qurt_thread_t;
typedef struct {  /* qurt_thread_attr_t */
  char name[16];
  unsigned char tcb_partition, affinity;
  unsigned short priority;
  unsigned char asid, bus_priority;
  unsigned short timetest_id;
  unsigned int stack_size;
  void *stack_addr;
} qurt_thread_attr_t;
int qurt_thread_create(qurt_thread_t *id, qurt_thread_attr_t *attr, void (*fn)(void *), void *arg);
int qurt_futex_wait(void *word, int value);
int qurt_futex_wake(void *word, int n_to_wake);
int qurt_hvx_lock(int mode);
int qurt_hvx_unlock(void);
int qurt_hvx_get_units(void);
enum { QURT_HVX_MODE_128B = 1, WORKER_STACK = 256 << 10, WORKER_PRIORITY = 100 };

/* attributes as qurt_thread_attr_init sets them, but the stack and the priority (Halide's
   Hexagon thread pool's) */
static int start_worker(void (*fn)(void *), void *arg) {
  static qurt_thread_t ids[MAX_WORKERS];
  void *stack = malloc(WORKER_STACK);
  qurt_thread_attr_t attr = {"keel_worker", 0, 0xff, WORKER_PRIORITY, 0, 255, (unsigned short)-2,
                             WORKER_STACK, stack};
  return !stack || qurt_thread_create(&ids[(uintptr_t)arg % MAX_WORKERS], &attr, fn, arg);
}
static void wait_word(volatile uint32_t *word, uint32_t seen) {
  qurt_futex_wait((void *)word, (int)seen);
}
static void wake_word(volatile uint32_t *word) { qurt_futex_wake((void *)word, MAX_WORKERS); }
static uint32_t hvx_contexts(void) { return (uint32_t)qurt_hvx_get_units() >> 8 & 0xff; }
static void hold_hvx(int on) {
  if (on) qurt_hvx_lock(QURT_HVX_MODE_128B);
  else qurt_hvx_unlock();
}
#endif

enum { RTLD_NOW = 2, HEAD_WORDS = 5, LOAD = 2, RUN = 3 };
/* LOAD's status: what the host's DeviceError names */
enum { OK, BAD_ARGS, NO_LIBRARY, NO_SYMBOL, BAD_TABLE, NO_MEMORY, NOT_LOADED };

#define METHOD(sc) ((sc) >> 24 & 0x1f)
#define INS(sc) ((sc) >> 16 & 0xff)
#define OUTS(sc) ((sc) >> 8 & 0xff)
#define HANDLES(sc) ((sc) & 0xff)

static Graph g;
static void *io[MAX_SLOTS];
static uint32_t shm_size;
static void *lib;

static void unload_graph(void) {
  if (lib) dlclose(lib);
  free((void *)g.table);
  lib = 0, g = (Graph){0};
}

static int load_graph(remote_arg *pra) {
  const uint32_t *h = pra[0].buf.pv;
  const char *name = pra[1].buf.pv;
  uint32_t heads = pra[0].buf.len / 4, words = pra[2].buf.len / 4;
  if (heads < HEAD_WORDS || h[4] > MAX_SLOTS || heads != HEAD_WORDS + h[4] ||
      !pra[1].buf.len || name[pra[1].buf.len - 1] || h[2] > h[1] || h[3] > h[1])
    return BAD_ARGS;
  unload_graph();
  unsigned char *shm = (unsigned char *)(uintptr_t)h[0];
  for (uint32_t i = 0; i < h[4]; i++) {
    if (h[HEAD_WORDS + i] > h[1]) return BAD_ARGS;
    io[i] = shm + h[HEAD_WORDS + i];
  }
  uint32_t *table = malloc(words * 4 + 4);
  if (!table) return NO_MEMORY;
  for (uint32_t i = 0; i < words; i++) table[i] = ((const uint32_t *)pra[2].buf.pv)[i];
  g = (Graph){0, 0, 0, table, words, 0, h[4], shm, shm + h[3], shm + h[2], io};
  shm_size = h[1];
  if (!(lib = dlopen(name, RTLD_NOW))) return unload_graph(), NO_LIBRARY;
  g.graph = (graph_fn *)dlsym(lib, "keel_graph");
  g.part = (part_fn *)dlsym(lib, "keel_launch_part");
  g.split = (split_fn *)dlsym(lib, "keel_split");
  if (!g.graph || !g.part || !g.split) return unload_graph(), NO_SYMBOL;
  if (check_table(&g, h[1])) return unload_graph(), BAD_TABLE;
  return OK;
}

/* patches first (each checked: a slot that exists, an offset inside the shared buffer), then
   the launch range */
static int run_invoke(remote_arg *pra) {
  const Request *req = pra[0].buf.pv;
  const uint32_t *patch = (const uint32_t *)(req + 1);
  if (pra[0].buf.len < sizeof *req || pra[0].buf.len != sizeof *req + 8ull * req->patches)
    return BAD_ARGS;
  uint64_t answer = req->flags & FLAG_PROFILE && req->first < req->end
                        ? 16ull * MAX_WORKERS * (req->end - req->first) : 0;  /* ticks' bytes */
  if (pra[1].buf.len < sizeof(Reply) + answer) return BAD_ARGS;
  Reply *reply = pra[1].buf.pv;
  if (!lib) {
    *reply = (Reply){req->seq, NOT_LOADED, 0, 0};
    return OK;
  }
  for (uint32_t i = 0; i < req->patches; i++)
    if (patch[2 * i] >= g.slots || patch[2 * i + 1] >= shm_size) return BAD_ARGS;
  for (uint32_t i = 0; i < req->patches; i++) io[patch[2 * i]] = g.shm + patch[2 * i + 1];
  hold_hvx(1);  /* this thread is worker 0: it runs HVX code (FastRPC may call on another) */
  *reply = run_graph(&g, req, (unsigned long long *)(reply + 1));
  hold_hvx(0);
  return OK;
}

__attribute__((visibility("default")))
int keel_dsp_skel_handle_invoke(remote_handle64 handle, uint32_t sc, remote_arg *pra) {
  (void)handle;
  uint32_t m = METHOD(sc);
  if (m <= 1) return OK;
  if (HANDLES(sc)) return BAD_ARGS;
  if (m == LOAD && INS(sc) == 3 && OUTS(sc) == 1 && pra[3].buf.len >= 4) {
    *(int32_t *)pra[3].buf.pv = load_graph(pra);
    return OK;
  }
  if (m == RUN && INS(sc) == 1 && OUTS(sc) == 1) return run_invoke(pra);
  return BAD_ARGS;
}
