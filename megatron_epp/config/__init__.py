"""The run's configuration: each option one dataclass field (:mod:`.fields`), the command line generated from the
fields and validated into a frozen config (:mod:`.parser`), the Megatron-LM flags accepted or refused
(:mod:`.megatron_flags`), the default memory budget from the device's memory reading (:mod:`.memory_budget`), and the
one error type of bad input (:mod:`.errors`). Read by everything above it; reads no process group."""
