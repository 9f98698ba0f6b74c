"""What a chaos run (scripts/chaos.py) ends with: the figures, the report and the verdict, read
from the final DCP checkpoints and the TensorBoard losses of both runs."""

from __future__ import annotations

import sys
from pathlib import Path

from scripts.chaos_faults import HEALING

REPO = Path(__file__).resolve().parents[1]


def tb_losses(dump: Path) -> dict[int, float]:
    sys.path.insert(0, str(REPO))
    from tests.helpers import losses

    return losses(dump)


def _figures(
    records,
    ref: Path,
    dump: Path,
    steps: int,
    interval: int,
    seconds: float,
    kinds,
    final: str | None = None,
) -> dict:
    """`final`: the last checkpoint's URL when it is not in `dump` (the s3 layout)."""
    final_ref = ref / "checkpoint" / f"step-{steps}"
    final = final or dump / "checkpoint" / f"step-{steps}"
    from trainer.checkpoint.safe_load import load_tensors

    a, b = load_tensors(final_ref), load_tensors(final)
    differing = sorted(
        k for k in a if k not in b or not bool((a[k] == b[k]).all()) or a[k].dtype != b[k].dtype
    )
    ref_losses, got_losses = tb_losses(ref), tb_losses(dump)
    loss_diffs = [s for s in range(1, steps + 1) if got_losses.get(s) != ref_losses.get(s)]
    survived = [r for r in records if r.resumed == r.expected]
    bound = [r.redone <= allowance(r.fault.kind, interval) for r in records]
    # faults whose own failed or damaged save cost more than an interval (allowed, and said)
    extra = [
        f"{r.fault.kind} {r.redone}"
        for r in records
        if interval < r.redone <= allowance(r.fault.kind, interval)
    ]
    return {
        "faults": len(records),
        "survived": len(survived),
        "during_save": sum(r.in_save for r in records),
        "kinds": {k: sum(r.fault.kind == k for r in records) for k in kinds},
        "per_kind": per_kind(
            [(r.fault.kind, r.resumed == r.expected, bool(r.in_save), r.redone) for r in records]
        ),
        "healed_in_job": sum(r.fault.kind in HEALING and r.exit_code is None for r in records),
        "launches": 1 + sum(r.exit_code is not None for r in records),
        "redone": [r.redone for r in records],
        "redone_total": sum(r.redone for r in records),
        "max_redone_ok": all(bound),
        "redone_beyond_interval": extra,
        "tensors": len(a),
        "tensors_differing": differing,
        "loss_steps_differing": loss_diffs,
        "data_lost": len(records) - len(survived) + len(differing) + len(loss_diffs),
        "seconds": round(seconds, 1),
    }


def per_kind(rows) -> dict:
    """{kind: {faults, survived, during_save, redone_max}} from (kind, survived, in a save,
    steps redone) per fault."""
    out: dict = {}
    for kind, survived, in_save, redone in rows:
        k = out.setdefault(kind, {"faults": 0, "survived": 0, "during_save": 0, "redone_max": 0})
        k["faults"] += 1
        k["survived"] += bool(survived)
        k["during_save"] += bool(in_save)
        k["redone_max"] = max(k["redone_max"], redone)
    return out


def allowance(kind: str, interval: int) -> int:
    """Steps a fault may cost: the interval since the last save; a damaged checkpoint costs
    its own steps too (the one before is resumed), and a save the fault itself made fail (a
    full disk during an async save: the failure shows at the next save) up to two intervals."""
    if kind == "ckpt-damage":
        return 2 * interval + 1
    return 2 * interval if kind == "save-ENOSPC" else interval


