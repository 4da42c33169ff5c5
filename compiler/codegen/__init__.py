"""Kernel -> linear program: planning, lowering, fp16 and transcendental rules, packing,
vectorizing, linearizing."""
