"""Tensor graph -> kernels and buffers: constant folding, fusion, layouts, storage, memory plan."""
