"""The compiled model as plain data: what the blob writer stores and the runner reads back.

No behaviour lives here. The compiler fills these in; `compiler/blob.py` serialises them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from runner.format import Region


@dataclass(frozen=True)
class Image:
    """How a GPU kernel reads a buffer as a 2D image.

    channels 4: a float16/float32 tensor as RGBA texels (OpenCL `read_imagef`), viewed as
    (height, inner) with inner = 4 * width: texel (x, y) holds elements [y * inner + 4x, +4).
    channels 1: a uint8 graph input as R8 unsigned-int texels (`read_imageui`), texel (x, y) the
    element y * width + x: a camera frame read by a gather (storage.py: io_image).
    In memory, row y starts `pitch` texels after row y - 1 (pitch >= width, a multiple of the
    target's pitch alignment), so the buffer can back an image directly
    (cl_khr_image2d_from_buffer); the texels from width to pitch are padding, never read."""
    width: int
    height: int
    pitch: int
    channels: int = 4


@dataclass(frozen=True)
class Buffer:
    id: int
    region: Region
    offset: int  # byte offset in the arena / the weights region; 0 for inputs and outputs
    nbytes: int
    dtype: str  # numpy dtype name: "float32", "uint8", ...
    shape: tuple[int, ...]
    name: str = ""  # graph name for inputs and outputs
    # GPU only: read through an image; nbytes then covers the pitched rows
    image: Image | None = None
    # inputs and outputs: the io slot the caller binds (inputs 0..n_in-1, then outputs n_in..,
    # each in order); None in the arena and the weights
    slot: int | None = None


@dataclass(frozen=True)
class Launch:
    kernel: str
    args: tuple[int, ...]  # Buffer ids in parameter order; outputs first
    global_size: tuple[int, ...] = (1,)
    local_size: tuple[int, ...] | None = None
    barrier: bool = False  # waits for every earlier launch (compiler/link/hazards.py)


@dataclass(frozen=True)
class Entry:
    """One named graph of a blob: its io buffers (state ones included) and its launches, which
    are launches[first:first + count] of the one replay table every entry shares."""
    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    first: int
    count: int


@dataclass(frozen=True)
class State:
    """A persistent buffer: the entries' graph inputs that read it and the graph outputs whose
    value replaces it after a run (docs/blob.md "state"). `init`: a weights buffer holding its
    initial value, or None for zeros. A ring (compiler/ring.py) shifts `step` rows in per run:
    its writes are those rows, `mirrors` (one per write) their second copy, `windows` the
    inputs that read the written value in the same run; step 0: ping-pong."""
    name: str
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    init: int | None = None
    step: int = 0
    mirrors: tuple[int, ...] = ()
    windows: tuple[int, ...] = ()


@dataclass
class Artifact:
    target: str  # the blob's target (`cpu`: one blob for every x86-64 host)
    inputs: list[Buffer]
    outputs: list[Buffer]
    buffers: list[Buffer]  # every buffer, io included
    weights: bytes
    arena_bytes: int
    arena_lower_bound_bytes: int
    launches: list[Launch]
    programs: bytes
    meta: dict = field(default_factory=dict)
    # the binaries section (runner/format.py pack_binaries): device binaries of `programs`
    binaries: bytes = b""
    # ONNX nodes per launch: {"nodes": [[name, op_type], ...], "launches": [[node index, ...]]}
    provenance: dict | None = None
    # the target this artifact's code was built for, when it is one variant of `target`
    # ("cpu-avx2" of a "cpu" blob); "" means `target` itself
    variant: str = ""
    # the target's other variants, written into the same blob; they share `weights`
    variants: list["Artifact"] = field(default_factory=list)
    # `weights` as the blob's weights sections (docs/blob.md): the sizes of the one every
    # variant reads, then of each variant's own, laid out as in the file. () means all shared
    weight_sections: tuple[int, ...] = ()
    # the named graphs (one, "main", for a single ONNX model) and the state they share
    entries: list[Entry] = field(default_factory=list)
    state: list[State] = field(default_factory=list)
    # [input index, weights buffer id]: inputs with a default value (an ONNX initializer that is
    # also a graph input), read when a run does not feed them
    defaults: list = field(default_factory=list)
