"""KEEL_KGSL=mock: a KGSL driver (mock_kgsl.py) whose GPU (mock_gpu.py) executes each dispatch's
OpenCL C on the host (execute.py: PoCL, or hostcl.py's clang `_Float16` build for half programs),
over mock program binaries (program.py)."""
