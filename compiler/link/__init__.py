"""The link stage: buffers, packed weights, launches, the arena and barriers (link.py)."""
