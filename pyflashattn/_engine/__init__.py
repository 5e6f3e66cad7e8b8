"""The engine: one call path under every API facade (ARCHITECTURE.md).

problem (what to compute) -> operands (THE validator) -> routing (kernel, tile, CTAs per SM) ->
schedule (THE scheduler, with cost_model and geometry) -> plan (params, staging, masks, graph
capacity: batch.py / single.py) -> launch (run(), torch fast path, PDL). It imports the runtime,
never a facade.
"""
