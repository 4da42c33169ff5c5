"""The OpenCL builtins keel's kernels call, defined for amdgcn (targets with cl_builtins="amdgcn").

clang compiles OpenCL C for amdgcn-amd-amdhsa, but get_global_id, vloadN, vstore_halfN and
barrier live in the ROCm device library, which keel does not ship (`-nogpulib`). The program
defines exactly those overloads instead, under `#ifdef __AMDGCN__`, so the same text is still
plain OpenCL C for any other compiler (the mock GPU runs it on PoCL, which takes its library's).

Work-item ids come from the dispatch: workgroup id (an SGPR) x workgroup size (a hidden kernel
argument, code object v5: `hidden_group_size_*`, filled by am/ from the kernel's metadata) +
workitem id (a VGPR). vstore_half rounds to nearest even, which is what a float -> half conversion
does; half is a storage type here (Target.half_compute is off), so nothing else touches it.
"""
from __future__ import annotations

OV = "static inline __attribute__((overloadable, always_inline))"
WIDTHS = (2, 3, 4)
LANES = "xyzw"
GLOBAL_ID = ("(__builtin_amdgcn_workgroup_id_{0}() * __builtin_amdgcn_workgroup_size_{0}() + "
             "__builtin_amdgcn_workitem_id_{0}())")


def _dim(pattern: str) -> str:
    """`pattern` with {} as x, y, z chosen by d at run time (d is a constant after inlining)."""
    x, y, z = (pattern.format(c) for c in "xyz")
    return f"d == 0 ? {x} : d == 1 ? {y} : {z}"


def _vector(n: int, load: str) -> str:
    """A float vector built from n scalar reads; `load` has {} for the lane."""
    return f"(float{n})({', '.join(load.format(k) for k in range(n))})"


def _loads_stores() -> list[str]:
    out = []
    for space in ("__global", "__private"):
        out.append(f"{OV} float vload_half(size_t i, const {space} half *p) "
                   f"{{ return (float)p[i]; }}")
        out.append(f"{OV} void vstore_half(float v, size_t i, {space} half *p) "
                   f"{{ p[i] = (half)v; }}")
    for n in WIDTHS:
        put = " ".join(f"q[{k}] = v.{LANES[k]};" for k in range(n))
        put_h = " ".join(f"q[{k}] = (half)v.{LANES[k]};" for k in range(n))
        out += [
            f"{OV} float{n} vload{n}(size_t i, const __global float *p) "
            f"{{ const __global float *q = p + {n} * i; return {_vector(n, 'q[{}]')}; }}",
            f"{OV} void vstore{n}(float{n} v, size_t i, __global float *p) "
            f"{{ __global float *q = p + {n} * i; {put} }}",
            f"{OV} float{n} vload_half{n}(size_t i, const __global half *p) "
            f"{{ const __global half *q = p + {n} * i; return {_vector(n, '(float)q[{}]')}; }}",
            f"{OV} void vstore_half{n}(float{n} v, size_t i, __global half *p) "
            f"{{ __global half *q = p + {n} * i; {put_h} }}",
        ]
    return out


def prelude() -> str:
    """Definitions for the top of the program; empty for any compiler but amdgcn's."""
    ids = [
        f"{OV} size_t get_local_id(uint d) {{ return "
        f"{_dim('__builtin_amdgcn_workitem_id_{}()')}; }}",
        f"{OV} size_t get_global_id(uint d) {{ return {_dim(GLOBAL_ID)}; }}",
        # a work-group barrier that also orders local memory: release, s_barrier, acquire
        f"{OV} void barrier(cl_mem_fence_flags f) {{ "
        f"__builtin_amdgcn_fence(__ATOMIC_RELEASE, \"workgroup\"); __builtin_amdgcn_s_barrier(); "
        f"__builtin_amdgcn_fence(__ATOMIC_ACQUIRE, \"workgroup\"); }}",
    ]
    return "\n".join(["#ifdef __AMDGCN__", "#pragma OPENCL EXTENSION cl_khr_fp16 : enable",
                      *ids, *_loads_stores(), "#endif"])
