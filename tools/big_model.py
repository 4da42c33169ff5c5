"""A generated ONNX model of any size, for the big-model figures in docs/wild.md.

  python tools/big_model.py OUT.onnx --layers N [--width 4096] [--external]

A chain of N MatMuls of [1, W] by [W, W] float32 weights (N * W * W * 4 bytes: 24 layers of
4096 make 1.61 GB, 33 make 2.21 GB). With --external the weights go to OUT.onnx.data, written one
tensor at a time (a model over 2 GB must: protobuf cannot hold it), and the ONNX file names their
offsets. Weights are uniform in +-sqrt(3/W) (variance 1/W), so activations keep unit scale through depth.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


def weight(rng: np.random.Generator, width: int) -> np.ndarray:
    return (rng.random((width, width), dtype=np.float32) * 2 - 1) * np.float32((3 / width) ** 0.5)


def make(path: str, layers: int, width: int, external: bool) -> None:
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    data = open(f"{path}.data", "wb") if external else None
    for i in range(layers):
        w = weight(rng, width)
        if external:
            t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=w.shape)
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", os.path.basename(f"{path}.data")),
                               ("offset", str(data.tell())), ("length", str(w.nbytes))):
                t.external_data.add(key=key, value=value)
            data.write(w.tobytes())
        else:
            t = numpy_helper.from_array(w, f"w{i}")
        inits.append(t)
        nodes.append(helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"],
                                      [f"h{i}"]))
    if data:
        data.close()
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, width])], [helper.make_tensor_value_info(
            f"h{layers - 1}", TensorProto.FLOAT, [1, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--external", action="store_true", help="weights in OUT.onnx.data")
    args = ap.parse_args(argv)
    make(args.out, args.layers, args.width, args.external)
    size = os.path.getsize(args.out) + (os.path.getsize(f"{args.out}.data") if args.external
                                        else 0)
    print(f"wrote {args.out}: {size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
