/* What keel's two DSP-side programs share: the emulated DSP (sim/dsp/runtime.c, a Linux program
   for qemu-hexagon) and the skel (dsp/skel.c, the library a cDSP user PD loads). Both hold one
   compiled graph (its keel_graph and keel_launch), one shared buffer and the launch table, and
   answer an invoke (a Request, then its patches) with {seq, status, nticks, 0} and nticks u64
   costs.

   A profiled invoke runs each launch of its range alone with a counter read around it and
   answers 2 * (end - first) ticks: per launch its cost, then per launch its HVX instructions. The cost is the
   Hexagon cycle counter (UPCYCLE) on the DSP; under qemu (KEEL_QEMU), qemu's own packet and HVX
   instruction counters, which the emulator keeps in control registers c20 and c22 (reserved on
   the hardware). The includer provides <stdint.h>. */
#include "keel_abi.h"  /* the programs' entry points, as every C blob exports them */
enum { FLAG_PROFILE = 1, MAX_LAUNCHES = 65536, MAX_ARGS = 64, MAX_SLOTS = 256 };
#define IO_ARG 0x80000000u /* a launch table word with this bit names io slot (word & ~IO_ARG) */

typedef __typeof__(keel_graph) graph_fn;
typedef __typeof__(keel_launch) launch_fn;
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

typedef struct {
  graph_fn *graph;
  launch_fn *launch;
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

/* Launches [first, end) one by one through keel_launch; profiled, with the cost and HVX count
   measured around each: the answer is 2 * (end - first) ticks. */
static uint32_t run_launches(const Graph *g, uint32_t first, uint32_t end, int timed,
                             unsigned long long *ticks) {
  static void *args[MAX_ARGS];
  const uint32_t *w = g->table;
  uint32_t n_run = end - first;
  for (uint32_t i = 0; i < end; i++) {
    uint32_t n = *w++;
    if (i >= first) {
      for (uint32_t j = 0; j < n; j++)
        args[j] = w[j] & IO_ARG ? g->io[w[j] & ~IO_ARG] : g->shm + w[j];
      unsigned long long c0 = COST(), h0 = HVX_OPS();
      g->launch((int)i, args);
      if (timed) {
        ticks[i - first] = (unsigned long long)COST() - c0;
        ticks[n_run + i - first] = (unsigned long long)HVX_OPS() - h0;
      }
    }
    w += n;
  }
  return timed ? 2 * n_run : 0;
}

/* One invoke: its patches are applied by the caller; the whole graph in one call, or a range (an
   entry point's) launch by launch, profiled into `ticks` (room for 2 * launches) if asked. */
static Reply run_graph(const Graph *g, const Request *req, unsigned long long *ticks) {
  Reply reply = {req->seq, 0, 0, 0};
  int timed = req->flags & FLAG_PROFILE;
  if (req->first > req->end || req->end > g->launches) reply.status = 1;
  else if (!timed && req->first == 0 && req->end == g->launches)
    g->graph(g->arena, g->weights, (void *const *)g->io);
  else reply.nticks = run_launches(g, req->first, req->end, timed, ticks);
  return reply;
}
