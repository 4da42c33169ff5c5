/* What keel's two DSP-side programs share: the emulated DSP (sim/dsp/runtime.c, a Linux program
   for qemu-hexagon) and the skel (dsp/skel.c, the library a cDSP user PD loads). Both hold one
   compiled graph (its keel_graph and keel_launch), one shared buffer and the launch table, and
   answer an invoke {seq, flags} with {seq, status, nticks, 0} and nticks u64 costs.

   A profiled invoke runs each launch alone with a counter read around it and answers
   2 * launches ticks: per launch its cost, then per launch its HVX instructions. The cost is the
   Hexagon cycle counter (UPCYCLE) on the DSP; under qemu (KEEL_QEMU), qemu's own packet and HVX
   instruction counters, which the emulator keeps in control registers c20 and c22 (reserved on
   the hardware). The includer provides <stdint.h>. */
#include "keel_abi.h"  /* the programs' entry points, as every C blob exports them */
enum { FLAG_PROFILE = 1, MAX_LAUNCHES = 65536, MAX_ARGS = 64 };

typedef __typeof__(keel_graph) graph_fn;
typedef __typeof__(keel_launch) launch_fn;
typedef struct { uint32_t seq, status, nticks, pad; } Reply;

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
  const uint32_t *table;  /* per launch: its argument count, then each argument's offset */
  uint32_t words, launches;
  unsigned char *shm, *arena, *weights;
  void *const *io;
} Graph;

/* The launch table checked once (argument counts, offsets inside the shared buffer); sets
   g->launches. Returns what is wrong, or 0. */
static const char *check_table(Graph *g, uint32_t shm_size) {
  g->launches = 0;
  for (uint32_t k = 0; k < g->words; g->launches++) {
    uint32_t n = g->table[k++];
    if (n > MAX_ARGS || k + n > g->words) return "launch table: bad argument count";
    for (uint32_t j = 0; j < n; j++)
      if (g->table[k++] >= shm_size) return "launch table: argument past the shared buffer";
  }
  return g->launches > MAX_LAUNCHES ? "launch table: too many launches" : 0;
}

/* every launch alone, its cost and HVX count measured around it; the answer is 2 * launches */
static uint32_t profile(const Graph *g, unsigned long long *ticks) {
  static void *args[MAX_ARGS];
  const uint32_t *w = g->table, *end = g->table + g->words;
  for (uint32_t i = 0; i < g->launches; i++) {
    uint32_t n = *w++;
    for (uint32_t j = 0; j < n; j++) args[j] = g->shm + w[j];
    w += n;
    unsigned long long c0 = COST(), h0 = HVX_OPS();
    g->launch((int)i, args);
    ticks[i] = (unsigned long long)COST() - c0;
    ticks[g->launches + i] = (unsigned long long)HVX_OPS() - h0;
  }
  return w == end ? 2 * g->launches : 0;
}

/* One invoke: the whole graph, or each launch profiled into `ticks` (room for 2 * launches). */
static Reply run_graph(const Graph *g, uint32_t seq, uint32_t flags, unsigned long long *ticks) {
  Reply reply = {seq, 0, 0, 0};
  if (flags & FLAG_PROFILE) reply.status = !(reply.nticks = profile(g, ticks));
  else g->graph(g->arena, g->weights, g->io);
  return reply;
}
