"""keel against onnxruntime on random small graphs (tests/fuzz_graphs.py)."""
from __future__ import annotations

from hypothesis import given, settings

from tests.fuzz_graphs import graph_strategy
from tests.graphs import assert_close, keel_run, ort_run

# Both sides compute in fp32, but keel lowers Exp/Log/Erf/Sigmoid/Tanh to its own polynomials
# (accurate to a few ulp, not libm's) and may reassociate sums and fuse multiply-adds. The graphs
# keep every |value| <= 64 and away from domain edges, so those differences stay near 1e-6
# relative; onnx's numpy reference meets this tolerance with >100x margin
# (test_fuzz_graphs_are_well_conditioned). rtol=1e-4 leaves room for polynomial error without
# hiding a wrong index or a dropped term, which is off by O(1).
RTOL, ATOL = 1e-4, 1e-5


@settings(max_examples=40, deadline=None)
@given(graph_strategy())
def test_keel_matches_onnxruntime_on_random_graphs(model_and_feeds):
    model, feeds = model_and_feeds
    want = ort_run(model, feeds)
    got = keel_run(model, feeds)
    assert sorted(got) == sorted(want), f"outputs {sorted(got)}, expected {sorted(want)}"
    for name, value in want.items():
        assert_close(got[name], value, RTOL, ATOL, what=name)
