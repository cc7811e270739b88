"""The cost model the planner optimises and the simulator evaluates (numpy only, no torch).

:mod:`.profiles`: model shapes and measured or analytic coefficients; :mod:`.features`: a chunk's
feature vector with named columns; :mod:`.model`: per-stage time and per-layer memory of chunks;
:mod:`.network`: stage-to-stage and collective transfer times.
"""
