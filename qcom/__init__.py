"""Adreno 630 through KGSL directly: the UAPI (kgsl.py), PM4 packets (cmdstream.py), a mock."""
