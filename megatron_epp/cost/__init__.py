"""The cost model the planner optimises and the simulator evaluates (numpy only, no torch).

:mod:`.shape`: model shapes and presets; :mod:`.profile`: a profile's measured or analytic coefficients and its
file; :mod:`.profile_lookup`: which profile ``--epp-profile`` names; :mod:`.analytic`: time from FLOPs;
:mod:`.activation_memory`: activation bytes counted per shape; :mod:`.features`: a chunk's feature vector with named
columns; :mod:`.model`: per-stage time and per-layer memory of chunks;
:mod:`.network`: stage-to-stage and collective transfer times.
"""
