"""Planner statistics: per-device and per-table tables (like TorchRec's), and a bar plot."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infer.errors import ConfigError
from infer.planner import constants as C
from infer.planner.memory_tiers import table_tier
from infer.planner.types import ShardingPlan, ShardingType
from infer.planner.utils import binary_unit, format_bytes

_BAR_WIDTH = 0.8
# the memory axis runs up to the devices' capacity while the most used device fills at least 1/4 of it
_CAPACITY_SHOWN = 4

_SHORT = {
    ShardingType.TABLE_WISE: "TW",
    ShardingType.ROW_WISE: "RW",
    ShardingType.COLUMN_WISE: "CW",
    ShardingType.TABLE_ROW_WISE: "TWRW",
    ShardingType.REPLICATED: "REP",
}


def _gb(value: float) -> str:
    return f"{value / C.GB:.2f}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def format_stats(plan: ShardingPlan) -> str:
    """The plan as text: one row per device, then one row per table, then the bound."""
    topo = plan.topology
    usable = plan.planner.get("usable_device_memory") or list(topo.device_memory)
    costs = plan.device_costs()
    storage = plan.device_storage()
    inputs = [0] * topo.world_size
    outputs = [0] * topo.world_size
    kinds: list[Counter[str]] = [Counter() for _ in range(topo.world_size)]
    for table in plan.tables:
        for shard in table.shards:
            inputs[shard.device] += shard.input_bytes
            outputs[shard.device] += shard.output_bytes
            kinds[shard.device][_SHORT[table.sharding_type]] += 1
    lines = [
        f"embserve plan: {len(plan.tables)} tables on {topo.world_size} {topo.compute_device.value} devices, "
        f"batch {plan.batch_size}, {'inference' if plan.is_inference else 'training'} estimates",
        *([f"topology: {plan.planner['topology_source']}"] if plan.planner.get("topology_source") else []),
        "",
        f"{'device':>6} {'memory GiB (used/usable/cap)':>28} {'use%':>6} {'host GiB':>8} {'cost us':>9} "
        f"{'in MiB':>8} {'out MiB':>8}  shards",
    ]
    for d in range(topo.world_size):
        used = storage[d].device
        memory = f"{_gb(used)}/{_gb(usable[d])}/{_gb(topo.device_memory[d])}"
        share = 100.0 * used / usable[d] if usable[d] else 0.0
        shards = " ".join(f"{k}:{n}" for k, n in sorted(kinds[d].items()))
        lines.append(
            f"{topo.device_name(d):>6} {memory:>28} {share:>5.1f}% {_gb(storage[d].host):>8} {_us(costs[d]):>9} "
            f"{inputs[d] / C.MB:>8.2f} {outputs[d] / C.MB:>8.2f}  {shards}"
        )
    tiers = plan.planner.get("memory_tiers")
    tier_head = f" {'tier':<8}" if tiers else ""
    lines += ["", f"{'table':<24} {'type':<15} {'placement':<12} {'dtype':<6}{tier_head} {'cost us':>9}  devices"]
    for table in plan.tables:
        devices = ",".join(str(d) for d in sorted({s.device for s in table.shards}))
        cost = sum(s.cost for s in table.shards)
        tier = f" {table_tier(table):<8}" if tiers else ""
        lines.append(
            f"{table.table:<24} {table.sharding_type.value:<15} {table.placement.value:<12} "
            f"{table.data_type.value:<6}{tier} {_us(cost):>9}  {devices}"
        )
    if tiers:
        lines += ["", format_tiers(tiers)]
    if plan.planner.get("precision"):
        lines += ["", format_precision(plan.planner["precision"])]
    ratio = plan.bottleneck_cost / plan.lower_bound if plan.lower_bound else float("nan")
    lines += [
        "",
        f"bottleneck {_us(plan.bottleneck_cost)} us, lower bound {_us(plan.lower_bound)} us "
        f"(ratio {ratio:.3f}); chosen by {plan.planner.get('proposer', '?')} after "
        f"{plan.planner.get('proposals_evaluated', '?')} proposals in {plan.planner.get('seconds', 0):.2f} s",
    ]
    return "\n".join(lines)


def format_plan_choices(plan: ShardingPlan) -> str:
    """What the planner chose beyond placement, for ``embserve inspect``: each table's memory tier (CPU plans),
    and each table's data type with its reason when the precision planner chose them. Empty when neither."""
    tiers = plan.planner.get("memory_tiers")
    lines = []
    if tiers:
        lines.append(format_tiers(tiers))
        for table in plan.tables:
            resident = sum(s.weight_bytes for s in table.shards if s.tier.value == "resident")
            paged = sum(s.weight_bytes for s in table.shards if s.tier.value == "paged")
            lines.append(
                f"  {table.table:<24} {table_tier(table):<8} {format_bytes(resident):>10} resident, "
                f"{format_bytes(paged):>10} paged"
            )
    if plan.planner.get("precision"):
        lines.append(format_precision(plan.planner["precision"]))
    return "\n".join(lines)


