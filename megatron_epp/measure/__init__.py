"""Measurement of the device for the cost model: the layer profile measured at start-up or by a script
(:mod:`.profiling`, :mod:`.layer_bench`) and the one resolution of the planner's cost profile per run (a preset, the
cache, or measured: :mod:`.profile_resolution`)."""
