"""Plain units: ``GIB``, bytes in a GiB (the "GB" of every memory flag, budget and report of the library)."""

GIB = float(2**30)
