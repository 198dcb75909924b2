"""The precision planner: each table's data type, chosen from measured error under a memory budget.

Every table may take any data type the TBE serves, no less precise than its floor
(``ParameterConstraints.min_data_type``; ``data_type`` fixes it). A choice costs the table's bytes as the
kernel lays them out (``rowwise.table_bytes``) and adds the table's measured error (``quant.measured_error``)
weighted by the table's share of reads (a sample of request ids, else its ids per example). The exact choice
minimises the total weighted error subject to the budget: under a memory budget alone by bounded dynamic
programming (``infer.planner.mckp``: exact, gap 0), otherwise as a mixed-integer program (``scipy.optimize.milp``,
HiGHS, as the partitioner), with the optimality gap reported; with an error budget it finds the fewest bytes
within it instead. Greedy (largest error reduction per byte) and uniform choices are computed beside it.

With ``DeviceBudgets`` (a topology's devices and what each may hold) the same MILP chooses each table's device
too, table-wise: a variable per (table, type, device), each device's bytes (weights plus the table's batch
buffers there) within its budget and the weights' total within the memory budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from infer.config import DataType, ModelSpec, RowBlock, TableConfig
from infer.errors import ConfigError, PlanError, PlanErrorKind
from infer.planner import mckp
from infer.planner.access import AccessSample
from infer.planner.memory_tiers import UNIFORM_ACCESS, block_reads
from infer.planner.types import ParameterConstraints
from infer.planner.utils import format_gb
from infer.quant.measured_error import TableError
from infer.quant.rowwise import CPU_ROW_ALIGNMENT, table_bytes

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 10.0
FRONTIER_POINTS = 32
# HiGHS stops at this relative gap: the choice is optimal to rounding
MIP_REL_GAP = 1e-9
# with devices chosen too, HiGHS stops within 0.1 % of optimal (the gap is reported; identical devices make
# proving the last fraction expensive)
PLACED_MIP_REL_GAP = 1e-3
# the joint MILP (a binary per table x type x device) is solved whole up to this many binaries
JOINT_MAX_VARIABLES = 5000


@dataclass(frozen=True)
class DtypeOption:
    data_type: DataType
    bytes: int  # the table at this type, as the TBE allocates it
    error: float  # the table's measured relative error of pooled outputs at this type
    # the table in precision blocks (``infer.planner.blocks``; ``data_type`` is then the coldest block's), else ()
    blocks: tuple[RowBlock, ...] = ()


@dataclass(frozen=True)
class TableChoices:
    """What one table may become: its allowed options (fewest bytes first) and its share of reads."""

    table: str
    weight: float  # share of all reads; the weights of a model sum to 1
    declared: DtypeOption  # the spec's data type: the baseline a choice's reason is told against
    options: tuple[DtypeOption, ...]
    # what ranks the rows of its block options (``infer.planner.row_ranges``: sample ids or row ranges); "" if none
    ranking: str = ""


@dataclass(frozen=True)
class DeviceBudgets:
    """Per-device limits for choosing types and devices jointly: each device's bytes, and per table the bytes it
    takes on its device besides its weights (a batch's ids and outputs, which do not depend on the type)."""

    budgets: tuple[int, ...]
    overheads: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.budgets or any(b < 0 for b in self.budgets):
            raise PlanError(
                f"device budgets must be one non-negative size per device, got {list(self.budgets)}",
                PlanErrorKind.INVALID_TOPOLOGY,
            )

    def overhead(self, table: str) -> int:
        return dict(self.overheads).get(table, 0)


@dataclass(frozen=True)
class PrecisionChoice:
    """One data type per table (in the spec's order) with its total bytes and weighted error."""

    method: str  # "exact", "greedy", "uniform int8", ...
    data_types: tuple[DataType, ...]
    total_bytes: int
    error: float  # sum over tables of weight x measured error
    seconds: float = 0.0
    gap: float | None = None  # the solver's relative optimality gap (exact only)
    devices: tuple[int, ...] | None = None  # each table's device, when chosen jointly with device budgets
    device_bytes: tuple[int, ...] | None = None  # then each device's bytes: weights plus the tables' overheads
    blocks: tuple[tuple[RowBlock, ...], ...] = ()  # per table its precision blocks, () when whole (or none chosen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "total_bytes": self.total_bytes,
            "error": self.error,
            "seconds": round(self.seconds, 4),
            **({"gap": self.gap} if self.gap is not None else {}),
            **({"devices": list(self.devices)} if self.devices is not None else {}),
            **({"device_bytes": list(self.device_bytes)} if self.device_bytes is not None else {}),
        }