def format_precision(precision: Mapping[str, Any], frontier: bool = False) -> str:
    """The precision planner's record: the chosen total beside greedy and uniform, then each table's type and
    reason (bytes saved and weighted error added against the spec's type); ``frontier``: its points too."""
    chosen = precision["chosen"]
    budget = precision.get("memory_budget")
    error_budget = precision.get("error_budget")
    limits = ", ".join(
        ([f"memory budget {format_bytes(budget)}"] if budget is not None else [])
        + ([f"error budget {100 * error_budget:.3f}%"] if error_budget is not None else [])
    )
    gap = chosen.get("gap")
    lines = [
        f"precision ({limits}; access {precision.get('access', '?')}): weighted error of pooled outputs, bytes",
        f"  {'chosen (exact MILP)':<22} {100 * chosen['error']:>8.3f}% {format_bytes(chosen['total_bytes']):>10}"
        f"  gap {gap if gap is not None else '?'}, {chosen['seconds']:.3f} s",
    ]
    if chosen.get("device_bytes") is not None:
        per_device = ", ".join(f"{d}: {format_bytes(b)}" for d, b in enumerate(chosen["device_bytes"]))
        lines.append(f"  devices chosen with the types (weights + batch buffers): {per_device}")
    for other in [precision["greedy"], *precision.get("uniform", [])]:
        lines.append(f"  {other['method']:<22} {100 * other['error']:>8.3f}% {format_bytes(other['total_bytes']):>10}")
    lines.append(
        f"  {'table':<24} {'dtype':<6} {'spec':<6} {'bytes':>10} {'saved':>10} {'error %':>8} {'added %':>8} "
        f"{'reads':>6}"
    )
    for row in precision["tables"]:
        lines.append(
            f"  {row['table']:<24} {row['data_type']:<6} {row['declared']:<6} {format_bytes(row['bytes']):>10} "
            f"{format_bytes(row['bytes_saved']):>10} {100 * row['error']:>8.3f} {100 * row['error_added']:>+8.3f} "
            f"{100 * row['weight']:>5.1f}%"
        )
        if row.get("blocks"):
            held = ", ".join(f"{b['rows']:,} rows {b['data_type']}" for b in row["blocks"])
            lines.append(f"  {'':<24} blocks, {_block_order(row)}: {held}")
    if frontier:
        lines.append(f"  frontier: {'bytes':>10} {'error %':>8}")
        for total, error in precision.get("frontier", []):
            lines.append(f"  {'':<10}{format_bytes(total):>10} {100 * error:>8.3f}")
    return "\n".join(lines)


def _block_order(row: Mapping[str, Any]) -> str:
    """How a block table's rows were ranked, as the stats say it: by sampled reads (hottest first) or, with no
    sample of the table, by the rows' ranges (``infer.planner.row_ranges``)."""
    from infer.planner.blocks import RANKED_BY_RANGES
    from infer.planner.row_ranges import ranking_of

    if ranking_of(row) == RANKED_BY_RANGES:
        return "largest rows first (ranked by row ranges: no sampled ids, reads uniform over rows)"
    return "hottest first"


