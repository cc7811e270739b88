"""The machine the tests pretend to run on: what a test expects never depends on the host that runs it.

``MEMORY`` is the device memory every in-process test reads (``tests/conftest.py`` fixes
:func:`megatron_epp.config.memory_budget.read_memory` to it): a 64 GiB CPU host with 48 GiB available, neither
this machine's figures nor any developer's. The expectations computed from a memory reading
(``tests/data/config_before_one_declaration.json``'s default budgets) are computed from it."""

from __future__ import annotations

from megatron_epp.base.units import GIB
from megatron_epp.config.memory_budget import MemoryReading

MEMORY = MemoryReading("cpu", 64 * GIB, 48 * GIB)
