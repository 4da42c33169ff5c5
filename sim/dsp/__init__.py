"""KEEL_FASTRPC=mock: dsp's runtime (runtime.c, which includes dsp/skel.c) as a static Hexagon
Linux program under qemu-hexagon, driven by mock.py in place of FastRPC."""
