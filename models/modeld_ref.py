"""openpilot's modeld step in numpy: the reference keel's pipeline blob is tested against.

Written from the published algorithm (openpilot's selfdrive/modeld/compile_modeld.py,
compile_dm_warp.py and system/camerad/cameras/nv12_info.py), in the most literal form: warp the
whole Y plane, deinterleave U and V, then cut the Y phases. models/modeld_step.py computes the
same pixels another way (one gather of six planes), so the two check each other.

- NV12 layout: row stride aligned to 128, Y plane height to 32, UV plane height to 16; the UV
  plane starts at stride * y_height and holds U, V interleaved.
- Warp: nearest neighbour by inverse homography. For each model pixel (x, y), src = M_inv @
  (x, y, 1), divided by its third coordinate, rounded half to even, clipped to the image and
  indexed with the row stride. Y is warped at the model size, U and V at half size with M_inv
  scaled elementwise by UV_SCALE ([[1,1,.5],[1,1,.5],[2,2,1]] = S @ M_inv @ S^-1, S = diag(.5,
  .5, 1)). All arithmetic in float32.
- Packing: six uint8 (H/2, W/2) planes, Y[0::2, 0::2], Y[1::2, 0::2], Y[0::2, 1::2],
  Y[1::2, 1::2], U, V.
- Queues, zero at the start: each new entry shifts in at the end (queue[1:] + new):
  img_q/big_img_q (fs*(n_frames-1)+1, 6, H/2, W/2) and feat_q (fs*24+1, 1, 512) are sampled
  every fs-th row from the oldest; desire_q (fs*25, 1, 8) is max-pooled over each window of fs.
- run_policy: warp both frames, enqueue, vision on the sampled frames; the vision output's
  hidden_state slice enters feat_q, the desire enters desire_q, then the policy. warp_enqueue
  (a frame whose model run is skipped) does only the warp and the frame queues.

A pixel whose source coordinate lies within NEAR px of a rounding boundary (k + 0.5) can round
either way under another float evaluation order (fused multiply-add, a GPU's division): `warp`
returns a mask of them beside the pixels.
"""
from __future__ import annotations

import dataclasses
from collections import namedtuple

import numpy as np

Nv12 = namedtuple("Nv12", "width height stride y_height uv_height size")
UV_SCALE = np.array([[1, 1, .5], [1, 1, .5], [2, 2, 1]], np.float32)
NEAR = 1e-3  # px: the rounding-boundary band whose pixels may differ between evaluations
Y_PHASES = ((0, 0), (1, 0), (0, 1), (1, 1))  # (row, column) offsets of planes 0..3


