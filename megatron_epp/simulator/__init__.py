"""What a Plan costs without running it (numpy only, no torch): the exact memory walk of the elastic
1F1B order (:mod:`.memory`), the event-driven step simulation (:mod:`.step`), the timeline picture
(:mod:`.timeline`), and FlexSP's adaptive sequence parallelism simulated on the same cost model
(:mod:`.flexsp`)."""

from megatron_epp.simulator.step import SimResult, simulate

__all__ = ["SimResult", "simulate"]
