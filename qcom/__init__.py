"""Adreno 630 through KGSL directly: the UAPI (kgsl.py), PM4 packets (cmdstream.py); its mock is
sim/qcom."""
