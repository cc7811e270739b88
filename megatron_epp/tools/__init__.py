"""Measurement tools outside the library's flow: the layer profiler and the launcher of training runs
whose plans the calibration and benchmark scripts rebuild. They launch training or time layers;
nothing in the library imports them (scripts and tests do)."""
