"""The one IR: UOp, dtypes, the rewrite engine, symbolic simplification, the interpreter."""
