"""ParallelDims (megatron_epp.base.dims): the world-size check and the data-parallel size it infers."""

from __future__ import annotations

import pytest
import torch

from megatron_epp.base.dims import ParallelDims


@pytest.mark.parametrize("world, sizes, dp", [
    (1, {}, 1),
    (8, {}, 8),
    (8, {"tp": 2}, 4),
    (16, {"tp": 2, "cp": 2, "pp": 2}, 2),
    (24, {"tp": 2, "pp": 3}, 4),
    (8, {"tp": 2, "cp": 4}, 1),
])
def test_dp_is_inferred_from_the_world_size(world, sizes, dp):
    for given in (None, -1):
        dims = ParallelDims.for_world(world, dp=given, **sizes)
        assert dims.dp == dp and dims.world_size == world
        assert (dims.tp, dims.cp, dims.pp) == (sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("pp", 1))
    assert ParallelDims.for_world(world, dp=dp, **sizes) == ParallelDims.for_world(world, **sizes)


@pytest.mark.parametrize("world, sizes, message", [
    (2, {"cp": 2, "pp": 2}, "world size 2 is not divisible by tp 1 x cp 2 x pp 2"),
    (12, {"tp": 8}, "world size 12 is not divisible by tp 8 x cp 1 x pp 1"),
    (8, {"tp": 2, "dp": 2}, "tp 2 x cp 1 x pp 1 x dp 2 = 4 ranks, but the world size is 8"),
    (4, {"tp": 2, "cp": 2, "dp": 2}, "tp 2 x cp 2 x pp 1 x dp 2 = 8 ranks, but the world size is 4"),
    (4, {"tp": 0}, "parallel sizes must be >= 1"),
    (4, {"dp": 0}, "parallel sizes must be >= 1"),
    (0, {}, "world size 0 must be >= 1"),
])
def test_a_layout_that_does_not_fill_the_world_is_one_line(world, sizes, message):
    with pytest.raises(ValueError) as error:
        ParallelDims.for_world(world, **sizes)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_check_world_size_and_the_stage():
    dims = ParallelDims(tp=2, pp=4, dp=3, cp=2)
    dims.check_world_size(48)
    with pytest.raises(ValueError, match="= 48 ranks, but the world size is 32"):
        dims.check_world_size(32)
    assert dims.stage_size == 4
    with pytest.raises(ValueError, match=r"parallel sizes must be >= 1 \(tp 1, pp 0"):
        ParallelDims(pp=0)


def test_initialize_refuses_a_launch_of_another_world_size(monkeypatch):
    """A configuration made for 2 ranks (pp 2) started in a world of 4: one line before any group is built."""
    from megatron.core import parallel_state

    from megatron_epp.model import runtime as init_module
    from megatron_epp.config.parser import parse_config

    cfg = parse_config(["--mock-data", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
                        "--seq-length", "16", "--max-position-embeddings", "16", "--pipeline-model-parallel-size", "2"],
                       world_size=2)
    assert cfg.parallel.dims == ParallelDims(pp=2)
    monkeypatch.setattr(init_module, "select_device", lambda: (torch.device("cpu"), "gloo"))
    monkeypatch.setattr(init_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(init_module.dist, "get_world_size", lambda group=None: 4)

    def built(*args, **kwargs):
        raise AssertionError("megatron-core's groups were built")

    monkeypatch.setattr(parallel_state, "initialize_model_parallel", built)
    with pytest.raises(RuntimeError) as error:
        init_module.initialize(cfg)
    assert str(error.value) == ("the launch does not fit the configuration: tp 1 x cp 1 x pp 2 x dp 1 = 2 ranks, "
                                "but the world size is 4")
