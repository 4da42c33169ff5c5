"""OpenCL C built for the host with clang, in IEEE half: the executor of keel's `--float16` kernels
where no OpenCL device has cl_khr_fp16 (CI: PoCL 3.1).

A shim header maps OpenCL C onto C with clang's `_Float16` for `half`, and
`-ffloat16-excess-precision=none` makes every half operation round to half, as the Adreno's ALU
does (clang's default on x86 keeps half expressions in float until an assignment, which would
hide fp16 error). Images read texels from the pitched buffer with clamp-to-border (RGBA fp16/fp32
with read_imagef/h, R8 uint with read_imageui); work-group
kernels with barriers run each group's work items as coroutines (ucontext) that yield at every
barrier.

`build(src)` gives a library with one `run_<kernel>(void **args, int gs[3], int ls[3])` per kernel:
args are buffer pointers, or pointers to an `Image` for image2d_t parameters. Two users:
sim/qcom/mock_kgsl.py's GPU (every dispatch of a half program) and tests/halfhost.py (a whole
artifact on the host, for fp16 error measurements).
"""
from __future__ import annotations

import ctypes
import platform
import re
import subprocess
import hashlib
from pathlib import Path

from runner import cache

CLANG = "clang-19"
# x86-64's baseline has no half conversions: without F16C every half operation is two libcalls
HOST_FLAGS = ["-mf16c"] if platform.machine() == "x86_64" else []
VECTOR_TYPES = "half|float|int|uint|short|ushort|char|uchar"