def report(fig: dict, interval: int) -> str:
    kinds = ", ".join(f"{v} {k}" for k, v in fig["kinds"].items())
    node = "tolerance" in fig  # scripts/chaos_node.py: the lost node
    return "\n".join(
        [
            f"faults injected: {fig['faults']} ({kinds})",
            f"faults survived: {fig['survived']} "
            + (
                "(shrunk to the surviving node and grown back with a new one, each time from the "
                "newest committed step)"
                if node
                else "(the next launch or attempt resumed from the "
                "newest committed step, intact; every slow rank named)"
            ),
            f"healed in-job:   {fig['healed_in_job']} "
            + (
                f"(elastic launch, --nnodes 1:2); node launchers: {fig['launches']}, those left "
                f"exited {fig['exit_codes']}"
                if node
                else f"(MAX_RESTARTS); launches: {fig['launches']}"
            ),
            f"during a save:   {fig['during_save']}",
            f"steps redone:    {fig['redone_total']} in all, per fault {fig['redone']} "
            + (
                f"(interval {interval}: {'all within' if fig['max_redone_ok'] else 'SOME BEYOND'}; "
                f"at the grow-backs {fig['grow_redone']}"
                if node
                else f"(interval {interval}; a fault that damaged a checkpoint or made a save "
                "fail may redo up to two intervals: "
                f"{'all within' if fig['max_redone_ok'] else 'SOME BEYOND'}"
            )
            + (
                f"; beyond one interval: {', '.join(fig['redone_beyond_interval'])}"
                if fig.get("redone_beyond_interval")
                else ""
            )
            + ")",
            _final_state(fig),
            *([_store_line(fig["store"])] if "store" in fig else []),
            f"data lost:       {fig['data_lost'] or 'none'}",
            f"wall time:       {fig['seconds']}s",
        ]
    )


def _store_line(store: dict) -> str:
    kinds = ", ".join(f"{v} {k}" for k, v in store["injected"].items())
    return (
        f"object store:    {store['total']} faults injected by the proxy ({kinds}; "
        f"{store['during_saves']} during saves, {store['during_loads']} during loads and "
        f"verification), {store['surfaced']} surfaced in a run (retried past "
        "checkpoint.store_retries)"
    )


def _final_state(fig: dict) -> str:
    if "tolerance" not in fig:
        return (
            f"final state:     {fig['tensors'] - len(fig['tensors_differing'])}/"
            f"{fig['tensors']} DCP tensors bitwise equal to the uninterrupted run; losses "
            f"differ at steps {fig['loss_steps_differing'] or 'none'}"
        )
    bad = fig["checkpoints_bad"]
    return (
        f"final state:     every step's loss within {fig['tolerance']:g} of the uninterrupted "
        f"run (the world size changed; largest difference {fig['loss_max_diff']:.2g}); "
        f"beyond it at steps {fig['loss_steps_differing'] or 'none'}; "
        f"{fig['checkpoints']} checkpoint folders left, "
        + (
            f"NOT COMMITTED OR UNREADABLE: {', '.join(bad)}"
            if bad
            else f"all committed and loading ({fig['tensors']} tensors in the last)"
        )
    )


def table(results: list[tuple[str, dict]]) -> str:
    """A markdown table of chaos runs, one row per layout and fault kind: faults survived of
    those injected, during a save, the most steps one fault made redo, and the final state
    (bitwise, or within the lost node's tolerance)."""
    rows = [
        "| layout | kind | faults survived | during a save | steps redone at most | final state |",
        "|---|---|---|---|---|---|",
    ]
    for layout, fig in results:
        if "tolerance" in fig:
            lost = len(fig["loss_steps_differing"]) + len(fig["checkpoints_bad"])
            final = (
                f"within {fig['tolerance']:g} (max {fig['loss_max_diff']:.1e}), "
                f"{fig['checkpoints']} checkpoints intact"
                if not lost
                else f"LOST: {lost} steps or checkpoints"
            )
        else:
            differ = len(fig["tensors_differing"]) + len(fig["loss_steps_differing"])
            final = (
                f"bitwise, {fig['tensors']}/{fig['tensors']} tensors, every loss"
                if not differ
                else f"DIFFERS: {differ} tensors or steps"
            )
        for kind, k in fig["per_kind"].items():
            rows.append(
                f"| {layout} | {kind} | {k['survived']} of {k['faults']} | "
                f"{k['during_save']} | {k['redone_max']} | {final} |"
            )
        if "store" in fig:  # the fault proxy's: retried within the request, nothing redone
            st = fig["store"]
            rows.append(
                f"| {layout} | object-store 503/500/timeout/reset | "
                f"{st['total'] - st['surfaced']} of {st['total']} | "
                f"{st['during_saves']} | 0 | {final} |"
            )
    return "\n".join(rows)


def ok(fig: dict, faults: int, min_during_save: int, min_each: int = 0) -> bool:
    return (
        fig["faults"] >= faults
        and fig["during_save"] >= min_during_save
        and all(n >= min_each for n in fig["kinds"].values())
        and fig["survived"] == fig["faults"]
        and fig["max_redone_ok"]
        and fig["data_lost"] == 0
        and ("store" not in fig or fig["store"]["total"] > 0)
    )
