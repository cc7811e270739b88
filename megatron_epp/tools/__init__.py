"""Measurement tools outside the library's flow: the layer profiler and the step calibration. They
launch training or time layers; nothing in the library imports them (scripts and tests do)."""
