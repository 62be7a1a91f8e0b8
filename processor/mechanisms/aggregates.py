"""Aggregates: what a query releases per key, as columns each perturbed by its own tree.

An :class:`Aggregate` names its columns, what one record adds to each (``"one"``: 1, a count;
``"value"``: the record's value clamped to ``[-L, L]`` and put on the grid), and how the released
fields are formed from the columns' released values. Everything after the trees is
post-processing of privatized values (docs/privacy.md, "The arithmetic of releases"), so it costs
no budget. The accountant calibrates one tree per column from the columns' per-record bounds (1
or L; :func:`dpstream.accountant.plan.plan_levels`), splitting the perturbation budget equally between
them: DP-SQLP section 4.4 with the column trees composed under zCDP.

Adding an aggregate is one entry of :data:`AGGREGATES` built from :class:`Column` s and a
release function; config, accountant, pipeline and output take it from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from dpstream.accountant.intervals import CI_FIELD

#: what one record adds to a column
ONE, VALUE = "one", "value"


@dataclass(frozen=True)
class Column:
    name: str
    per_record: str  # ONE or VALUE

    @property
    def needs_value(self) -> bool:
        return self.per_record == VALUE


@dataclass(frozen=True)
class Aggregate:
    name: str
    columns: tuple[Column, ...]
    #: the published fields from each column's released value, noise stddev and confidence
    #: interval ``(low, high)`` (public: value +- a half-width from the noise distribution)
    form: Callable[[dict, dict, dict], dict]

    @property
    def needs_value(self) -> bool:
        return any(c.needs_value for c in self.columns)

    @property
    def column_kinds(self) -> tuple[str, ...]:
        """What the accountant calibrates: one tree per column, per-record bound by kind."""
        return tuple(c.per_record for c in self.columns)

    def release_fields(self, values: dict, stddevs: dict, intervals: dict) -> dict:
        """``intervals``: per column, the ``(low, high)`` bounds of its confidence interval
        (docs/privacy.md, "Error bars"), on the column's grid like its value."""
        return self.form(values, stddevs, intervals)


def _single(name: str) -> Callable[[dict, dict, dict], dict]:
    def form(values: dict, stddevs: dict, intervals: dict) -> dict:
        low, high = intervals[name]
        return {name: values[name], "stddev": stddevs[name], f"{CI_FIELD}_low": low, f"{CI_FIELD}_high": high}
    return form


def _mean(values: dict, stddevs: dict, intervals: dict) -> dict:
    """Noisy sum and noisy count, both released, and their ratio: post-processing of the two
    released values (no raw data, no extra budget). The ratio is undefined when the noisy count is
    not positive: ``mean`` is then null. The sum and the count each carry their interval
    (``sum_ci95_low`` ...); the ratio has none (docs/privacy.md, "Error bars")."""
    total, count = values["sum"], values["count"]
    out = {"sum": total, "count": count, "mean": total / count if count > 0 else None,
           "stddev": stddevs["sum"], "stddev_count": stddevs["count"]}
    for column in ("sum", "count"):
        out[f"{column}_{CI_FIELD}_low"], out[f"{column}_{CI_FIELD}_high"] = intervals[column]
    return out


COUNT = Aggregate("count", (Column("count", ONE),), _single("count"))
SUM = Aggregate("sum", (Column("sum", VALUE),), _single("sum"))
MEAN = Aggregate("mean", (Column("sum", VALUE), Column("count", ONE)), _mean)

AGGREGATES: dict[str, Aggregate] = {a.name: a for a in (COUNT, SUM, MEAN)}


def aggregate_named(name: str) -> Optional[Aggregate]:
    return AGGREGATES.get(name)