def plot_frontier(precision: Mapping[str, Any], path: str | Path) -> Path:
    """The error-vs-bytes frontier as a PNG (matplotlib, Agg), with the chosen point, greedy and the uniform
    INT8/INT4 points marked."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("drawing the frontier needs matplotlib: pip install 'embserve[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = precision.get("frontier", [])
    if points:
        ax.step([p[0] / C.GB for p in points], [100 * p[1] for p in points], where="post", color="#4c72b0",
                marker=".", label="frontier (exact)")  # fmt: skip
    marks = [(precision["chosen"], "chosen", "#c44e52", "*"), (precision["greedy"], "greedy", "#dd8452", "o")]
    marks += [(u, u["method"], "#55a868", "s") for u in precision.get("uniform", [])]
    for choice, label, color, marker in marks:
        ax.scatter([choice["total_bytes"] / C.GB], [100 * choice["error"]], color=color, marker=marker, s=80,
                   zorder=3, label=label)  # fmt: skip
    if precision.get("memory_budget") is not None:
        ax.axvline(precision["memory_budget"] / C.GB, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("table bytes (GiB)")
    ax.set_ylabel("weighted relative error of pooled outputs (%)")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_tiers(tiers: Mapping[str, Any]) -> str:
    """One line: resident bytes of the resident budget, paged bytes of the mapped capacity, access source."""
    mapped = tiers.get("mapped_capacity")
    capacity = "unbounded" if mapped is None else f"{_gb(mapped)} GiB"
    return (
        f"memory tiers: resident {_gb(tiers['resident_bytes'])} of {_gb(tiers['resident_budget'])} GiB (RAM for "
        f"weights), paged {_gb(tiers['paged_bytes'])} GiB (mapped capacity {capacity}); hottest bytes first, "
        f"access {tiers['access']}"
    )


def plot_plan(plan: ShardingPlan, path: str | Path) -> Path:
    """Bars per device: memory used against the cap, and estimated cost against the lower bound; saved as PNG."""
    import matplotlib.pyplot as plt

    fig = plan_figure(plan)
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plan_figure(plan: ShardingPlan) -> Any:
    """The figure ``plot_plan`` saves (a matplotlib ``Figure``, Agg backend): one bar per device, each device a
    labelled tick (``cuda:0``, ``cpu:1``) and the x axis spanning the devices, so one device is not drawn on a
    fractional axis."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("drawing a plan needs matplotlib: pip install 'embserve[plot]' (or drop --plot)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topo = plan.topology
    devices = list(range(topo.world_size))
    storage = plan.device_storage()
    costs = plan.device_costs()
    fig, (memory_ax, cost_ax) = plt.subplots(2, 1, figsize=(max(6.0, 0.35 * topo.world_size + 3), 6), sharex=True)
    used = [storage[d].device for d in devices]
    capacity = [topo.device_memory[d] for d in devices]
    # the axis spans what is used: a small model's bars would be a hair at the foot of an 80 GiB capacity bar
    top = max(max(used), 1)
    limit = max(capacity) if max(capacity) <= _CAPACITY_SHOWN * top else 1.25 * top
    unit, scale = binary_unit(limit)
    off_scale = "" if limit >= max(capacity) else f", {format_bytes(max(capacity))}: above the axis"
    memory_ax.bar(devices, [c / scale for c in capacity], _BAR_WIDTH, color="#dddddd", label=f"capacity{off_scale}")
    memory_ax.bar(devices, [u / scale for u in used], _BAR_WIDTH, color="#4c72b0", label="planned")
    memory_ax.set_ylim(0, limit / scale)
    memory_ax.set_ylabel(f"device memory ({unit})")
    memory_ax.legend(loc="upper right", fontsize=8)
    cost_ax.bar(devices, [c * 1e6 for c in costs], _BAR_WIDTH, color="#dd8452", label="estimated cost")
    cost_ax.axhline(plan.lower_bound * 1e6, color="black", linestyle="--", linewidth=1, label="lower bound")
    cost_ax.set_ylabel("cost per batch (us)")
    cost_ax.set_xlabel("device")
    cost_ax.legend(loc="upper right", fontsize=8)
    # integer device ticks with their names; half a device of room either side of the outer bars
    cost_ax.set_xticks(devices, [topo.device_name(d) for d in devices])
    cost_ax.set_xlim(-0.5 - _BAR_WIDTH / 2, topo.world_size - 0.5 + _BAR_WIDTH / 2)
    fig.suptitle(f"{len(plan.tables)} tables on {topo.world_size} {topo.compute_device.value} devices")
    fig.tight_layout()
    return fig