def precision_problem(
    spec: ModelSpec,
    measured: Sequence[TableError],
    constraints: Mapping[str, ParameterConstraints] | None = None,
    sample: AccessSample | None = None,
    row_alignment: int = CPU_ROW_ALIGNMENT,
    model_level: bool = False,
) -> tuple[TableChoices, ...]:
    """Every table's allowed options, priced in bytes and weighted error, in the spec's order. ``model_level``:
    the errors are already the model's (``quant.eval_error``: output, log loss, AUC), so every weight is 1."""
    constraints = constraints or {}
    by_name = {m.table: m for m in measured}
    missing = [t.name for t in spec.tables if t.name not in by_name]
    if missing:
        raise PlanError(f"no measured error for table(s) {missing}; measure every table", PlanErrorKind.INVALID_PLAN)
    reads = []
    for table in spec.tables:
        reads.append(block_reads(table, 0, table.num_embeddings, constraints.get(table.name, ParameterConstraints()),
                                 sample))  # fmt: skip
    total_reads = sum(reads)
    problem = []
    for table, table_reads in zip(spec.tables, reads):
        table_constraints = constraints.get(table.name, ParameterConstraints())
        measured_error = by_name[table.name]

        floor = table_constraints.min_data_type
        if table_constraints.data_type is not None:
            # the spec refuses a type its dim cannot take, naming the table and the fixes
            table.with_data_type(table_constraints.data_type)
            allowed = [table_constraints.data_type]
        else:
            # the types measured for it: every type its dim can be stored in, less any the target device refuses
            allowed = [d for d, _ in measured_error.errors if floor is None or d.bits >= floor.bits]
        priced = (_option(table, d, measured_error, row_alignment) for d in allowed)
        options = tuple(sorted(priced, key=lambda o: (o.bytes, o.error)))
        weight = table_reads / total_reads if total_reads > 0 else 1.0 / len(spec.tables)
        if model_level:
            weight = 1.0
        measured_types = [d for d, _ in measured_error.errors]
        if table.data_type not in measured_types:
            raise ConfigError(
                f"table {table.name!r} is {table.data_type.value} in the spec, a type not measured for it (the target "
                + "device's kernel refuses it, as printed above); set its data_type to one of "
                + f"{[d.value for d in measured_types]}"
            )
        declared = _option(table, table.data_type, measured_error, row_alignment)
        problem.append(TableChoices(table.name, weight, declared, options))
    return tuple(problem)


def _option(table: TableConfig, data_type: DataType, measured: TableError, row_alignment: int) -> DtypeOption:
    size = table_bytes(table.num_embeddings, table.embedding_dim, data_type, row_alignment)
    return DtypeOption(data_type, size, measured.error(data_type))


# ---------------------------------------------------------------------------- choices
def _choice(method: str, problem: Sequence[TableChoices], picks: Sequence[int], seconds: float = 0.0,
            gap: float | None = None, devices: Sequence[int] | None = None,
            device_budgets: DeviceBudgets | None = None) -> PrecisionChoice:  # fmt: skip
    options = [t.options[i] for t, i in zip(problem, picks)]
    device_bytes = None
    if devices is not None and device_budgets is not None:
        used = [0] * len(device_budgets.budgets)
        for table, option, device in zip(problem, options, devices):
            used[device] += option.bytes + device_budgets.overhead(table.table)
        device_bytes = tuple(used)
    return PrecisionChoice(
        method,
        tuple(o.data_type for o in options),
        sum(o.bytes for o in options),
        sum(t.weight * o.error for t, o in zip(problem, options)),
        seconds,
        gap,
        None if devices is None else tuple(devices),
        device_bytes,
        tuple(o.blocks for o in options) if any(o.blocks for o in options) else (),
    )


def smallest_bytes(problem: Sequence[TableChoices]) -> int:
    return sum(t.options[0].bytes for t in problem)


def choose_uniform(problem: Sequence[TableChoices], data_type: DataType) -> PrecisionChoice:
    """Every table at ``data_type``, or its nearest allowed type (a floor above it, or a fixed type)."""
    picks = []
    for table in problem:
        whole = [i for i, o in enumerate(table.options) if not o.blocks]
        exact = [i for i in whole if table.options[i].data_type == data_type]
        if exact:
            picks.append(exact[0])
        else:
            picks.append(min(whole, key=lambda i: abs(table.options[i].data_type.bits - data_type.bits)))
    return _choice(f"uniform {data_type.value}", problem, picks)


