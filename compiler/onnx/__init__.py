"""The ONNX frontend: registry (OPS, op, Ctx), load (graph -> tensor UOps), ops/ by topic."""
