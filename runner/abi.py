"""keel's C entry ABI for Python: the header that declares it once (runner/keel_abi.h: the entry
points, their argument encoding and keel_sync) and the names of its symbols."""
from __future__ import annotations

from pathlib import Path

HEADER = Path(__file__).with_name("keel_abi.h")
GRAPH, GRAPH_MT, PROFILE = "keel_graph", "keel_graph_mt", "keel_profile"
TICKS, LAUNCH = "keel_ticks", "keel_launch"
LAUNCH_PART, SPLIT = "keel_launch_part", "keel_split"


def declarations() -> str:
    """The header's text: C declarations that cffi and a C compiler both read as they are."""
    return HEADER.read_text()
