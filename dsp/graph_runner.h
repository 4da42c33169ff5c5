/* What keel's two DSP-side programs share: the emulated DSP (sim/dsp/runtime.c, a Linux program
   for qemu-hexagon) and the skel (dsp/skel.c, the library a cDSP user PD loads). Both hold one
   compiled graph (its keel_graph, keel_launch_part and keel_split), one shared buffer and the
   launch table, and answer an invoke (a Request, then its patches) with {seq, status, nticks, 0}
   and nticks u64 costs.

   Threads. The SD845's cDSP has 4 hardware threads and 2 HVX contexts in 128-byte mode
   (docs/dsp.md, "Threads", with the sources). An invoke runs launch by launch: a launch whose
   kernel splits (keel_split) is shared between workers, each a hardware thread running
   keel_launch_part(launch, args, tid, nt) over its share of the kernel's outermost output loop
   (the compiler splits only a loop whose iterations write disjoint outputs): nt = the HVX
   contexts for an HVX kernel, the hardware threads for a scalar one, 1 for a kernel that does
   not split. The invoking thread is worker 0; workers 1.. are started once, at the first
   threaded invoke, and sleep on a futex between launches. A launch ends when every share has
   (the next one may read what it wrote). FLAG_SERIAL runs everything on the invoking thread.

   A profiled invoke reads the counters around each worker's share: it answers
   2 * MAX_WORKERS * (end - first) ticks: per worker w, per launch its cost, then per worker,
   per launch its HVX instructions (0 for a worker with no share). The cost is the Hexagon cycle
   counter (UPCYCLE) on the DSP; under qemu (KEEL_QEMU), qemu's own packet and HVX instruction
   counters, which the emulator keeps per thread in control registers c20 and c22 (reserved on
   the hardware). The includer provides <stdint.h>, and the workers' primitives declared below.
   */
#include "keel_abi.h"  /* the programs' entry points, as every C blob exports them */
enum { FLAG_PROFILE = 1, FLAG_SERIAL = 8, MAX_LAUNCHES = 65536, MAX_ARGS = 64, MAX_SLOTS = 256 };
enum { MAX_WORKERS = 4 };  /* the cDSP's hardware threads */
enum { SPLIT_NONE, SPLIT_SCALAR, SPLIT_VECTOR };  /* keel_split's answers (runner/keel_abi.h) */
#define IO_ARG 0x80000000u /* a launch table word with this bit names io slot (word & ~IO_ARG) */

typedef __typeof__(keel_graph) graph_fn;
typedef __typeof__(keel_launch_part) part_fn;
typedef __typeof__(keel_split) split_fn;
typedef struct { uint32_t seq, status, nticks, pad; } Reply;
/* a RUN request: launches [first, end) of the table, after `patches` {slot, offset} pairs that
   rebind io slots to other bytes of the shared buffer (a state's other half, a staging copy) */
typedef struct { uint32_t seq, flags, first, end, patches; } Request;

#ifdef KEEL_QEMU  /* qemu's counters: c20 packets, c22 HVX instructions ("r0 = c20", "r0 = c22") */
#define READ_R0(word) ({ uint32_t r; __asm__ volatile(word "\n%0 = r0" : "=r"(r) :: "r0"); r; })
#define COST() READ_R0(".word 0x6a14c000")
#define HVX_OPS() READ_R0(".word 0x6a16c000")
#else
#define COST() __builtin_readcyclecounter()
#define HVX_OPS() 0u
#endif

/* the workers' primitives, each includer's own (qurt on the DSP, Linux under qemu) */
static int start_worker(void (*fn)(void *), void *arg);  /* a thread of this process; 0: started */
static void wait_word(volatile uint32_t *word, uint32_t seen);  /* while *word == seen (or less) */
static void wake_word(volatile uint32_t *word);  /* every waiter on word */
static uint32_t hvx_contexts(void);  /* 128-byte HVX contexts a process may hold at once */
static void hold_hvx(int on);  /* this thread takes (1) or gives back (0) an HVX context */

typedef struct {
  graph_fn *graph;
  part_fn *part;
  split_fn *split;
  const uint32_t *table;  /* per launch: its argument count, then each argument (IO_ARG | slot,
                             or a byte offset in the shared buffer) */
  uint32_t words, launches, slots;
  unsigned char *shm, *arena, *weights;
  void **io;
} Graph;

/* The launch table checked once (argument counts, offsets inside the shared buffer, slots that
   exist); sets g->launches. Returns what is wrong, or 0. */
static const char *check_table(Graph *g, uint32_t shm_size) {
  g->launches = 0;
  for (uint32_t k = 0; k < g->words; g->launches++) {
    uint32_t n = g->table[k++];
    if (n > MAX_ARGS || k + n > g->words) return "launch table: bad argument count";
    for (uint32_t j = 0; j < n; j++, k++) {
      uint32_t w = g->table[k];
      if (w & IO_ARG ? (w & ~IO_ARG) >= g->slots : w >= shm_size)
        return "launch table: argument past the shared buffer or the io slots";
    }
  }
  return g->launches > MAX_LAUNCHES ? "launch table: too many launches" : 0;
}

