"""keel's Hexagon DSP backend, device side: the DSP-side runtime (runtime.c), the runner device
"dsp" (device.py) and its transports: FastRPC on a comma device (fastrpc.py), qemu-hexagon in CI
(mock.py, KEEL_FASTRPC=mock). docs/dsp.md describes the whole path."""
