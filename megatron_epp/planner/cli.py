"""``epp-plan`` / ``python -m megatron_epp.planner``: plan one global batch and compare baselines."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator, NoReturn, Sequence

import numpy as np

from megatron_epp.cost.model import CostModel
from megatron_epp.cost.network import NETWORKS, get_network
from megatron_epp.base.dims import ParallelDims
from megatron_epp.base.units import GIB
from megatron_epp.cost.profile import Profile
from megatron_epp.cost.placement import place_profile, placement_note
from megatron_epp.cost.profile_lookup import load_profile
from megatron_epp.cost.shape import MODEL_PRESETS
from megatron_epp.plan import PlannedStep, PlanInfeasible
from megatron_epp.plan.order import format_stage_ops
from megatron_epp.cost.clusters import get_cluster
from megatron_epp.planner.builders import ELASTIC, offload_choice, plan_batch
from megatron_epp.planner.compare import BASELINES, FLEXSP, run_baselines
from megatron_epp.base.options import add_fields_to_parser, read_fields
from megatron_epp.planner.config import DEFAULT_CLUSTER, PlannerConfig, PlannerOptions, ShapeOptions
from megatron_epp.planner.layout import describe_choice, longest_documents, search_for_world
from megatron_epp.data.lengths import read_lengths, select_batch
from megatron_epp.planner.data_parallel import dp_split
from megatron_epp.simulator.flexsp import check_flexsp_profile
from megatron_epp.simulator.step import simulate
from megatron_epp.simulator.timeline import draw_timeline

PRESET_TP = 8  # the presets' tensor-parallel size unless --tp says otherwise
DEFAULTS = {  # epp-plan's defaults of the planner options (pretrain_gpt.py has its own)
    "epp_plan": PlannerConfig.builder.flag, "epp_memory_budget": 80.0, "epp_profile": "llama-13b", "epp_recompute": PlannerConfig.recompute,
    "epp_max_slices": None, "epp_time_limit": PlannerConfig.time_limit, "epp_offload": PlannerConfig.offload,
}


@contextmanager
def solver_output_to_stderr() -> Iterator[None]:
    """Send what native code (HiGHS) prints to stdout to stderr, so the JSON line stays last."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="epp-plan", description=__doc__)
    ap.add_argument("lengths", help="lengths file: one token count per line (.gz allowed)")
    ap.add_argument("--gbs", type=int, help="sample this many sequences from the file (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seq-len", type=int, default=131072)
    ap.add_argument("--truncate", action="store_true", help="cut documents longer than --max-seq-len")
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages P")
    ap.add_argument("--tp", type=int, default=None,
                    help="tensor-parallel size per stage (default: 8 for the presets, a profile JSON's own)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    ap.add_argument("--network", default="fat-tree", choices=sorted(NETWORKS))
    add_fields_to_parser(ap, PlannerOptions, defaults_shown={**DEFAULTS, "epp_max_slices": "the elastic planner's 1,2,3,4,6,...,32; seq1f1b 4"})
    add_fields_to_parser(ap, ShapeOptions)
    ap.set_defaults(**DEFAULTS)
    ap.add_argument("--baselines", default=",".join(BASELINES), help="comma-separated; empty for none")
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--plan-out", help="write the Plan JSON (replica 0) here")
    ap.add_argument("--timeline", help="draw replica 0's per-stage Gantt chart to this PNG")
    ap.add_argument("--print-schedule", action="store_true",
                    help="print replica 0's op lists: one column per stage, F/B + chunk id + s (split) or h (hybrid), "
                         "its sends and receives SEND_F/RECV_F/SEND_B/RECV_B + chunk (+RECV: batched with the send before)")
    return ap.parse_args(argv)


def check_layout(profile: Profile, stages: int) -> None:
    """The layout's rules, each a one-line ``ValueError``: the layers divide into the
    stages, the attention heads into the tensor-parallel ranks (Megatron's rules)."""
    shape = profile.model
    if shape.num_layers % stages:
        raise ValueError(f"--stages {stages}: the {shape.num_layers} layers of {shape.name} do not divide into {stages} pipeline stages")
    if shape.num_heads % profile.tp:
        raise ValueError(f"--tp {profile.tp}: the {shape.num_heads} attention heads of {shape.name} do not divide into {profile.tp} tensor-parallel ranks")


def _worst(results: list[dict]) -> dict:
    """Across data-parallel replicas: the slowest step and the highest memory per stage."""
    if not all(r.get("fits") for r in results):
        return next(r for r in results if not r.get("fits"))
    out = dict(max(results, key=lambda r: r["predicted_step_ms"]))
    out["peak_memory_bytes"] = np.max([r["peak_memory_bytes"] for r in results], axis=0).tolist()
    return out


def _gb(peaks: Sequence[float] | np.ndarray) -> list[float]:
    """Peak memory per stage in GB, as the JSON and the table give it (bytes inside)."""
    return (np.asarray(peaks) / GIB).tolist()


def _in_gb(entry: dict) -> dict:
    """A baseline's summary as the JSON gives it: its ``peak_memory_bytes`` as ``peak_memory_gb``, in the same place."""
    out = {}
    for key, value in entry.items():
        if key == "peak_memory_bytes":
            key, value = "peak_memory_gb", _gb(value)
        out[key] = value
    return out


def fail(message: object, status: int = 2) -> NoReturn:
    """One line on stderr, as argparse's errors; exit 2 (bad input) or 1 (a batch no plan fits)."""
    print(f"epp-plan: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def shape_options(args: argparse.Namespace) -> ShapeOptions:
    """``--epp-loss-chunk-tokens`` and ``--epp-mlp-chunk-tokens`` as given (a one-line ``ValueError`` below 0)."""
    for flag in ("epp_loss_chunk_tokens", "epp_mlp_chunk_tokens"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 0")
    return read_fields(ShapeOptions, dict(vars(args)))


def check_input(args: argparse.Namespace) -> tuple[PlannerConfig, Profile, np.ndarray]:
    """Every option and the lengths file, before any planning: the planner's settings, the profile and
    the batch; a one-line ``ValueError`` naming the flag or the file otherwise."""
    for flag in ("stages", "tp", "dp", "gbs", "max_seq_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: must be >= 1")
    if args.seed < 0:
        raise ValueError(f"--seed {args.seed}: must be >= 0")
    unknown = [n for n in args.baselines.split(",") if n and n not in BASELINES]
    if unknown:
        raise ValueError(f"--baselines {unknown[0]!r}: one of {', '.join(BASELINES)} (comma-separated; empty for none)")
    for flag in ("plan_out", "timeline"):
        folder = Path(getattr(args, flag) or ".").resolve().parent
        if not folder.is_dir():
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: no such directory {folder}")
    if args.epp_cluster and not args.epp_search_layout and args.epp_offload == "none":
        raise ValueError("--epp-cluster applies only with --epp-search-layout or --epp-offload")
    config = PlannerConfig.from_options(read_fields(PlannerOptions, dict(vars(args))), args.max_seq_len)
    if config.offload != "none":  # the host budget against the preset node's host memory, before any planning
        host = get_cluster(args.epp_cluster or DEFAULT_CLUSTER).host
        if config.host_memory_budget_bytes is not None:
            host.check_budget(config.host_memory_budget_bytes)
    if args.epp_longest_document and not args.epp_search_layout:
        raise ValueError("--epp-longest-document applies only with --epp-search-layout")
    if args.epp_search_layout and config.profile not in MODEL_PRESETS:
        raise ValueError(f"--epp-search-layout needs a model preset --epp-profile ({', '.join(MODEL_PRESETS)})")
    if args.epp_search_layout and config.builder != ELASTIC:
        raise ValueError(f"--epp-plan {config.builder.flag}: --epp-search-layout searches EPP's (elastic) layout")
    profile = load_profile(config.profile, PRESET_TP if args.tp is None else args.tp)
    profile = replace(profile, model=shape_options(args).apply(profile.model))  # the chunked head, the tiled MLP
    dims = ParallelDims(tp=profile.tp if args.tp is None else args.tp, pp=args.stages, dp=args.dp)
    try:
        profile, note = place_profile(profile, dims), placement_note(profile, dims)
    except ValueError as e:
        raise ValueError(f"--tp {args.tp}: {e}") from None
    check_layout(profile, args.stages)
    if FLEXSP in args.baselines.split(","):
        try:
            check_flexsp_profile(profile)
        except ValueError as e:
            raise ValueError(f"--baselines flexsp: {e} (leave flexsp out of --baselines, or pass a model preset --epp-profile)") from None
    pool = read_lengths(args.lengths)
    try:
        lengths = select_batch(pool, args.gbs, args.seed, args.max_seq_len, args.truncate)
    except ValueError as e:
        raise ValueError(f"--max-seq-len {args.max_seq_len}: {e}; pass --truncate to cut them") from None
    if note:
        print(f"epp-plan: note: --tp {args.tp}: {note}", file=sys.stderr)
    return config, profile, lengths


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        config, profile, lengths = check_input(args)
    except ValueError as e:
        fail(e)
    if args.epp_search_layout:
        return print_layout_search(args, config, profile.tp, lengths)
    host = get_cluster(args.epp_cluster or DEFAULT_CLUSTER).host if config.offload != "none" else None
    cost_model = CostModel(profile, args.stages, dp=args.dp, network=get_network(args.network), host=host)
    parts = dp_split(lengths, args.dp, cost_model.work_vector())
    names = [n for n in args.baselines.split(",") if n]
    with solver_output_to_stderr():
        try:
            plans: list[PlannedStep] = [plan_batch(lengths[p], cost_model, config) for p in parts]
        except PlanInfeasible as e:
            fail(e, 1)
        per_replica = [run_baselines(lengths[p], cost_model, config, names) for p in parts]
    baselines = {n: _in_gb(_worst([r[n] for r in per_replica])) for n in names}
    info = [p.report for p in plans]
    peak = np.max([i.peak_memory_bytes for i in info], axis=0)
    summary = {
        "model": profile.model.name,
        "profile_source": profile.source,
        "device": profile.device,
        "network": args.network,
        "stages": args.stages,
        "tp": profile.tp,
        "dp": args.dp,
        "num_sequences": int(len(lengths)),
        "num_tokens": int(lengths.sum()),
        "solve_ms": max(i.solve_ms for i in info),
        "chosen": sorted({i.chosen or plans[0].plan.builder for i in info}),  # whose plan won (elastic: EPP's own or a baseline's)
        "num_chunks": {k: sum(i.num_chunks[k] for i in info) for k in info[0].num_chunks},
        "num_pipelines": sum(i.num_pipelines for i in info),
        "recomputed_layers": sum(i.recomputed_layers for i in info),
        "mip_gap": max(i.mip_gap or 0.0 for i in info),  # megatron/seq1f1b solve no program
        "predicted_step_ms": max(i.predicted_step_ms for i in info),
        "bound_step_ms": max(i.bound_step_ms for i in info),
        "bubble_ratio": max(i.bubble_ratio for i in info),
        "recompute_ms": max(i.recompute_ms for i in info),
        "peak_memory_gb": _gb(peak),
        "memory_budget_gb": config.memory_budget_bytes / GIB,
        "baselines": baselines,
    }
    if config.offload != "none":  # the host memory a GPU needs (per stage, the worst replica) and its budget
        hosts = [i.host_memory_bytes or [0.0] * args.stages for i in info]
        summary["offload"] = config.offload
        summary["host_memory_gb"] = _gb(np.max(hosts, axis=0))
        summary["host_memory_budget_gb"] = offload_choice(config, cost_model).host_budget / GIB
        summary["copy_ms"] = max(i.copy_ms or 0.0 for i in info)
    print_table(summary)
    if args.print_schedule:
        print(format_stage_ops(plans[0].plan))
    if args.plan_out:
        Path(args.plan_out).write_text(plans[0].plan.to_json())
    if args.timeline:
        draw_timeline(simulate(plans[0].plan, cost_model), args.stages, args.timeline)
    if args.json:
        print(json.dumps(summary, separators=(",", ":")))


def print_layout_search(args: argparse.Namespace, config: PlannerConfig, tp: int, lengths: np.ndarray) -> None:
    """``--epp-search-layout``: EPP's best layout (TP x CP x PP x DP) for the world size
    ``tp x --stages x --dp`` (``tp``: ``--tp``, else the preset's) on the ``--epp-cluster`` preset; the last line is its flags."""
    world = tp * args.stages * args.dp
    shape = shape_options(args).apply(MODEL_PRESETS[config.profile])
    with solver_output_to_stderr():
        try:
            choice, cluster = search_for_world(lengths, shape, args.epp_cluster or DEFAULT_CLUSTER, world, config)
        except PlanInfeasible as e:
            fail(e, 1)
        except ValueError as e:  # a world size that is no whole number of the cluster's nodes
            fail(e)
        longest = longest_documents(choice, shape, cluster, config) if args.epp_longest_document else None
    print("\n".join(describe_choice(choice, cluster, longest)))


def print_table(s: dict) -> None:
    out = sys.stdout.write
    out(f"EPP plan: {s['num_sequences']} sequences, {s['num_tokens']} tokens, model {s['model']} ({s['profile_source']} profile, {s['device']}), "
        f"P={s['stages']} TP={s['tp']} DP={s['dp']}, network {s['network']}\n")
    c = s["num_chunks"]
    out(f"  solve {s['solve_ms']:.1f} ms; plan of {'+'.join(s['chosen'])}; chunks batched={c['batched']} split={c['split']} hybrid={c['hybrid']}; pipelines {s['num_pipelines']}; "
        f"recomputed layers {s['recomputed_layers']} (MIP gap {s['mip_gap']:.2%})\n")
    out(f"  predicted step {s['predicted_step_ms']:.1f} ms, bound {s['bound_step_ms']:.1f} ms, bubble {s['bubble_ratio']:.1%}, recompute {s['recompute_ms']:.1f} ms\n")
    out("  peak memory GB per stage: " + " ".join(f"{g:.1f}" for g in s["peak_memory_gb"]) + f" (budget {s['memory_budget_gb']:.0f})\n")
    if "offload" in s:
        out(f"  offload {s['offload']}: host memory GB per GPU per stage: " + " ".join(f"{g:.1f}" for g in s["host_memory_gb"])
            + f" (budget {s['host_memory_budget_gb']:.0f}); exposed copy {s['copy_ms']:.1f} ms over the stages, in the "
            f"predicted step {s['predicted_step_ms']:.1f} ms\n")
    if s["baselines"]:
        out(f"  {'system':16s} {'step ms':>10s} {'vs EPP':>8s} {'vs bound':>9s}  peak GB\n")
        out(f"  {'epp':16s} {s['predicted_step_ms']:10.1f} {1:8.2f} {s['predicted_step_ms'] / s['bound_step_ms']:9.2f}  {max(s['peak_memory_gb']):.1f}\n")
        for name, b in s["baselines"].items():
            if b["fits"]:
                t = b["predicted_step_ms"]
                out(f"  {name:16s} {t:10.1f} {t / s['predicted_step_ms']:8.2f} {t / s['bound_step_ms']:9.2f}  {max(b['peak_memory_gb']):.1f}\n")
            else:
                out(f"  {name:16s} {'does not fit':>10s}: {b['reason']}\n")
