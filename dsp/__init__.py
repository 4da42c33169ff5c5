"""keel's Hexagon DSP backend, device side: the DSP-side library (skel.c, graph_runner.h), the
runner device "dsp" (device.py) and its transports: FastRPC on a comma device (fastrpc.py),
qemu-hexagon in CI (sim/dsp, KEEL_FASTRPC=mock). docs/dsp.md describes the whole path."""