/* The workers: one launch at a time, published in `go` (a generation count * 8 + its nt, so a
   worker reads whether it has a share from the word that woke it: the launch's other fields may
   already be the next launch's when it has none); `left` counts the shares still running. cost
   and hvx are each worker's counters around its share of the launch. */
typedef struct {
  volatile uint32_t go, left, started;
  uint32_t threads, vectors;  /* workers for a scalar kernel, for an HVX kernel */
  int launch, nt;
  void *const *args;
  part_fn *part;
  unsigned long long cost[MAX_WORKERS], hvx[MAX_WORKERS];
} Pool;
static Pool pool;

static void run_share(uint32_t tid) {
  unsigned long long c0 = COST(), h0 = HVX_OPS();
  pool.part(pool.launch, pool.args, (int)tid, pool.nt);
  pool.cost[tid] = (unsigned long long)COST() - c0;
  pool.hvx[tid] = (unsigned long long)HVX_OPS() - h0;
}

static void worker(void *arg) {
  uint32_t tid = (uint32_t)(uintptr_t)arg, seen = 0;
  if (tid < pool.vectors) hold_hvx(1);  /* the only ones that run HVX kernels' shares */
  for (;;) {
    while (__atomic_load_n(&pool.go, __ATOMIC_ACQUIRE) == seen) wait_word(&pool.go, seen);
    seen = __atomic_load_n(&pool.go, __ATOMIC_ACQUIRE);
    if (tid >= (seen & 7)) continue;  /* every worker is woken; those past nt sit out */
    run_share(tid);  /* the launch waits for this share: its fields stay as they are */
    if (__atomic_sub_fetch(&pool.left, 1, __ATOMIC_ACQ_REL) == 0) wake_word(&pool.left);
  }
}

/* Workers 1.. started once; as many as could be (with none, every launch runs serially).
   Returns whether there are any. */
static int start_pool(void) {
  if (!pool.started) {
    uint32_t hvx = hvx_contexts(), t = 1;
    pool.vectors = hvx < 1 ? 1 : hvx > MAX_WORKERS ? MAX_WORKERS : hvx;
    while (t < MAX_WORKERS && !start_worker(worker, (void *)(uintptr_t)t)) t++;
    pool.threads = t, pool.vectors = pool.vectors < t ? pool.vectors : t, pool.started = 1;
  }
  return pool.threads > 1;
}

/* Launch i shared between its workers (worker 0 is this thread); returns when all are done. */
static void run_launch(const Graph *g, int i, void *const *args, int serial) {
  int split = serial ? SPLIT_NONE : g->split(i);
  pool.launch = i, pool.args = args, pool.part = g->part;
  pool.nt = split == SPLIT_VECTOR ? (int)pool.vectors : split == SPLIT_SCALAR ? (int)pool.threads
                                                                               : 1;
  for (int t = 0; t < MAX_WORKERS; t++) pool.cost[t] = pool.hvx[t] = 0;
  if (pool.nt > 1) {
    __atomic_store_n(&pool.left, (uint32_t)pool.nt - 1, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.go, ((pool.go >> 3) + 1) << 3 | (uint32_t)pool.nt, __ATOMIC_RELEASE);
    wake_word(&pool.go);
  }
  run_share(0);
  for (uint32_t left; (left = __atomic_load_n(&pool.left, __ATOMIC_ACQUIRE)) != 0;)
    wait_word(&pool.left, left);
}

/* Launches [first, end) one by one; profiled, each worker's cost and HVX count per launch: the
   answer is 2 * MAX_WORKERS * (end - first) ticks. */
static uint32_t run_launches(const Graph *g, uint32_t first, uint32_t end, int flags,
                             unsigned long long *ticks) {
  static void *args[MAX_ARGS];
  const uint32_t *w = g->table;
  uint32_t n_run = end - first, timed = flags & FLAG_PROFILE;
  int serial = (flags & FLAG_SERIAL) || !start_pool();
  for (uint32_t i = 0; i < end; i++) {
    uint32_t n = *w++;
    if (i >= first) {
      for (uint32_t j = 0; j < n; j++)
        args[j] = w[j] & IO_ARG ? g->io[w[j] & ~IO_ARG] : g->shm + w[j];
      run_launch(g, (int)i, args, serial);
      for (uint32_t t = 0; timed && t < MAX_WORKERS; t++) {
        ticks[t * n_run + i - first] = pool.cost[t];
        ticks[(MAX_WORKERS + t) * n_run + i - first] = pool.hvx[t];
      }
    }
    w += n;
  }
  return timed ? 2 * MAX_WORKERS * n_run : 0;
}

/* One invoke: its patches are applied by the caller; serially, unprofiled, the whole graph in
   one call; otherwise launch by launch, profiled into `ticks` (room for 2 * MAX_WORKERS *
   launches) if asked. */
static Reply run_graph(const Graph *g, const Request *req, unsigned long long *ticks) {
  Reply reply = {req->seq, 0, 0, 0};
  if (req->first > req->end || req->end > g->launches) reply.status = 1;
  else if ((req->flags & (FLAG_SERIAL | FLAG_PROFILE)) == FLAG_SERIAL && req->first == 0 &&
           req->end == g->launches)
    g->graph(g->arena, g->weights, (void *const *)g->io);
  else reply.nticks = run_launches(g, req->first, req->end, req->flags, ticks);
  return reply;
}