SHIM = r"""
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <ucontext.h>
typedef _Float16 half; typedef unsigned char uchar; typedef unsigned short ushort;
typedef unsigned int uint; typedef unsigned long ulong;
#define VEC(t) typedef t t##2 __attribute__((ext_vector_type(2))); \
  typedef t t##3 __attribute__((ext_vector_type(3))); \
  typedef t t##4 __attribute__((ext_vector_type(4)));
VEC(half) VEC(float) VEC(int) VEC(uint) VEC(short) VEC(ushort) VEC(char) VEC(uchar)
#define __kernel
#define __global
#define __constant static const
#define __private
#define __read_only
#define __local static  /* one work-group runs at a time */
typedef int sampler_t;
#define CLK_NORMALIZED_COORDS_FALSE 0
#define CLK_ADDRESS_CLAMP 0
#define CLK_FILTER_NEAREST 0
#define CLK_LOCAL_MEM_FENCE 0
typedef struct { const void *data; int width, height, pitch, is_half, is_u8; } image2d_t;

static int keel_gid[3], keel_lid[3];
static inline int get_global_id(int d) { return keel_gid[d]; }
static inline int get_local_id(int d) { return keel_lid[d]; }
static void barrier(int fence);

#define KEEL_VL(n) \
  static inline half##n keel_vl##n##h(int o, const half *p) { \
    half##n v; for (int i = 0; i < n; i++) v[i] = p[o * n + i]; return v; } \
  static inline float##n keel_vl##n##f(int o, const float *p) { \
    float##n v; for (int i = 0; i < n; i++) v[i] = p[o * n + i]; return v; } \
  static inline void keel_vs##n##h(half##n v, int o, half *p) { \
    for (int i = 0; i < n; i++) p[o * n + i] = v[i]; } \
  static inline void keel_vs##n##f(float##n v, int o, float *p) { \
    for (int i = 0; i < n; i++) p[o * n + i] = v[i]; } \
  static inline float##n vload_half##n(int o, const half *p) { \
    float##n v; for (int i = 0; i < n; i++) v[i] = p[o * n + i]; return v; } \
  static inline void vstore_half##n(float##n v, int o, half *p) { \
    for (int i = 0; i < n; i++) p[o * n + i] = (half)v[i]; }
KEEL_VL(2) KEEL_VL(3) KEEL_VL(4)
#define KEEL_PICK(p, h, f) _Generic((p), half *: h, const half *: h, float *: f, const float *: f)
#define vload2(o, p) KEEL_PICK(p, keel_vl2h, keel_vl2f)(o, p)
#define vload3(o, p) KEEL_PICK(p, keel_vl3h, keel_vl3f)(o, p)
#define vload4(o, p) KEEL_PICK(p, keel_vl4h, keel_vl4f)(o, p)
#define vstore2(v, o, p) KEEL_PICK(p, keel_vs2h, keel_vs2f)(v, o, p)
#define vstore3(v, o, p) KEEL_PICK(p, keel_vs3h, keel_vs3f)(v, o, p)
#define vstore4(v, o, p) KEEL_PICK(p, keel_vs4h, keel_vs4f)(v, o, p)
static inline float vload_half(int o, const half *p) { return p[o]; }
static inline void vstore_half(float x, int o, half *p) { p[o] = (half)x; }

static inline half keel_sqrth(half x) { return (half)sqrtf((float)x); } /* float sqrt rounds once */
#define sqrt(x) _Generic((x), half: keel_sqrth, float: sqrtf, double: sqrt)(x)
#define KEEL_AS(t, x) (((union { __typeof__(x) a; t b; }){ .a = (x) }).b)
#define as_int(x) KEEL_AS(int, x)
#define as_uint(x) KEEL_AS(uint, x)
#define as_float(x) KEEL_AS(float, x)
#define as_half(x) KEEL_AS(half, x)
#define as_short(x) KEEL_AS(short, x)
#define as_ushort(x) KEEL_AS(ushort, x)

static inline float4 read_imagef(image2d_t im, int s, int2 c) {
  (void)s;
  if (c.x < 0 || c.y < 0 || c.x >= im.width || c.y >= im.height) return (float4)0.0f;
  long i = ((long)c.y * im.pitch + c.x) * 4;
  if (im.is_half) { const half *h = im.data; return (float4){h[i], h[i + 1], h[i + 2], h[i + 3]}; }
  const float *f = im.data;
  return (float4){f[i], f[i + 1], f[i + 2], f[i + 3]};
}
static inline half4 read_imageh(image2d_t im, int s, int2 c) {
  if (!im.is_half) return __builtin_convertvector(read_imagef(im, s, c), half4);
  if (c.x < 0 || c.y < 0 || c.x >= im.width || c.y >= im.height) return (half4)(half)0;
  const half *h = im.data;
  long i = ((long)c.y * im.pitch + c.x) * 4;
  return (half4){h[i], h[i + 1], h[i + 2], h[i + 3]};
}

static inline uint4 read_imageui(image2d_t im, int s, int2 c) {  /* R8 uint: (r, 0, 0, 1) */
  (void)s;
  if (!im.is_u8) abort();
  if (c.x < 0 || c.y < 0 || c.x >= im.width || c.y >= im.height) return (uint4){0, 0, 0, 0};
  return (uint4){((const uchar *)im.data)[(long)c.y * im.pitch + c.x], 0, 0, 1};
}

typedef void (*keel_item)(void **);
static keel_item keel_f; static void **keel_a;
static ucontext_t keel_sched, *keel_ctx;
static int keel_cur, *keel_done;
static void barrier(int fence) { (void)fence; swapcontext(&keel_ctx[keel_cur], &keel_sched); }
static void keel_trampoline(void) { keel_f(keel_a); keel_done[keel_cur] = 1; }
static void keel_ids(int i, const int *g, const int *ls) {
  int l[3] = {i % ls[0], i / ls[0] % ls[1], i / (ls[0] * ls[1])};
  for (int d = 0; d < 3; d++) { keel_lid[d] = l[d]; keel_gid[d] = g[d] + l[d]; }
}
/* One work-group whose items meet at barriers: each item is a coroutine; a round runs every
   unfinished item up to its next barrier (or its end), so no item passes a barrier early. */
static void keel_group(int n, const int *g, const int *ls, char *stacks, size_t size) {
  for (int i = 0; i < n; i++) {
    getcontext(&keel_ctx[i]);
    keel_ctx[i].uc_stack.ss_sp = stacks + i * size; keel_ctx[i].uc_stack.ss_size = size;
    keel_ctx[i].uc_link = &keel_sched; keel_done[i] = 0;
    makecontext(&keel_ctx[i], keel_trampoline, 0);
  }
  for (int left = n; left;) {
    left = 0;
    for (keel_cur = 0; keel_cur < n; keel_cur++) {
      if (keel_done[keel_cur]) continue;
      keel_ids(keel_cur, g, ls);
      swapcontext(&keel_sched, &keel_ctx[keel_cur]);
      left += !keel_done[keel_cur];
    }
  }
}
/* Every work item of gs, one work-group (ls) at a time. */
static void keel_launch(keel_item f, void **a, const int *gs, const int *ls, int barriers) {
  int n = ls[0] * ls[1] * ls[2];
  size_t size = 64 * 1024;
  char *stacks = barriers ? malloc(n * size) : 0;
  keel_f = f; keel_a = a;
  keel_ctx = malloc(n * sizeof *keel_ctx); keel_done = malloc(n * sizeof *keel_done);
  for (int z = 0; z < gs[2]; z += ls[2]) for (int y = 0; y < gs[1]; y += ls[1])
  for (int x = 0; x < gs[0]; x += ls[0]) {
    int g[3] = {x, y, z};
    if (barriers) { keel_group(n, g, ls, stacks, size); continue; }
    for (int i = 0; i < n; i++) { keel_ids(i, g, ls); f(a); }
  }
  free(stacks); free(keel_ctx); free(keel_done);
}
"""


