/* keel's C entry ABI, declared once: the entry points a C blob's programs export (CPU targets:
   one shared object; dsp: one Hexagon shared object) and the struct their threads share. The C
   renderer pastes this file into every program it writes (compiler/renderers/c.py); the CPU and
   mock devices declare it to cffi (runner/cpu.py, runner/mock.py); the DSP-side programs include
   it (dsp/graph_runner.h) and so does the aarch64 test harness (tests/aarch64/harness.c);
   runner/abi.py names its symbols for Python. Declarations only, no preprocessor lines: cffi
   reads it as it is; a C includer includes <stdint.h> first.

   Arguments: `arena` is the plan's scratch memory, `weights` the blob's weights region, `io` the
   io slots in slot order (inputs, then outputs), each the address of its tensor's first byte.
     keel_graph(arena, weights, io)                  the whole graph on one thread
     keel_graph_mt(arena, weights, io, tid, nt, s)   called by nt threads at once, tid 0..nt-1,
                                                     all with one keel_sync, zeroed but for
                                                     the launch range [first, end) (an entry
                                                     point's; end 0: to the last)
     keel_profile(..., tid, nt, s, ticks)            keel_graph_mt storing this thread's cycle
                                                     counter before and after launch i in
                                                     ticks[2i] and ticks[2i + 1]
     keel_ticks()                                    the cycle counter, to calibrate it
     keel_launch(i, args)                            launch i of the blob's replay table alone,
                                                     args[j] the address of its j-th buffer
     keel_launch_part(i, args, tid, nt)              share tid of nt of launch i: its kernel's
                                                     outermost output loop split nt ways (the
                                                     DSP's hardware threads, dsp/graph_runner.h)
     keel_split(i)                                   how launch i shares: 0 not at all (share 0
                                                     does it all), 1 split, 2 split and on
                                                     vectors (HVX on the DSP)

   keel_sync: the threads' barrier (count, sense) and what the runner supplies to it: yield_fn
   (sched_yield) gives a waiting thread's core away when the machine is oversubscribed;
   clock_fn(clock_id, &now) (clock_gettime) and deadline_ns (on that clock) let a barrier give up
   at the run's deadline when a share never arrives, setting `abort` so every later barrier
   passes. Null functions: spin, and never give up. */
typedef struct { long long sec; long nsec; } keel_ts;
typedef struct {
  int count, sense; int (*yield_fn)(void);
  int (*clock_fn)(int, keel_ts *); int clock_id; int abort; long long deadline_ns;
  int first, end;
} keel_sync;
void keel_graph(uint8_t *arena, const uint8_t *weights, void *const *io);
void keel_graph_mt(uint8_t *arena, const uint8_t *weights, void *const *io, int tid,
                   int nt, keel_sync *sync);
void keel_profile(uint8_t *arena, const uint8_t *weights, void *const *io, int tid,
                  int nt, keel_sync *sync, unsigned long long *ticks);
unsigned long long keel_ticks(void);
void keel_launch(int launch, void *const *args);
void keel_launch_part(int launch, void *const *args, int tid, int nt);
int keel_split(int launch);
