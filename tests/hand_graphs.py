"""Hand-written C graphs packed into blobs: runner tests and benchmarks without the compiler.

Each graph is C source for keel_graph (the CPU device) and keel_launch (one launch of the replay
table, for the mock device) plus the buffer table that source assumes.
"""
from __future__ import annotations

import numpy as np

from compiler.artifact import Artifact, Buffer, Launch
from compiler.blob import write_blob
from compiler.toolchain import build_shared, host_target

HOST = host_target()

ADD_N = 1024
ADD_C = f"""
void keel_graph(unsigned char *arena, const unsigned char *weights, void *const *io) {{
  const float *a = io[0], *b = io[1];
  float *y = io[2];
  for (int i = 0; i < {ADD_N}; i++) y[i] = a[i] + b[i];
}}
void keel_launch(int launch, void *const *args) {{
  void *io[3] = {{args[1], args[2], args[0]}};  /* launch 0 is add(y, a, b) */
  keel_graph(0, 0, io);
}}
"""

CHAIN_N = 64
CHAIN_T_OFFSET = 128  # arena offset of the intermediate t
CHAIN_C = f"""
#include <stdint.h>
static void scale(float *restrict t, const uint8_t *restrict x, const float *restrict w) {{
  for (int i = 0; i < {CHAIN_N}; i++) t[i] = (float)x[i] * w[i];
}}
static void bias(float *restrict y, const float *restrict t, const float *restrict b) {{
  for (int i = 0; i < {CHAIN_N}; i++) y[i] = t[i] + b[i];
}}
void keel_graph(uint8_t *arena, const uint8_t *weights, void *const *io) {{
  scale((float *)(arena + {CHAIN_T_OFFSET}), io[0], (const float *)weights);
  bias(io[2], (const float *)(arena + {CHAIN_T_OFFSET}), io[1]);
}}
void keel_launch(int launch, void *const *args) {{
  if (launch == 0) scale(args[0], args[1], args[2]);
  else bias(args[0], args[1], args[2]);
}}
"""
CHAIN_W = (np.arange(CHAIN_N, dtype=np.float32) / 8 - 2).astype(np.float32)


def add_artifact(target: str = HOST) -> Artifact:
    """y = a + b over float32 (4, 256)."""
    a = Buffer(0, "input", 0, ADD_N * 4, "float32", (4, ADD_N // 4), "a", slot=0)
    b = Buffer(1, "input", 0, ADD_N * 4, "float32", (4, ADD_N // 4), "b", slot=1)
    y = Buffer(2, "output", 0, ADD_N * 4, "float32", (4, ADD_N // 4), "y", slot=2)
    return Artifact(target, [a, b], [y], [a, b, y], b"", 0, 0,
                    [Launch("add", (2, 0, 1), (ADD_N,))], build_shared(ADD_C, target),
                    {"graph": "add"})


def chain_artifact(target: str = HOST) -> Artifact:
    """t = float(x) * w (arena), y = t + b: two kernels, weights and an arena intermediate."""
    x = Buffer(0, "input", 0, CHAIN_N, "uint8", (1, CHAIN_N), "x", slot=0)
    b = Buffer(1, "input", 0, CHAIN_N * 4, "float32", (1, CHAIN_N), "b", slot=1)
    y = Buffer(2, "output", 0, CHAIN_N * 4, "float32", (1, CHAIN_N), "y", slot=2)
    w = Buffer(3, "weights", 0, CHAIN_N * 4, "float32", (CHAIN_N,))
    t = Buffer(4, "arena", CHAIN_T_OFFSET, CHAIN_N * 4, "float32", (CHAIN_N,))
    launches = [Launch("scale", (4, 0, 3), (CHAIN_N,)),
                Launch("bias", (2, 4, 1), (CHAIN_N,), barrier=True)]  # reads t
    return Artifact(target, [x, b], [y], [x, b, y, w, t], CHAIN_W.tobytes(),
                    CHAIN_T_OFFSET + CHAIN_N * 4, CHAIN_N * 4, launches,
                    build_shared(CHAIN_C, target), {"graph": "chain"})


def chain_reference(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) * CHAIN_W + b


def write(artifact: Artifact, path) -> str:
    write_blob(artifact, path)
    return str(path)


OPENPILOT_INPUTS = {"img": ((1, 12, 128, 256), "uint8"), "big_img": ((1, 12, 128, 256), "uint8"),
                    "desire_pulse": ((1, 25, 8), "float32"),
                    "traffic_convention": ((1, 2), "float32"), "action_t": ((1, 2), "float32"),
                    "features_buffer": ((1, 24, 512), "float32")}
OPENPILOT_OUT = 6500
OPENPILOT_C = f"""
#include <stdint.h>
void keel_graph(uint8_t *arena, const uint8_t *weights, void *const *io) {{
  const uint8_t *img = io[0];
  const float *features = io[5];
  float *out = io[6];
  for (int i = 0; i < {OPENPILOT_OUT}; i++) out[i] = img[i] * (1.0f / 255) + features[i];
}}
void keel_launch(int launch, void *const *args) {{
  void *io[7] = {{args[1], 0, 0, 0, 0, args[2], args[0]}};  /* launch 0 is head(out, img, fb) */
  keel_graph(0, 0, io);
}}
"""


def openpilot_io_artifact(target: str = HOST, weights_bytes: int = 0) -> Artifact:
    """openpilot's driving-model io signature around a trivial kernel: measures host overhead.
    `weights_bytes` of seeded random weights make the blob as big as a real model's."""
    inputs = [Buffer(i, "input", 0, int(np.prod(shape)) * np.dtype(dt).itemsize, dt, shape, name,
                     slot=i) for i, (name, (shape, dt)) in enumerate(OPENPILOT_INPUTS.items())]
    out = Buffer(len(inputs), "output", 0, OPENPILOT_OUT * 4, "float32",
                 (1, OPENPILOT_OUT), "outputs", slot=len(inputs))
    weights = np.random.default_rng(0).bytes(weights_bytes)
    return Artifact(target, inputs, [out], [*inputs, out], weights, 0, 0,
                    [Launch("head", (out.id, 0, 5), (OPENPILOT_OUT,))],
                    build_shared(OPENPILOT_C, target), {"graph": "openpilot_io"})