def align(v: int, a: int) -> int:
    return -(-v // a) * a


def nv12_layout(width: int, height: int) -> Nv12:
    """The VENUS NV12 buffer openpilot's cameras fill (msm_media_info.h's VENUS_BUFFER_SIZE)."""
    stride, y_height, uv_height = align(width, 128), align(height, 32), align(height // 2, 16)
    size = stride * y_height + stride * uv_height + 4096 + max(16 * 1024, 8 * stride)
    size = align(align(size, 4096) + align(width, 512) * 512, 4096)
    return Nv12(width, height, stride, y_height, uv_height, size)


def warp(src: np.ndarray, m_inv: np.ndarray, dst_w: int, dst_h: int, src_w: int, src_h: int,
         row_stride: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (dst_h, dst_w) pixels of the flat `src`, and where they are near a rounding boundary."""
    m = np.asarray(m_inv, np.float32)
    x = np.arange(dst_w, dtype=np.float32)[None, :]
    y = np.arange(dst_h, dtype=np.float32)[:, None]
    sx = m[0, 0] * x + m[0, 1] * y + m[0, 2]
    sy = m[1, 0] * x + m[1, 1] * y + m[1, 2]
    sw = m[2, 0] * x + m[2, 1] * y + m[2, 2]
    sx, sy = sx / sw, sy / sw
    xi = np.clip(np.round(sx), 0, src_w - 1).astype(np.int64)
    yi = np.clip(np.round(sy), 0, src_h - 1).astype(np.int64)
    return src[yi * row_stride + xi], near_half(sx) | near_half(sy)


def near_half(s: np.ndarray) -> np.ndarray:
    s = s.astype(np.float64)
    return np.abs(s - np.floor(s) - 0.5) < NEAR


def prepare_frame(frame: np.ndarray, m_inv: np.ndarray, nv12: Nv12, model_w: int,
                  model_h: int) -> tuple[np.ndarray, np.ndarray]:
    """One NV12 camera frame -> (6, H/2, W/2) uint8 planes and their near-boundary mask."""
    w, h, stride = nv12.width, nv12.height, nv12.stride
    y, y_near = warp(frame[:h * stride], m_inv, model_w, model_h, w, h, stride)
    uv = frame[stride * nv12.y_height:][:nv12.uv_height * stride].reshape(nv12.uv_height, stride)
    m_uv = np.asarray(m_inv, np.float32) * UV_SCALE
    chroma = [warp(np.ascontiguousarray(uv[:h // 2, col:w:2]).reshape(-1), m_uv, model_w // 2,
                   model_h // 2, w // 2, h // 2, w // 2) for col in (0, 1)]
    planes = [y[dy::2, dx::2] for dy, dx in Y_PHASES] + [c for c, _ in chroma]
    near = [y_near[dy::2, dx::2] for dy, dx in Y_PHASES] + [n for _, n in chroma]
    return np.stack(planes), np.stack(near)


def dm_warp(frame: np.ndarray, m_inv: np.ndarray, nv12: Nv12, dm_w: int,
            dm_h: int) -> tuple[np.ndarray, np.ndarray]:
    """The driver camera's Y plane warped to the DM model's input: (1, dm_h * dm_w) uint8."""
    w, h, stride = nv12.width, nv12.height, nv12.stride
    y, near = warp(frame[:h * stride], m_inv, dm_w, dm_h, w, h, stride)
    return y.reshape(1, -1), near.reshape(1, -1)


def shift(queue: np.ndarray, new: np.ndarray) -> np.ndarray:
    return np.concatenate([queue[1:], new.reshape(1, *queue.shape[1:]).astype(queue.dtype)])


def sample_skip(queue: np.ndarray, fs: int) -> np.ndarray:
    return queue[::fs].reshape(1, -1, *queue.shape[2:])


def sample_desire(queue: np.ndarray, fs: int) -> np.ndarray:
    return queue.reshape(-1, fs, *queue.shape[1:]).max(1).reshape(1, -1, queue.shape[-1])


def queue_shapes(img_shape: tuple, features_shape: tuple, desire_shape: tuple,
                 fs: int) -> dict[str, tuple[tuple, np.dtype]]:
    """Queue name -> (shape, dtype), from the vision `img` and the policy `features_buffer`
    and `desire_pulse` input shapes."""
    n_frames, planes = img_shape[1] // 6, (6, img_shape[2], img_shape[3])
    frames = ((fs * (n_frames - 1) + 1, *planes), np.dtype(np.uint8))
    return {"img_q": frames, "big_img_q": frames,
            "feat_q": ((fs * (features_shape[1] - 1) + 1, 1, features_shape[2]),
                       np.dtype(np.float32)),
            "desire_q": ((fs * desire_shape[1], 1, desire_shape[2]), np.dtype(np.float32))}


@dataclasses.dataclass
class Step:
    """The modeld step with its queues. vision/policy: callables {input: array} -> (1, N) array
    (onnxruntime sessions in the tests: `ort_runner`)."""
    vision: object
    policy: object
    hidden_state: slice  # the vision output's slice that enters feat_q
    fs: int
    model_w: int
    model_h: int
    queues: dict

    @classmethod
    def zeros(cls, vision, policy, hidden_state: slice, fs: int, model_size: tuple,
              shapes: dict) -> "Step":
        queues = {n: np.zeros(s, d) for n, (s, d) in shapes.items()}
        return cls(vision, policy, hidden_state, fs, *model_size, queues)

    def warp_enqueue(self, nv12: Nv12, frame, big_frame, tfm, big_tfm) -> np.ndarray:
        """-> the near-boundary mask of both new entries, (2, 6, H/2, W/2)."""
        masks = []
        for q, f, m in (("img_q", frame, tfm), ("big_img_q", big_frame, big_tfm)):
            planes, near = prepare_frame(f, m, nv12, self.model_w, self.model_h)
            self.queues[q] = shift(self.queues[q], planes)
            masks.append(near)
        return np.stack(masks)

    def run_policy(self, nv12: Nv12, frame, big_frame, tfm, big_tfm, desire, traffic_convention,
                   **extra) -> tuple[dict, np.ndarray]:
        """-> ({vision_out, policy_out}, the near-boundary mask of both new frame entries).
        `extra`: any further policy inputs, passed as they are."""
        near = self.warp_enqueue(nv12, frame, big_frame, tfm, big_tfm)
        return self.infer(desire, traffic_convention, **extra), near

    def infer(self, desire, traffic_convention, **extra) -> dict:
        """run_policy after its warp: vision on the frame queues, the feature and desire queues
        shifted, the policy."""
        q, fs = self.queues, self.fs
        vision_out = self.vision({"img": sample_skip(q["img_q"], fs),
                                  "big_img": sample_skip(q["big_img_q"], fs)}).astype(np.float32)
        q["feat_q"] = shift(q["feat_q"], vision_out[:, self.hidden_state])
        q["desire_q"] = shift(q["desire_q"], np.asarray(desire, np.float32))
        policy_out = self.policy({"features_buffer": sample_skip(q["feat_q"], fs),
                                  "desire_pulse": sample_desire(q["desire_q"], fs),
                                  "traffic_convention": np.asarray(traffic_convention,
                                                                   np.float32).reshape(1, -1),
                                  **extra}).astype(np.float32)
        return {"vision_out": vision_out, "policy_out": policy_out}


def ort_runner(model):
    """An onnxruntime session of `model` (a ModelProto or path) as a callable of its feeds,
    returning its first output."""
    import onnxruntime as ort  # test and tool dependency only
    data = model if isinstance(model, str) else model.SerializeToString()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)[0]


def random_tfm(rng: np.random.Generator, cam: tuple[int, int], model: tuple[int, int]):
    """An inverse homography like openpilot's calibrated warp (model pixel -> camera pixel):
    scale near cam/model, a small rotation, a small perspective term, and an offset that puts
    part of the model view outside the camera so clipping is exercised."""
    s = cam[0] / model[0] * rng.uniform(0.6, 1.1)
    a = rng.uniform(-0.05, 0.05)
    tx = rng.uniform(-0.1, 0.3) * cam[0]
    ty = rng.uniform(-0.1, 0.4) * cam[1]
    p = rng.normal(0, 1e-4, 2)
    return np.array([[s * np.cos(a), -s * np.sin(a), tx], [s * np.sin(a), s * np.cos(a), ty],
                     [p[0], p[1], 1.0]], np.float32)
