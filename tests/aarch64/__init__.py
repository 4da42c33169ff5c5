"""A libc-free aarch64 harness and its qemu driver, for running cpu-aarch64 blobs on CI."""