def choose_greedy(
    problem: Sequence[TableChoices], memory_budget: int | None, error_budget: float | None = None
) -> PrecisionChoice:
    """Start from every table's fewest bytes; take the upgrade with the largest error reduction per byte that
    fits, until none fits (or the error is within ``error_budget``)."""
    started = time.monotonic()
    _check_feasible(problem, memory_budget)
    # every option at once (numpy), the same choice as scanning table by table, option by option: the first
    # largest ratio wins
    sizes = [len(t.options) for t in problem]
    owner = np.repeat(np.arange(len(problem)), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    option_bytes = np.array([o.bytes for t in problem for o in t.options], dtype=np.int64)
    option_errors = np.array([o.error for t in problem for o in t.options], dtype=np.float64)
    weights = np.array([t.weight for t in problem], dtype=np.float64)[owner]
    current = starts.copy()
    used = smallest_bytes(problem)
    error = sum(t.weight * t.options[0].error for t in problem)
    while error_budget is None or error > error_budget:
        held = current[owner]
        extra = option_bytes - option_bytes[held]
        gain = weights * (option_errors[held] - option_errors)
        allowed = (extra > 0) & (gain > 0)
        if memory_budget is not None:
            allowed &= used + extra <= memory_budget
        if not allowed.any():
            break
        ratio = np.where(allowed, gain / np.where(extra > 0, extra, 1), -np.inf)
        best = int(np.argmax(ratio))
        used += int(extra[best])
        error -= float(gain[best])
        current[owner[best]] = best
    picks = [int(c - s) for c, s in zip(current, starts)]
    return _choice("greedy", problem, picks, time.monotonic() - started)


def choose_exact(
    problem: Sequence[TableChoices],
    memory_budget: int | None,
    error_budget: float | None = None,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    device_budgets: DeviceBudgets | None = None,
) -> PrecisionChoice:
    """The optimal choice (one byte budget: ``mckp``'s dynamic programming; otherwise a MILP): least weighted
    error within ``memory_budget`` bytes, or, with ``error_budget``, fewest bytes with weighted error within it
    (and within ``memory_budget`` when given).
    With ``device_budgets`` each table's device is chosen too, every device within its budget.

    The budgets hold exactly: the solution is checked in integer bytes, and re-solved with a budget
    tightened by any tolerance-sized excess.
    """
    started = time.monotonic()
    _check_feasible(problem, memory_budget)
    if memory_budget is None and error_budget is None and device_budgets is None:
        raise PlanError("give a memory budget or an error budget", PlanErrorKind.INVALID_CONSTRAINT)
    if device_budgets is not None:
        return _choose_placed(problem, memory_budget, error_budget, time_limit_s, device_budgets, started)
    if error_budget is None and memory_budget is not None:
        # one byte budget: the multiple-choice knapsack solved exactly by bounded dynamic programming (milliseconds
        # where HiGHS took seconds); the MILP below only if its states outgrow their cap
        picks = _prepared(problem).solve(memory_budget)
        if picks is not None:
            return _choice("exact", problem, picks, time.monotonic() - started, 0.0)
    # HiGHS also stops at an absolute gap of 1e-6: scale the objective so that the optimum is O(1), by the greedy
    # choice's value (feasible, so an upper bound, and close to the optimum)
    greedy = choose_greedy(problem, memory_budget, error_budget)
    reference = float(greedy.total_bytes) if error_budget is not None else greedy.error
    slack = 0
    for _ in range(8):
        picks, gap = _solve(problem, None if memory_budget is None else memory_budget - slack, error_budget,
                            time_limit_s, reference)  # fmt: skip
        if picks is None:
            break
        choice = _choice("exact", problem, picks, time.monotonic() - started, gap)
        excess = 0 if memory_budget is None else choice.total_bytes - memory_budget
        if excess <= 0:
            return choice
        slack += excess
    if error_budget is not None:
        best = min(sum(t.weight * min(o.error for o in t.options) for t in problem), float("inf"))
        raise PlanError(
            f"no choice of data types has weighted error <= {error_budget:.4g}"
            + (f" within {format_gb(memory_budget)}" if memory_budget is not None else "")
            + f" (the most precise allowed types give {best:.4g}); raise --error-budget or --memory-budget",
            PlanErrorKind.INSUFFICIENT_MEMORY,
        )
    raise PlanError("the precision MILP found no solution within its time limit", PlanErrorKind.INVALID_PLAN)


# the last problem made ready for the exact choice: ``frontier`` solves one problem at many budgets
_PREPARED: list[tuple[Sequence[TableChoices], mckp.Prepared]] = []


def _prepared(problem: Sequence[TableChoices]) -> mckp.Prepared:
    """``problem``'s options made ready for ``mckp`` once (an immutable tuple is reused at the next budget)."""
    if _PREPARED and _PREPARED[0][0] is problem:
        return _PREPARED[0][1]
    prepared = mckp.Prepared([([o.bytes for o in t.options], [t.weight * o.error for o in t.options])
                              for t in problem])  # fmt: skip
    _PREPARED[:] = [(problem, prepared)] if isinstance(problem, tuple) else []
    return prepared


def _choose_placed(
    problem: Sequence[TableChoices],
    memory_budget: int | None,
    error_budget: float | None,
    time_limit_s: float,
    device_budgets: DeviceBudgets,
    started: float,
) -> PrecisionChoice:
    """The choice of type and device per table (``choose_exact`` with ``device_budgets``).

    Two designs, the better kept: (1) the joint MILP (a binary per table x type x device), solved whole when
    small; (2) for any size, the types chosen under the aggregate budget (total weights <= the devices'
    budgets less the tables' buffers), then packed onto the devices largest first, the aggregate budget lowered
    by what did not fit until everything does. The gap is reported against the aggregate optimum, a lower bound
    of every placed choice (and the joint MILP's own bound when it ran): HiGHS cannot close it on 40,000
    symmetric binaries in seconds (measured: 500 tables x 16 devices, 10 s, gap 80 %), the packing does."""
    _check_devices_feasible(problem, device_budgets)
    caps = device_budgets.budgets
    overhead = sum(device_budgets.overhead(t.table) for t in problem)
    aggregate = sum(caps) - overhead
    if memory_budget is not None:
        aggregate = min(aggregate, memory_budget)
    candidates: list[PrecisionChoice] = []
    bound = 0.0
    lower = choose_exact(problem, aggregate, error_budget, time_limit_s)
    if error_budget is None:
        bound = lower.error * (1 - (lower.gap or 0.0))
    else:  # the fewest bytes within the error budget, placed or not
        bound = lower.total_bytes * (1 - (lower.gap or 0.0))
    packed = _pack_choices(problem, aggregate, error_budget, time_limit_s, device_budgets, started)
    if packed is not None:
        candidates.append(packed)
    num_vars = sum(len(t.options) for t in problem) * len(caps)
    if num_vars <= JOINT_MAX_VARIABLES or not candidates:
        joint = _joint_placed(problem, memory_budget, error_budget, time_limit_s, device_budgets, started)
        if joint is not None:
            candidates.append(joint[0])
            bound = max(bound, joint[1])
    if not candidates:
        raise PlanError(
            "no choice of data types and devices fits the device budgets "
            f"{[format_gb(b) for b in caps]}"
            + (f" and the memory budget {format_gb(memory_budget)}" if memory_budget is not None else "")
            + (f" with weighted error <= {error_budget:.4g}" if error_budget is not None else "")
            + " within the solver's time limit; add devices or memory, raise the budgets or lower the tables' floors",
            PlanErrorKind.INSUFFICIENT_MEMORY,
        )
    if error_budget is not None:
        best = min(candidates, key=lambda c: (c.total_bytes, c.error))
        value = float(best.total_bytes)
    else:
        best = min(candidates, key=lambda c: (c.error, c.total_bytes))
        value = best.error
    gap = max(0.0, (value - bound) / value) if value > 0 else 0.0
    return replace(best, seconds=time.monotonic() - started, gap=gap)


def _pack_choices(
    problem: Sequence[TableChoices],
    aggregate: int,
    error_budget: float | None,
    time_limit_s: float,
    device_budgets: DeviceBudgets,
    started: float,
) -> PrecisionChoice | None:
    """Design (2) of ``_choose_placed``: types under the aggregate budget, then packed; lower and retry."""
    budget = aggregate
    floor = smallest_bytes(problem)
    for _ in range(32):
        if budget < floor:
            return None
        try:
            types = choose_exact(problem, budget, error_budget, time_limit_s)
        except PlanError:
            return None
        sizes = [o.bytes for t, d in zip(problem, types.data_types) for o in t.options if o.data_type == d]
        items = [size + device_budgets.overhead(t.table) for size, t in zip(sizes, problem)]
        devices, short = _pack(items, device_budgets.budgets)
        if devices is not None:
            picks = [next(i for i, o in enumerate(t.options) if o.data_type == d)
                     for t, d in zip(problem, types.data_types)]  # fmt: skip
            return _choice("exact", problem, picks, time.monotonic() - started, None, devices, device_budgets)
        if error_budget is not None:
            return None  # fewer bytes cannot meet the error budget: only the joint MILP can place it
        budget = min(types.total_bytes, budget) - max(short, budget // 10_000, 1)
    return None


def _pack(items: Sequence[int], caps: Sequence[int]) -> tuple[list[int] | None, int]:
    """Largest item first onto the device with the most room left (then, if that fails, onto the fullest
    device it fits): each item's device, or None and the bytes by which the first unplaced item missed."""
    order = sorted(range(len(items)), key=lambda i: -items[i])
    short = 0
    for fullest in (False, True):
        room = list(caps)
        devices = [-1] * len(items)
        for index in order:
            fits = [k for k in range(len(room)) if room[k] >= items[index]]
            if not fits:
                short = items[index] - max(room)
                break
            device = min(fits, key=lambda k: room[k]) if fullest else max(fits, key=lambda k: room[k])
            room[device] -= items[index]
            devices[index] = device
        else:
            return devices, 0
    return None, short


def _joint_placed(
    problem: Sequence[TableChoices],
    memory_budget: int | None,
    error_budget: float | None,
    time_limit_s: float,
    device_budgets: DeviceBudgets,
    started: float,
) -> tuple[PrecisionChoice, float] | None:
    """Design (1) of ``_choose_placed``: the joint MILP, checked in integer bytes (a budget tightened by any
    tolerance-sized excess and solved again); the choice and the solver's lower bound."""
    if error_budget is not None:
        reference = float(choose_greedy(problem, memory_budget, error_budget).total_bytes)
    else:
        total = memory_budget if memory_budget is not None else sum(device_budgets.budgets)
        reference = choose_greedy(problem, total).error
    budget = memory_budget
    caps = list(device_budgets.budgets)
    for _ in range(8):
        limits = replace(device_budgets, budgets=tuple(caps))
        picks, devices, gap = _solve_placed(problem, budget, error_budget, time_limit_s, reference, limits)
        if picks is None or devices is None:
            return None
        choice = _choice("exact", problem, picks, time.monotonic() - started, gap, devices, device_budgets)
        assert choice.device_bytes is not None
        over = [used - cap for used, cap in zip(choice.device_bytes, device_budgets.budgets)]
        total_over = 0 if memory_budget is None else choice.total_bytes - memory_budget
        if total_over <= 0 and all(o <= 0 for o in over):
            value = float(choice.total_bytes) if error_budget is not None else choice.error
            return choice, value * (1 - (gap if gap is not None else 1.0))
        caps = [cap - max(o, 0) for cap, o in zip(caps, over)]
        if budget is not None:
            budget -= max(total_over, 0)
    return None


def _check_devices_feasible(problem: Sequence[TableChoices], device_budgets: DeviceBudgets) -> None:
    """Every table must fit the largest device at its fewest bytes; all of them, the devices together."""
    largest = max(device_budgets.budgets)
    for table in problem:
        need = table.options[0].bytes + device_budgets.overhead(table.table)
        if need > largest:
            raise PlanError(
                f"table {table.table!r} needs {format_gb(need)} at {table.options[0].data_type.value} (with its batch "
                f"buffers) and the largest device budget is {format_gb(largest)}: table-wise it fits no device. "
                "Give the devices more memory, lower the table's floor (min_data_type) or shard it row-wise",
                PlanErrorKind.INSUFFICIENT_MEMORY,
            )
    need = sum(t.options[0].bytes + device_budgets.overhead(t.table) for t in problem)
    if need > sum(device_budgets.budgets):
        raise PlanError(
            f"the devices hold {format_gb(sum(device_budgets.budgets))} together and the smallest choice needs "
            f"{format_gb(need)} (every table at its least allowed type, with its batch buffers); add devices or "
            "memory, or lower the tables' floors (min_data_type)",
            PlanErrorKind.INSUFFICIENT_MEMORY,
        )


def _solve_placed(
    problem: Sequence[TableChoices],
    memory_budget: int | None,
    error_budget: float | None,
    time_limit_s: float,
    objective_scale: float,
    device_budgets: DeviceBudgets,
) -> tuple[list[int] | None, list[int] | None, float | None]:
    """One binary per (table, option, device): option j of the flattened options on device k is j * K + k."""
    num_devices = len(device_budgets.budgets)
    sizes = [len(t.options) for t in problem]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    num_options = int(starts[-1])
    num_vars = num_options * num_devices
    owner = np.repeat(np.arange(len(problem)), sizes)
    option_of_var = np.repeat(np.arange(num_options), num_devices)
    device_of_var = np.tile(np.arange(num_devices), num_options)
    byte_values = np.array([o.bytes for t in problem for o in t.options], dtype=np.float64)
    overheads = np.array([device_budgets.overhead(t.table) for t in problem], dtype=np.float64)
    errors = np.array([t.weight * o.error for t in problem for o in t.options], dtype=np.float64)
    byte_scale = float(max(max(device_budgets.budgets), 1))
    every = np.arange(num_vars)
    rows, cols, vals = [owner[option_of_var]], [every], [np.ones(num_vars)]
    lower, upper = [np.ones(len(problem))], [np.ones(len(problem))]
    row = len(problem)
    rows.append(row + device_of_var)
    cols.append(every)
    vals.append((byte_values[option_of_var] + overheads[owner[option_of_var]]) / byte_scale)
    lower.append(np.full(num_devices, -np.inf))
    upper.append(np.array(device_budgets.budgets, dtype=np.float64) / byte_scale)
    row += num_devices
    if memory_budget is not None:
        rows.append(np.full(num_vars, row))
        cols.append(every)
        vals.append(byte_values[option_of_var] / byte_scale)
        lower.append(np.array([-np.inf]))
        upper.append(np.array([memory_budget / byte_scale]))
        row += 1
    if error_budget is not None:
        rows.append(np.full(num_vars, row))
        cols.append(every)
        vals.append(errors[option_of_var])
        lower.append(np.array([-np.inf]))
        upper.append(np.array([error_budget]))
        row += 1
    per_option = byte_values if error_budget is not None else errors
    objective = per_option[option_of_var] / (objective_scale or 1.0)
    constraints = (rows, cols, vals, lower, upper)
    outcome = _solve_binary(objective, constraints, row, time_limit_s, PLACED_MIP_REL_GAP, "precision and placement")
    if outcome is None:
        return None, None, None
    picks, devices = [], []
    for t in range(len(problem)):
        block = outcome.x[starts[t] * num_devices : starts[t + 1] * num_devices]
        best = int(np.argmax(block))
        picks.append(best // num_devices)
        devices.append(best % num_devices)
    gap = getattr(outcome, "mip_gap", None)
    return picks, devices, (float(gap) if gap is not None and np.isfinite(gap) else None)


def _solve_binary(
    objective: np.ndarray,
    constraints: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], list[np.ndarray], list[np.ndarray]],
    num_rows: int,
    time_limit_s: float,
    rel_gap: float,
    what: str,
) -> Any:
    """HiGHS on a 0/1 program: minimise ``objective`` subject to ``lower <= A x <= upper``, ``A`` given as COO
    pieces (rows, cols, vals) with ``num_rows`` rows; the result, or None when no solution was found."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    rows, cols, vals, lower, upper = constraints
    num_vars = len(objective)
    matrix = coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(num_rows, num_vars)
    ).tocsr()
    outcome = milp(
        objective,
        integrality=np.ones(num_vars),
        bounds=Bounds(np.zeros(num_vars), np.ones(num_vars)),
        constraints=LinearConstraint(matrix, np.concatenate(lower), np.concatenate(upper)),
        options={"time_limit": time_limit_s, "presolve": True, "mip_rel_gap": rel_gap},
    )
    if outcome.x is None:
        logger.debug("%s MILP found no solution: %s", what, outcome.message)
        return None
    return outcome


def _check_feasible(problem: Sequence[TableChoices], memory_budget: int | None) -> None:
    need = smallest_bytes(problem)
    if memory_budget is None or need <= memory_budget:
        return
    largest = max(problem, key=lambda t: t.options[0].bytes)
    raise PlanError(
        f"a memory budget of {format_gb(memory_budget)} is too small: the smallest choice (every table at its "
        f"least allowed type) needs {format_gb(need)}; the largest, table {largest.table!r} at "
        f"{largest.options[0].data_type.value}, needs {format_gb(largest.options[0].bytes)}. Raise --memory-budget "
        "or lower the tables' floors (min_data_type)",
        PlanErrorKind.INSUFFICIENT_MEMORY,
    )


def _solve(
    problem: Sequence[TableChoices],
    memory_budget: int | None,
    error_budget: float | None,
    time_limit_s: float,
    objective_scale: float,
) -> tuple[list[int] | None, float | None]:
    sizes = [len(t.options) for t in problem]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    num_vars = int(starts[-1])
    owner = np.repeat(np.arange(len(problem)), sizes)
    byte_values = np.array([o.bytes for t in problem for o in t.options], dtype=np.float64)
    errors = np.array([t.weight * o.error for t in problem for o in t.options], dtype=np.float64)
    # scale to O(1) numbers: HiGHS tolerances are absolute
    byte_scale = float(memory_budget) if memory_budget else float(byte_values.max() or 1.0)
    rows = [owner]
    cols = [np.arange(num_vars)]
    vals = [np.ones(num_vars)]
    lower = [np.ones(len(problem))]
    upper = [np.ones(len(problem))]
    row = len(problem)
    if memory_budget is not None:
        rows.append(np.full(num_vars, row))
        cols.append(np.arange(num_vars))
        vals.append(byte_values / byte_scale)
        lower.append(np.array([-np.inf]))
        upper.append(np.array([memory_budget / byte_scale]))
        row += 1
    if error_budget is not None:
        rows.append(np.full(num_vars, row))
        cols.append(np.arange(num_vars))
        vals.append(errors)
        lower.append(np.array([-np.inf]))
        upper.append(np.array([error_budget]))
        row += 1
    objective = (byte_values if error_budget is not None else errors) / (objective_scale or 1.0)
    outcome = _solve_binary(objective, (rows, cols, vals, lower, upper), row, time_limit_s, MIP_REL_GAP, "precision")
    if outcome is None:
        return None, None
    picks = [int(np.argmax(outcome.x[starts[t] : starts[t + 1]])) for t in range(len(problem))]
    gap = getattr(outcome, "mip_gap", None)
    return picks, (float(gap) if gap is not None and np.isfinite(gap) else 0.0 if outcome.status == 0 else None)


# ---------------------------------------------------------------------------- frontier and the report
def frontier(problem: Sequence[TableChoices], points: int = FRONTIER_POINTS) -> tuple[tuple[int, float], ...]:
    """The error-vs-bytes frontier: the exact choice at ``points`` budgets from the smallest choice to the
    largest, kept where each point has fewer bytes or less error than the others (Pareto), fewest bytes first."""
    low = smallest_bytes(problem)
    high = sum(t.options[-1].bytes for t in problem)
    found = set()
    for budget in np.linspace(low, high, max(points, 2)):
        choice = choose_exact(problem, int(budget))
        found.add((choice.total_bytes, choice.error))
    pareto: list[tuple[int, float]] = []
    for total, error in sorted(found):
        if not pareto or error < pareto[-1][1] - 1e-15:
            pareto.append((total, error))
    return tuple(pareto)


@dataclass(frozen=True)
class PrecisionPlan:
    """The chosen data types with the greedy and uniform choices beside them, the frontier and the inputs."""

    problem: tuple[TableChoices, ...]
    chosen: PrecisionChoice
    greedy: PrecisionChoice
    uniform: tuple[PrecisionChoice, ...]  # int8, int4
    frontier: tuple[tuple[int, float], ...]
    memory_budget: int | None
    error_budget: float | None
    access: str

    def data_types(self) -> dict[str, DataType]:
        return {t.table: d for t, d in zip(self.problem, self.chosen.data_types)}

    def devices(self) -> dict[str, int] | None:
        """Each table's device, when the types were chosen jointly with device budgets."""
        if self.chosen.devices is None:
            return None
        return {t.table: d for t, d in zip(self.problem, self.chosen.devices)}

    def reasons(self) -> list[dict[str, Any]]:
        """Per table: the type chosen, and against the spec's type the bytes saved and the weighted error added."""
        out = []
        blocks = self.chosen.blocks or tuple(() for _ in self.problem)
        for table, data_type, table_blocks in zip(self.problem, self.chosen.data_types, blocks):
            option = next(o for o in table.options if o.data_type == data_type and o.blocks == table_blocks)
            row: dict[str, Any] = {}
            if table_blocks:  # precision blocks (``infer.planner.blocks``): hottest first, the last the rest
                row["blocks"] = [b.to_dict() for b in table_blocks]
                row["ranking"] = table.ranking
            out.append(
                row
                | {
                    "table": table.table,
                    "data_type": data_type.value,
                    "declared": table.declared.data_type.value,
                    "bytes": option.bytes,
                    "bytes_saved": table.declared.bytes - option.bytes,
                    "error": option.error,
                    "weight": table.weight,
                    "error_added": table.weight * (option.error - table.declared.error),
                }
            )
        return out

    def block_tables(self) -> dict[str, tuple[RowBlock, ...]]:
        """The tables the choice holds in precision blocks, with their blocks."""
        blocks = self.chosen.blocks or tuple(() for _ in self.problem)
        return {t.table: b for t, b in zip(self.problem, blocks) if b}

    def to_dict(self) -> dict[str, Any]:
        """The plan's record (``ShardingPlan.planner["precision"]``)."""
        return {
            "memory_budget": self.memory_budget,
            "error_budget": self.error_budget,
            "access": self.access,
            "chosen": self.chosen.to_dict(),
            "greedy": self.greedy.to_dict(),
            "uniform": [u.to_dict() for u in self.uniform],
            "tables": self.reasons(),
            "frontier": [[total, error] for total, error in self.frontier],
        }


def plan_precision(
    spec: ModelSpec,
    measured: Sequence[TableError],
    memory_budget: int | None,
    error_budget: float | None = None,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    sample: AccessSample | None = None,
    row_alignment: int = CPU_ROW_ALIGNMENT,
    frontier_points: int = FRONTIER_POINTS,
    device_budgets: DeviceBudgets | None = None,
    eval_measure: str | None = None,
    blocks: Callable[..., tuple[TableChoices, ...]] | None = None,
) -> PrecisionPlan:
    """Choose every table's data type (see the module docstring) and compute what is reported beside it; with
    ``device_budgets`` every table's device too (``EmbeddingPlanner.device_budgets`` gives a topology's);
    ``eval_measure`` names the model-level measure of ``measured`` (``quant.eval_error``), unweighted. ``blocks``
    (``infer.planner.blocks.block_problem``, handed in: that module builds on this one): with a ``sample`` of ids
    or the rows' ranges (``infer.planner.row_ranges``, bound into ``blocks``), and neither of the two, tables may be
    held in precision blocks; ``block_tables`` says which."""
    if blocks is not None and eval_measure is None and device_budgets is None:
        problem = blocks(spec, measured, sample, constraints, row_alignment)
    else:
        problem = precision_problem(spec, measured, constraints, sample, row_alignment, eval_measure is not None)
    chosen = choose_exact(problem, memory_budget, error_budget, device_budgets=device_budgets)
    greedy = choose_greedy(problem, memory_budget, error_budget)
    uniform = tuple(choose_uniform(problem, d) for d in (DataType.INT8, DataType.INT4))
    points = frontier(problem, frontier_points) if frontier_points else ()
    logger.info(
        "precision: %s, weighted error %.4g (greedy %.4g, uniform int4 %.4g) in %.2fs, gap %s",
        format_gb(chosen.total_bytes), chosen.error, greedy.error, uniform[1].error, chosen.seconds, chosen.gap,
    )  # fmt: skip
    access = sample.source if sample is not None else UNIFORM_ACCESS
    if eval_measure is not None:
        access = f"{eval_measure} on an evaluation sample, one table quantized at a time"
    return PrecisionPlan(problem, chosen, greedy, uniform, points, memory_budget, error_budget, access)


def apply_precision(spec: ModelSpec, precision: PrecisionPlan) -> ModelSpec:
    """The spec with the chosen data types, and the tables chosen in precision blocks held in them (which the
    enumerator then shards table-wise only)."""
    typed = spec.with_data_types(overrides=precision.data_types())
    blocks = precision.block_tables()
    if not blocks:
        return typed
    tables = tuple(t.with_blocks(blocks[t.name]) if t.name in blocks else t for t in typed.tables)
    return ModelSpec(tables, typed.num_dense_features, typed.dense_arch)
