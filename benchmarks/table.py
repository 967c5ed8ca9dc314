"""The table the benchmark prints: one Row a figure, each against its reference, and
the Goal issue #6 sets for it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


def number(x, unit=""):
    """`x` with a sensible number of digits, and its unit."""
    if x is None:
        return "-"
    digits = f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return f"{digits} {unit}".strip() if unit != "%" else f"{digits}%"


@dataclass(frozen=True)
class Goal:
    """Issue #6's target for a row: its `ratio` (or its `value`) `op` `limit`."""

    op: str  # ">=", "<=" or "<"
    limit: float
    on: str = "ratio"

    def met(self, row):
        x = getattr(row, self.on)
        return {">=": x >= self.limit, "<=": x <= self.limit, "<": x < self.limit}[
            self.op
        ]

    def text(self, unit):
        if self.on == "ratio":
            return f"{self.op} {self.limit:g}x"
        return f"{self.op} {number(self.limit, unit)}"


@dataclass
class Row:
    """One figure: its value, the reference measured beside it, and the ratio."""

    key: str  # the name in the JSON file
    figure: str
    value: float | None  # None: skipped (the note says why)
    unit: str = ""
    reference: str = ""  # what the value is compared with
    ref_value: float | None = None
    ratio: float | None = None  # the direction is stated in `figure`
    goal: Goal | None = None
    ok: bool = True  # a condition besides the goal (e.g. the copy was exact)
    note: str = ""
    ref_unit: str | None = None  # the reference's unit; None: the value's

    @property
    def met(self):
        """Whether the goal is met (None: no goal, or skipped)."""
        if self.goal is None or self.value is None:
            return None
        return self.ok and self.goal.met(self)

    def to_json(self):
        values = asdict(self)
        values["goal"] = self.goal.text(self.unit) if self.goal else None
        values["met"] = self.met
        return values


def skipped(key, figure, reason):
    """A row for a figure that could not be measured here."""
    return Row(key, figure, None, note=f"skipped: {reason}")


def print_table(rows):
    """Print the rows: figure, value, reference, ratio, goal and whether it is met."""
    print(f"{'figure':66s} {'value':>14s}  {'reference':34s} {'ratio':>7s}  goal")
    for row in rows:
        if row.value is None:
            print(f"{row.figure:66s} {'skipped':>14s}")
        else:
            ref_unit = row.unit if row.ref_unit is None else row.ref_unit
            reference = (
                f"{row.reference} {number(row.ref_value, ref_unit)}"
                if row.reference
                else ""
            )
            ratio = f"{row.ratio:.2f}x" if row.ratio is not None else ""
            goal = row.goal.text(row.unit) if row.goal else ""
            verdict = {True: " (met)", False: " (NOT met)", None: ""}[row.met]
            print(
                f"{row.figure:66s} {number(row.value, row.unit):>14s}  "
                f"{reference:34s} {ratio:>7s}  {goal}{verdict}"
            )
        if row.note:
            print(f"    {row.note}")