def _vector_literals(src: str) -> str:
    """OpenCL's `(half2)(a, b)` is a cast of a comma expression in C: make it `((half2){a, b})`.
    A single operand stays a cast, which splats a scalar as OpenCL does."""
    pat, out, i = re.compile(rf"\(({VECTOR_TYPES})([234])\)\("), [], 0
    while (m := pat.search(src, i)) is not None:
        depth, j, commas = 1, m.end(), 0
        while depth:
            depth += {"(": 1, ")": -1}.get(src[j], 0)
            commas += src[j] == "," and depth == 1
            j += 1
        inner = _vector_literals(src[m.end():j - 1])
        typ = m.group(1) + m.group(2)
        out += [src[i:m.start()], f"(({typ}){{{inner}}})" if commas else f"(({typ})({inner}))"]
        i = j
    return "".join(out + [src[i:]])


def kernels(src: str) -> list[tuple[str, list[str]]]:
    """(name, parameter declarations) of every kernel."""
    return [(m.group(1), [p.strip() for p in m.group(2).split(",")])
            for m in re.finditer(r"__kernel void (\w+)\(([^)]*)\)", src)]


def _wrapper(name: str, params: list[str], barrier: bool) -> str:
    args = []
    for i, p in enumerate(params):
        typ = re.sub(r"\s*\w+$", "", p)  # drop the parameter name
        args.append(f"*(image2d_t *)a[{i}]" if "image2d_t" in typ else f"({typ})a[{i}]")
    return (f"static void item_{name}(void **a) {{ {name}({', '.join(args)}); }}\n"
            f"void run_{name}(void **a, const int *gs, const int *ls) "
            f"{{ keel_launch(item_{name}, a, gs, ls, {int(barrier)}); }}\n")


def to_c(src: str) -> str:
    """The host C for one program source: the shim, the kernels, a run_<kernel> entry each."""
    body = "\n".join(line for line in src.splitlines() if not line.startswith("#pragma OPENCL"))
    body = re.sub(r"__attribute__\(\(reqd_work_group_size\([^)]*\)\)\)", "", body)
    body = _vector_literals(body)
    wrappers = [_wrapper(n, ps, "barrier(" in _kernel_body(src, n)) for n, ps in kernels(src)]
    return SHIM + body + "\n" + "".join(wrappers)


def _kernel_body(src: str, name: str) -> str:
    start = src.index(f"__kernel void {name}(")
    end = src.find("__kernel void", start + 1)
    return src[start:end if end > 0 else len(src)]


def build(src: str, workdir: Path | None = None) -> ctypes.CDLL:
    """The host library of an OpenCL C program; built in `workdir`, or once into the cache's
    hostcl/ folder, by the hash of its C text (runner/cache.py: workdir)."""
    text = to_c(src)
    flags = ["-std=gnu11", "-O1", "-fPIC", "-shared", *HOST_FLAGS,
             "-Xclang", "-ffloat16-excess-precision=none", "-Wno-unknown-attributes"]
    key = hashlib.sha256("\0".join([CLANG, *flags, text]).encode()).hexdigest()[:24]
    folder = workdir or cache.workdir("hostcl")
    so = folder / f"{key}.so"
    if workdir is not None or not so.exists():
        c = cache.create(folder / f"{key}.c", lambda tmp: tmp.write_text(text))
        cache.create(so, lambda tmp: subprocess.run([CLANG, *flags, str(c), "-o", str(tmp), "-lm"],
                                                    check=True, capture_output=True, text=True))
    return ctypes.CDLL(str(so))


class Image(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("width", ctypes.c_int), ("height", ctypes.c_int),
                ("pitch", ctypes.c_int), ("is_half", ctypes.c_int), ("is_u8", ctypes.c_int)]


