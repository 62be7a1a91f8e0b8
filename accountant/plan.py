"""Calibration of one DP-SQLP query: (epsilon, delta, T, C, L, beta, split) -> sigmas and thresholds.

The mechanism (DP-SQLP sections 3-4) has two noisy parts:

* **Key selection** (Algorithm 2): per key and round a DP binary tree over the round's
  incremental unique-user counts. A user adds 1 to one leaf of a tree and takes part in at most
  C rounds overall (section 4.4), so with ``h`` read levels each tree costs
  ``h / (2 sigma_k^2)`` zCDP and the user ``C h / (2 sigma_k^2)``.
* **Hierarchical perturbation** (Algorithm 3): one tree per key and aggregate column. All C
  contributions (each clamped to L) may land in one node, so per level the user's L2 change is at
  most ``C L`` and the user costs ``h (C L)^2 / (2 sigma_m^2)`` across all keys (sum of squares
  <= square of sums).

Key selection's thresholding adds a failure term (Theorem 3.1). Let A' be the pipeline that
tests the user's keys at every trigger, with no gate and no "key not seen yet". A' is a
composition of Gaussian mechanisms. A and A' differ only if A' releases one of the user's (at
most C) keys while its true round count is <= mu, which the threshold bounds by beta per key.
Hence ``delta = delta_zCDP + (e^eps + 1) * C * beta`` (the proof of Theorem 3.1, with a union
bound over the user's keys).

Two compositions are offered:

* ``zcdp`` (default): both parts are Gaussian mechanisms, so their rho's add and one optimal
  CKS conversion gives (eps, delta). ``key_selection_share`` splits rho. The per-part
  (eps, delta) in the report are what each part satisfies on its own; they add up to more than
  the total because composing in zCDP is tighter than adding epsilons.
* ``gdp``: the Gaussian parts compose exactly in Gaussian DP (mu^2 adds; Dong, Roth and Su
  2022) and one conversion gives (eps, delta) of the continuous Gaussian. With the binary tree
  that is only the starting point: the noise is the *discrete* Gaussian on the data's own
  grid, whose curve lies up to ~11% above the continuous one at small C T, so the sigmas grow
  by a common factor until the exact discrete curve of the worst-case user
  (dpstream.accountant.discrete_gaussian_curve; :func:`worst_case_parts`) meets the delta, and
  the spent (eps, delta) are read off that curve (docs/privacy.md, "Accounting"). The BLT puts
  its noise on a lattice much finer than the data and keeps the margin ``GDP_DISCRETE_MARGIN``.
* ``basic``: the paper's section 5 split: eps_k = share * eps, eps_m = (1 - share) * eps,
  delta_k = 2 delta / 3 (half of it for the beta term), delta_m = delta / 3; each part
  calibrated separately and the totals added.

The integer noise sampler is within total variation ``SAMPLER_TV_BOUND`` of the exact discrete
Gaussian per node; a user influences at most ``2 C h`` nodes, which adds
``(e^eps + 1) 2 C h SAMPLER_TV_BOUND`` to delta (reported; ~1e-25 in practice).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from dpstream.accountant.calibration import (
    cks_delta,
    cks_epsilon,
    cks_rho,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    tail_multiplier,
)
from dpstream.accountant.counters import (
    BINARY_TREE,
    LATTICE_TARGET_SIGMA,
    LatticeSlackError,
    counter_calibration,
    lattice_sigma,
    slack_sigma,
)
from dpstream.accountant.discrete_gaussian_curve import (
    discrete_gaussian_delta,
    discrete_gaussian_epsilon,
    discrete_gaussian_scale,
)

#: Upper bound on the total-variation distance between one node's sampled integer noise and the
#: exact discrete Gaussian. The sampler (dpstream.processor.mechanisms.noise) asserts its tables meet it.
SAMPLER_TV_BOUND = 2.0 ** -100
#: Largest noise scale, in grid units, the table sampler accepts (table of ~24 sigma entries).
MAX_SAMPLER_SIGMA = 131072.0
#: Sums are quantized to a grid L / 2^j with the largest j keeping sigma_m at most this many units.
TARGET_SAMPLER_SIGMA = 4096.0
#: Share of delta given to the thresholding failure term when beta is not declared.
DEFAULT_BETA_DELTA_SHARE = 1.0 / 3.0


#: GDP calibrates the continuous Gaussian's privacy curve; our noise is the discrete Gaussian.
#: The GDP solve targets delta_conversion times (1 - this margin). For the BLT, whose noise lives
#: on a lattice far finer than the data (sigma is 2^15 to 2^16 lattice steps), the discrete curve is within
#: 1e-5 (relative) of the continuous one and the margin covers it. For the binary tree, whose
#: noise is on the data's grid, the solve is only the starting point: the exact discrete curve
#: decides (``_calibrate_discrete``; docs/privacy.md, "Accounting").
GDP_DISCRETE_MARGIN = 1e-3
GDP_CONVERSION = "mu-GDP -> (eps, delta): Dong-Roth-Su 2022 Cor. 2.13 (exact for Gaussian parts)"
#: ``composition: gdp`` with an exact counter (the binary tree): the sigmas start from the GDP
#: solve above and grow by a common factor until the exact curve of the discrete Gaussians
#: meets delta_conversion; epsilon_spent and delta_spent are read off that curve
#: A plan the exact discrete curve has to widen is solved for (1 - this) times delta_conversion
#: (plans within delta_conversion keep their sigmas): a PLD accountant with a loss grid of 1e-4
#: (dp-accounting's default) overestimates the curve by up to about 1e-5 (relative), and a plan
#: should pass such independent checks. It costs about 1e-5 in sigma.
DISCRETE_CHECK_MARGIN = 1e-4
#: The exact accountant's truncations leave up to ~1e-35 of mass it counts in full; smaller deltas are refused.
MIN_DISCRETE_DELTA = 1e-30
EXACT_DISCRETE_CONVERSION = ("exact privacy curve of the worst-case user's discrete Gaussians (dpstream.accountant."
                             "discrete_gaussian_curve), sigmas from mu-GDP (Dong-Roth-Su 2022 Cor. 2.13) grown until it holds")

#: what one record adds to a perturbed column (dpstream.processor.mechanisms.aggregates): 1, or its value
ONE, VALUE = "one", "value"


class BudgetError(ValueError):
    """A declared budget cannot be met; ``field`` names the offending parameter."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class QueryBudget:
    """What a user declares for one query (all public)."""

    epsilon: float
    delta: float
    triggers: int
    contribution_bound: int
    clamp: float = 1.0
    aggregate: str = "count"  # count | sum
    key_threshold: float = 0.0
    beta: Optional[float] = None
    key_selection_share: float = 0.5
    composition: str = "zcdp"  # zcdp | gdp | basic
    resolution: Optional[float] = None  # value grid for sums; counts use 1
    hierarchy_depth: int = 1  # histograms of a hierarchical query, one per level (docs/privacy.md, "Post-processing: hierarchical consistency"); 1: a flat histogram
    level_shares: Optional[tuple] = None  # share of the budget per level (sum 1); None: equal
    #: what one record adds to each perturbed column, one tree per column: ONE (1: a count) or
    #: VALUE (the clamped value: bound L); None: from ``aggregate`` (count: ONE, sum: VALUE)
    columns: Optional[tuple] = None
    #: the continual counter behind key selection and perturbation (dpstream.accountant.counters:
    #: "tree" or "binary_tree", "blt")
    counter: str = "binary_tree"
    #: c_k: records a user may add to one key, an integer in [1, C] (None: up to C). Stage 1 keeps
    #: the user's first c_k records per key; the perturbation sensitivity is then sqrt(C c_k) L,
    #: not C L (:func:`perturbation_squares`)
    per_key_bound: Optional[int] = None
    #: the perturbation stream's step: "trigger" (the paper's) or "release" (the key's release
    #: number, public); None: trigger
    perturbation_steps: Optional[str] = None
    #: integer weights w_1..w_C of a user's 1st, 2nd, ... key in key selection (needs
    #: per_key_bound 1, where a record's slot is its key's rank); None: 1 each
    selection_weights: Optional[tuple] = None
    #: the key domain is declared (``public_keys``): every declared key is released at every
    #: trigger, with no key selection, so the whole budget goes to perturbation and there is no
    #: thresholding term (docs/privacy.md, "Public keys")
    public_keys: bool = False


@dataclass(frozen=True)
class PrivacyPlan:
    """Everything the mechanisms need, and every term of the privacy argument."""

    epsilon: float
    delta: float
    composition: str
    triggers: int
    tree_height: int
    contribution_bound: int
    clamp: float
    aggregate: str
    resolution: float
    key_threshold: float
    beta: float
    delta_beta: float
    delta_sampler: float
    delta_conversion: float
    rho_total: float
    rho_key_selection: float
    rho_key_selection_per_tree: float
    rho_perturbation: float
    sigma_key_selection: float
    sigma_perturbation: float
    sigma_perturbation_units: float
    epsilon_key_selection: float
    delta_key_selection: float
    epsilon_perturbation: float
    delta_perturbation: float
    epsilon_spent: float
    delta_spent: float
    tail_multiplier: float
    thresholds: tuple = field(repr=False)
    expected_stddev: float = 0.0
    level: int = 1  # which level of a hierarchical query this plan calibrates (1 = coarsest)
    levels: int = 1  # the query's hierarchy depth (named ``levels`` in plans and their fingerprints)
    level_share: float = 1.0  # this level's share of the query's budget
    #: an aggregate of several columns (dpstream.processor.mechanisms.aggregates): per column (kind,
    #: sigma, sigma in grid units, grid step); the fields above describe the first column.
    #: None for one column (then left out of the fingerprint: plans of one column keep theirs)
    columns: Optional[tuple] = None
    #: the continual counter (dpstream.accountant.counters); None: the binary tree (then left out of the
    #: fingerprint, as plans before counters were named)
    counter: Optional[str] = None
    #: ||C e_1||^2 of a counter other than the tree (the tree's is ``tree_height``); None: the tree
    counter_sensitivity_sq: Optional[float] = None
    #: c_k (records per user and key) when declared; None: C
    per_key_bound: Optional[int] = None
    #: "release" when the perturbation stream steps once per release of the key; None: per trigger
    perturbation_steps: Optional[str] = None
    #: key selection's weight per slot (1-based: index 0 is slot 1) when declared; None: 1 each
    selection_weights: Optional[tuple] = None
    #: True when the key domain is public: no key selection (its sigma, rho, epsilon, delta and
    #: thresholds are 0); None otherwise (then left out of the fingerprint)
    public_keys: Optional[bool] = None
    conversion: str = "zCDP -> (eps, delta): Canonne-Kamath-Steinke 2020 Prop. 12 (optimal)"

    @property
    def clamp_units(self) -> int:
        """M: a value's largest magnitude on the grid, ``floor(L / resolution)`` (values are
        clamped to [-M, M] grid steps, so ``M * resolution <= L``; the division is exact because
        the step is a power of two)."""
        return int(math.floor(self.clamp / self.resolution))

    @property
    def perturbation_l2_sensitivity(self) -> float:
        """L2 sensitivity of one user's change to the per-key sums of one read level, in value
        units (the first column's): ``sqrt(C c_k) L`` with a per-key bound, ``C L`` without
        (:func:`perturbation_squares`)."""
        return math.sqrt(perturbation_squares(self.contribution_bound, self.per_key_bound)) * self.clamp

    @property
    def perturbation_sensitivity_units(self) -> int:
        """Per-tree L1 sensitivity of the perturbation tree in grid units: C * M <= C L / resolution."""
        return self.contribution_bound * self.clamp_units

    def threshold(self, leaf: int) -> float:
        """tau for a round tree's ``leaf`` (1-based)."""
        return self.thresholds[leaf - 1]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["thresholds"] = list(self.thresholds)
        return out


def plan_fingerprint(plans) -> bytes:
    """16 bytes naming a query's calibration (every level's plan: budget, C, L, T, grid, noise
    scales, thresholds). A window is pinned to the plan it was opened and charged under: a tree
    must never mix two noise scales, and a changed budget must never go uncharged."""
    dicts = [p if isinstance(p, dict) else p.to_dict() for p in plans]
    text = json.dumps([{k: v for k, v in d.items() if v is not None} for d in dicts], sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"dpstream-plan").digest()


def _check(budget: QueryBudget) -> None:
    def positive(name, value):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise BudgetError(name, f"must be a positive finite number, got {value!r}")

    positive("epsilon", budget.epsilon)
    if not 0 < budget.delta < 1:
        raise BudgetError("delta", f"must be in (0, 1), got {budget.delta!r}")
    if not (isinstance(budget.triggers, int) and 1 <= budget.triggers <= 1 << 24):
        raise BudgetError("triggers", f"must be an integer in [1, 2^24], got {budget.triggers!r}")
    if not (isinstance(budget.contribution_bound, int) and budget.contribution_bound >= 1):
        raise BudgetError("contribution_bound", f"must be an integer >= 1, got {budget.contribution_bound!r}")
    positive("clamp", budget.clamp)
    if budget.columns is None and budget.aggregate not in ("count", "sum"):
        raise BudgetError("aggregate", f"must be 'count' or 'sum', got {budget.aggregate!r}")
    kinds = columns_of(budget)
    if not kinds or any(k not in (ONE, VALUE) for k in kinds):
        raise BudgetError("aggregate", f"columns must be {ONE!r} or {VALUE!r}, got {kinds!r}")
    if len(kinds) > 1 and budget.composition == "basic":
        raise BudgetError("composition", f"aggregate {budget.aggregate!r} has {len(kinds)} columns, composed under zCDP or "
                                         f"GDP: composition must be 'zcdp' or 'gdp'")
    if VALUE not in kinds and budget.clamp != 1.0:
        raise BudgetError("clamp", f"a count contributes 1 per record; clamp must be 1.0 for aggregate {budget.aggregate!r}")
    if not (math.isfinite(budget.key_threshold) and budget.key_threshold >= 0):
        raise BudgetError("key_threshold", f"must be >= 0, got {budget.key_threshold!r}")
    if budget.beta is not None and not 0 < budget.beta < 1:
        raise BudgetError("beta", f"must be in (0, 1) or null, got {budget.beta!r}")
    if budget.public_keys:
        if budget.selection_weights is not None:
            raise BudgetError("selection_weights", "public keys are released without key selection: leave selection_weights null")
        if budget.key_threshold != 0:
            raise BudgetError("key_threshold", "public keys are released without key selection: key_threshold must be 0")
    elif not 0 < budget.key_selection_share < 1:
        raise BudgetError("key_selection_share", f"must be in (0, 1), got {budget.key_selection_share!r}")
    if not (isinstance(budget.hierarchy_depth, int) and 1 <= budget.hierarchy_depth <= 16):
        raise BudgetError("hierarchy_depth", f"must be an integer in [1, 16], got {budget.hierarchy_depth!r}")
    if budget.level_shares is not None:
        shares = list(budget.level_shares)
        if len(shares) != budget.hierarchy_depth or not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in shares):
            raise BudgetError("level_shares", f"must be {budget.hierarchy_depth} positive numbers, one per level, got {shares!r}")
        if abs(sum(shares) - 1.0) > 1e-9:
            raise BudgetError("level_shares", f"must add up to 1, got {sum(shares):.12g}")
    if budget.per_key_bound is not None:
        ck = budget.per_key_bound
        if not (isinstance(ck, int) and not isinstance(ck, bool) and 1 <= ck <= budget.contribution_bound):
            raise BudgetError("per_key_bound", f"must be an integer from 1 to contribution_bound (C = {budget.contribution_bound}: "
                                               f"a user adds at most C records in all), or null, got {ck!r}")
        if budget.hierarchy_depth > 1:
            raise BudgetError("per_key_bound", "is not supported with a hierarchy (hierarchy_depth > 1)")
    if budget.selection_weights is not None:
        w = list(budget.selection_weights)
        if budget.per_key_bound != 1:
            raise BudgetError("selection_weights", "need per_key_bound 1 (a record's slot is then its key's rank for the user)")
        if not (1 <= len(w) <= budget.contribution_bound and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 1024
                                                                  for x in w) and any(w)):
            raise BudgetError("selection_weights", f"must be 1 to C = {budget.contribution_bound} integers in [0, 1024], not all 0, "
                                                   f"got {w!r}")
    if budget.perturbation_steps not in (None, "trigger", "release"):
        raise BudgetError("perturbation_steps", f"must be 'trigger' or 'release', got {budget.perturbation_steps!r}")
    if budget.composition not in ("zcdp", "gdp", "basic"):
        raise BudgetError("composition", f"must be 'zcdp', 'gdp' or 'basic', got {budget.composition!r}")
    if budget.resolution is not None:
        positive("resolution", budget.resolution)
        if VALUE not in kinds and budget.resolution != 1.0:
            raise BudgetError("resolution", "counts are integers; resolution must be 1 (or null)")
        if not _is_power_of_two(budget.resolution):
            raise BudgetError("resolution", f"must be a power of two (e.g. 0.25, 1, 8) so that released sums are exact binary "
                                            f"numbers, got {budget.resolution!r}")
        if budget.resolution > budget.clamp:
            raise BudgetError("resolution", f"must be at most clamp ({budget.clamp!r}), got {budget.resolution!r}")


def _log_e_plus_one(x: float) -> float:
    """``log(e^x + 1)`` without forming ``e^x`` (``math.exp`` overflows above 709)."""
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def _growing_terms(budget: QueryBudget, draws: int) -> list[tuple[float, float, float, float]]:
    """The delta terms that grow as e^eps: per part, ``(eps share, delta it may use, beta units,
    sampler units)`` with the part's term ``(e^(share eps) + 1) (beta units beta + sampler units)``
    (docs/privacy.md, "Thresholding" and "Sampler"). A null beta is chosen so that its term is a
    fixed share of delta, which the part's delta then leaves out."""
    C, levels = budget.contribution_bound, budget.hierarchy_depth
    tv = C * draws * SAMPLER_TV_BOUND  # one stream's sampler term per user, over e^eps + 1
    if budget.public_keys:  # no key selection: no thresholding term, and no selection streams
        if budget.composition in ("zcdp", "gdp"):
            return [(1.0, budget.delta, 0.0, levels * len(columns_of(budget)) * tv)]
        return [(s, s * budget.delta, 0.0, tv) for s in _level_shares(budget)]
    if budget.composition in ("zcdp", "gdp"):
        usable = budget.delta * (1.0 - DEFAULT_BETA_DELTA_SHARE if budget.beta is None else 1.0)
        return [(1.0, usable, levels * C, levels * (1 + len(columns_of(budget))) * tv)]
    terms, share = [], budget.key_selection_share
    for s in _level_shares(budget):  # basic: each level's key selection and perturbation alone
        delta_k = 2.0 * s * budget.delta / 3.0
        terms.append((share * s, delta_k * (0.5 if budget.beta is None else 1.0), C, tv))
        terms.append(((1.0 - share) * s, s * budget.delta / 3.0, 0.0, tv))
    return terms


def epsilon_ceiling(budget: QueryBudget, draws: int) -> float:
    """The epsilon from which the delta terms that grow as e^eps (thresholding with a declared
    beta, and the sampler's total variation) use up the query's delta: a declared epsilon must be
    below it. ``draws``: noise draws of one stream that a user's increment reaches."""
    ceiling = math.inf
    beta = budget.beta or 0.0
    for eps_share, usable, beta_units, sampler_units in _growing_terms(budget, draws):
        ratio = usable / (beta_units * beta + sampler_units)  # e^(share eps) + 1 must stay below it
        ceiling = min(ceiling, math.log(ratio - 1.0) / eps_share if ratio > 1.0 else 0.0)
    return ceiling


def _no_delta_left(budget: QueryBudget, draws: int) -> BudgetError:
    """What to say when the terms of :func:`epsilon_ceiling` leave no delta: blame the field the
    user set that makes them large, and say what to do."""
    eps, ceiling = budget.epsilon, epsilon_ceiling(budget, draws)
    terms = _growing_terms(budget, draws)
    if budget.beta is not None:
        # beta is what to change when its term outweighs the sampler's and a smaller beta fits
        # (``beta_max`` <= 0: the sampler's term alone uses up delta at this epsilon)
        beta_max = min((usable * math.exp(-_log_e_plus_one(share * eps)) - t) / b for share, usable, b, t in terms if b)
        if beta_max > 0 and any(b * budget.beta >= t for _, _, b, t in terms if b):
            return BudgetError("beta", f"{budget.beta!r} is too large for epsilon {eps!r}: the thresholding term "
                                       f"(e^eps+1)*levels*C*beta uses up delta {budget.delta!r}; lower beta below "
                                       f"{beta_max:.3g}, or leave it null (then its term takes "
                                       f"{DEFAULT_BETA_DELTA_SHARE:.3g} of delta)")
    if ceiling <= 0.0:
        return BudgetError("delta", f"{budget.delta!r} is too small: the noise sampler's delta term alone exceeds it at "
                                    f"any epsilon (docs/privacy.md, \"Sampler\")")
    if budget.beta is None:
        grows, fix = "the noise sampler's delta term grows as e^epsilon and leaves", ""
    else:
        grows, fix = "the noise sampler's and beta's delta terms grow as e^epsilon and leave", " at this beta, or leave beta null"
    return BudgetError("epsilon", f"{eps!r} is too large for delta {budget.delta!r} at C = {budget.contribution_bound} and "
                                  f"T = {budget.triggers}: {grows} no delta from epsilon {ceiling:.4g} on; set epsilon "
                                  f"below {math.floor(ceiling * 10.0) / 10.0:g}{fix} (docs/privacy.md, \"Sampler\")")


def _is_power_of_two(x: float) -> bool:
    mantissa, _ = math.frexp(x)
    return x > 0 and mantissa == 0.5


def _choose_resolution(budget: QueryBudget, sigma_m: float) -> float:
    """Value grid step for the perturbation tree (noise is added on this grid; docs/privacy.md).

    Counts are integers (step 1). A sum's values are rounded to a grid whose step is a power of
    two, ``2^k``, before they are aggregated, so that integer noise on the grid is the discrete
    Gaussian mechanism on integer data and a release ``m * 2^k`` is an exact binary number
    (otherwise the fractional part of a noisy sum could expose the raw sum). ``k`` is the
    smallest keeping sigma within ``TARGET_SAMPLER_SIGMA`` grid steps, with the step at most L
    and at least ``L / 2^20``.
    """
    if VALUE not in columns_of(budget):
        return 1.0
    if budget.resolution is not None:
        return float(budget.resolution)
    top = math.floor(math.log2(budget.clamp))
    while 2.0 ** top > budget.clamp:  # log2 rounding
        top -= 1
    k = max(math.ceil(math.log2(sigma_m / TARGET_SAMPLER_SIGMA)), top - 20)
    return 2.0 ** min(k, top)


def columns_of(budget: QueryBudget) -> tuple[str, ...]:
    """What one record adds to each perturbed column (one tree per column)."""
    if budget.columns is not None:
        return tuple(budget.columns)
    return (ONE,) if budget.aggregate == "count" else (VALUE,)


def _level_shares(budget: QueryBudget) -> tuple[float, ...]:
    if budget.level_shares is None:
        return (1.0 / budget.hierarchy_depth,) * budget.hierarchy_depth
    return tuple(float(s) for s in budget.level_shares)


def perturbation_squares(C: int, per_key_bound: Optional[int]) -> int:
    """The squared L2 sensitivity of one user's per-key record counts, in units of one record's
    bound squared, that every perturbation sigma is calibrated to: ``C c_k`` with ``c_k =
    min(per_key_bound, C)`` (``C^2`` without a per-key bound). A user adds at most c_k records to
    a key and C in all, so the squared change over keys, ``sum_j n_j^2`` with ``n_j <= c_k`` and
    ``sum_j n_j <= C``, is at most ``floor(C / c_k) c_k^2 + (C mod c_k)^2 <= C c_k`` (equal when
    c_k divides C; docs/privacy.md, "Per-key bound"). The exact discrete curve of ``composition:
    gdp`` with the tree charges that pattern itself (:func:`_user_parts`)."""
    ck = C if per_key_bound is None else min(int(per_key_bound), C)
    return C * ck


def _user_parts(C: int, h: int, per_key_bound: Optional[int], weights: Optional[tuple], sigma_k: float,
                columns) -> tuple[tuple, tuple]:
    """(key selection parts, perturbation parts) of the worst-case user of one level of the binary
    tree, each ``(sigma, shift, copies)`` in integer units (dpstream.accountant.discrete_gaussian_curve).
    ``columns``: per perturbed column, (sigma in grid units, one record's bound in grid units).

    Key selection: each of the user's keys adds its weight (1 without weights) to one leaf of
    its round tree, moving one read node per level: ``h`` copies per key. Perturbation: all of
    the user's records in one node per level, the shift ``C B`` on ``h`` nodes; with a per-key
    bound c_k < C at most ``c_k B`` on one key's node, so ``floor(C / c_k)`` keys' nodes moved by
    ``c_k B`` and, when c_k does not divide C, one more moved by ``(C mod c_k) B``, per level.
    Concentrating the shift is the worst pattern (docs/privacy.md, "Accounting"; checked over
    every split in tests/test_gdp_accounting.py). ``sigma_k`` 0: public keys, no key selection."""
    if sigma_k == 0:
        selection = ()
    elif weights is not None:
        counts: dict[int, int] = {}
        for w in weights:
            if w:
                counts[w] = counts.get(w, 0) + 1
        selection = tuple((sigma_k, w, n * h) for w, n in sorted(counts.items()))
    else:
        selection = ((sigma_k, 1, C * h),)
    if per_key_bound is not None and per_key_bound < C:
        rest = C % per_key_bound  # the last key's records when c_k does not divide C
        perturbation = tuple(part for units, bound in columns
                             for part in ((units, per_key_bound * bound, (C // per_key_bound) * h),
                                          *(((units, rest * bound, h),) if rest else ())))
    else:
        perturbation = tuple((units, C * bound, h) for units, bound in columns)
    return selection, perturbation


def worst_case_parts(plan: PrivacyPlan) -> tuple[tuple, tuple]:
    """(key selection parts, perturbation parts) of the worst-case user for one level's plan of
    the binary tree, read from the plan's own fields (sigmas in integer units, shifts from C,
    the grid and the per-key bound): what ``composition: gdp`` charges on the exact discrete
    curve. The query's parts are those of all its levels' plans."""
    if plan.columns is None:
        columns = ((plan.sigma_perturbation_units, plan.clamp_units),)
    else:
        columns = tuple((units, int(math.floor(plan.clamp / step)) if kind == VALUE else 1) for kind, _, units, step in plan.columns)
    return _user_parts(plan.contribution_bound, plan.tree_height, plan.per_key_bound, plan.selection_weights,
                       0.0 if plan.public_keys else plan.sigma_key_selection, columns)


def _calibrate_discrete(budget: QueryBudget, h: int, sigmas: list, parts: list, resolution: float, rho: float,
                        delta_conv: float, delta_other: float):
    """``composition: gdp`` on the binary tree: the GDP solve (with its margin) is the starting
    point; if the exact discrete curve of the worst-case user (every level, column, weight and
    per-key bound) exceeds ``delta_conv`` at epsilon, every sigma grows by one common factor
    until it does not. Returns the widened sigmas, the parts (rho and per-part epsilons from the
    discrete curves), rho, epsilon_spent and delta_spent read off the exact curve; None for a plan
    already within (it keeps everything)."""
    C, kinds, eps = budget.contribution_bound, columns_of(budget), budget.epsilon
    if delta_conv < MIN_DISCRETE_DELTA:
        raise BudgetError("delta", f"{budget.delta!r} leaves {delta_conv:.3g} for the Gaussian parts, below {MIN_DISCRETE_DELTA:g}: "
                                   f"too small for the exact discrete accountant of composition 'gdp' with counter 'tree' "
                                   f"(use composition: zcdp, or a larger delta)")

    def level_parts(sigma_k, column_sigmas):
        steps = [resolution if kind == VALUE else 1.0 for kind in kinds]
        columns = [(sigma / step, int(math.floor(budget.clamp / step)) if kind == VALUE else 1)
                   for kind, sigma, step in zip(kinds, column_sigmas, steps)]
        return _user_parts(C, h, budget.per_key_bound, budget.selection_weights, sigma_k, columns)

    def everything(level_sigmas):
        return [p for sk, cols in level_sigmas for part in level_parts(sk, cols) for p in part]

    scale = discrete_gaussian_scale(everything(sigmas), eps, delta_conv, aim=1.0 - DISCRETE_CHECK_MARGIN)
    if scale == 1.0:
        # within delta on the exact curve already: the plan stays as the GDP solve made it (same
        # sigmas, reported spend and fingerprint; its delta_spent, the declared delta less the
        # margin's rounding, bounds the exact one from above)
        return None
    sigmas = [(sigma_k * scale, [sigma * scale for sigma in cols]) for sigma_k, cols in sigmas]
    if any(sigma_k > MAX_SAMPLER_SIGMA for sigma_k, _ in sigmas):
        raise BudgetError("contribution_bound", "key-selection noise is beyond the sampler's range")
    # the pair the ledger charges is one point of the exact curve: delta at the declared epsilon,
    # and the smallest epsilon with that delta (the declared one, to 1e-12)
    every = everything(sigmas)
    delta_gauss = discrete_gaussian_delta(every, eps)
    eps_spent = min(eps, discrete_gaussian_epsilon(every, delta_gauss))
    share, new_parts = _selection_share(budget), []
    for (rho_k, rho_m, _, delta_k, _, delta_m, beta), (sigma_k, cols), s in zip(parts, sigmas, _level_shares(budget)):
        selection, perturbation = level_parts(sigma_k, cols)
        new_parts.append((rho_k / scale ** 2, rho_m / scale ** 2,
                          discrete_gaussian_epsilon(selection, share * s * delta_conv) if selection else 0.0, delta_k,
                          discrete_gaussian_epsilon(perturbation, (1.0 - share) * s * delta_conv), delta_m, beta))
    return sigmas, new_parts, rho / scale ** 2, eps_spent, delta_gauss + delta_other


def _selection_share(budget: QueryBudget) -> float:
    """Key selection's share of the budget: none with public keys (docs/privacy.md, "Public keys")."""
    return 0.0 if budget.public_keys else budget.key_selection_share


def plan_query(budget: QueryBudget) -> PrivacyPlan:
    """Calibrate a query. Raises :class:`BudgetError` naming the field when it cannot be met.

    For a hierarchical query this is the plan of its first (coarsest) level; every level's plan
    carries the query's totals (``epsilon_spent``, ``delta_spent``, ...), so callers that only
    need the guarantee may use it. The mechanisms use :func:`plan_levels`."""
    return plan_levels(budget)[0]


def plan_levels(budget: QueryBudget) -> tuple[PrivacyPlan, ...]:
    """One plan per level of the query (one level for a flat query); see :func:`_plan_levels`.
    Raises :class:`BudgetError` naming the field when the budget cannot be met, including a budget
    so small that the BLT's lattice rounding slack alone exceeds it (``counter: tree`` has none)."""
    try:
        return _plan_levels(budget)
    except LatticeSlackError:
        raise BudgetError("epsilon", f"{budget.epsilon!r} is too small for counter 'blt' at T = {budget.triggers} and C = "
                                     f"{budget.contribution_bound}: the lattice rounding slack alone exceeds the budget "
                                     f"(use counter: tree, or a larger epsilon)") from None


def _plan_levels(budget: QueryBudget) -> tuple[PrivacyPlan, ...]:
    """One plan per level of the query (one level for a flat query).

    A hierarchical query (docs/privacy.md, "Post-processing: hierarchical consistency") keeps a histogram per level: each admitted record
    adds one to one key of every level, so a user touches at most C keys' rounds per level and
    the level histograms compose. Under ``zcdp`` the levels split the total rho by
    ``level_shares`` (each level then splits its part between key selection and perturbation),
    the thresholding term counts the user's C keys of every level, ``(e^eps + 1) * levels * C *
    beta``, and one CKS conversion gives the total. Under ``basic`` each level is the paper's
    split query at ``(share * eps, share * delta)`` and the levels' epsilons and deltas add.

    Fields that describe noise (sigmas, thresholds, beta, per-part rho/eps/delta, expected
    stddev) are the level's; fields that describe the guarantee (``epsilon``, ``delta``,
    ``rho_total``, ``delta_beta``, ``delta_sampler``, ``delta_conversion``, ``*_spent``) are the
    whole query's, identical in every level's plan.
    """
    _check(budget)
    eps, delta, C = budget.epsilon, budget.delta, budget.contribution_bound
    try:
        counter = counter_calibration(budget.counter)
    except ValueError as err:
        raise BudgetError("counter", str(err).split(": ", 1)[1]) from None
    # h: squared sensitivity of the counter's read values to one increment (the binary tree: one
    # complete node per level, floor(lg T) + 1); the samplers' term counts the values touched
    T = budget.triggers
    h = counter.sensitivity_sq(T)
    draws = counter.draws(T)  # noise draws of one stream that a user's increment reaches
    share = _selection_share(budget)
    public = budget.public_keys
    levels = budget.hierarchy_depth
    shares = _level_shares(budget)
    kinds = columns_of(budget)
    ncols = len(kinds)
    parts = []  # per level: (rho_k, rho_m, eps_k, delta_k, eps_m, delta_m, beta)
    if eps >= epsilon_ceiling(budget, draws):  # before e^eps, which overflows above 709
        raise _no_delta_left(budget, draws)

    if budget.composition in ("zcdp", "gdp"):
        gdp = budget.composition == "gdp"
        beta = budget.beta
        if public:
            beta = 0.0  # no thresholding: every declared key is released, whatever its count
        elif beta is None:
            beta = DEFAULT_BETA_DELTA_SHARE * delta / ((math.exp(eps) + 1.0) * C * levels)
        delta_beta = (math.exp(eps) + 1.0) * levels * C * beta
        # a user's records reach one selection tree (none with public keys) and one perturbation
        # tree per column, per key round and level: the samplers' total-variation terms count all of them
        trees = ncols if public else 1 + ncols
        delta_sampler = (math.exp(eps) + 1.0) * levels * trees * C * draws * SAMPLER_TV_BOUND
        delta_conv = delta - delta_beta - delta_sampler
        if delta_conv <= 0:
            raise _no_delta_left(budget, draws)  # rounding at the ceiling
        # GDP: mu^2 of the Gaussian parts adds exactly; rho = mu^2 / 2 is the same quantity in
        # zCDP units, so the split and the sigmas below are shared by both compositions
        rho = gdp_mu(eps, delta_conv * (1.0 - GDP_DISCRETE_MARGIN)) ** 2 / 2.0 if gdp else cks_rho(eps, delta_conv)

        def part_epsilon(rho_part: float, delta_part: float) -> float:
            # GDP: the continuous curve at (1 - margin) delta; the discrete one stays within delta
            if gdp:
                return gdp_epsilon(math.sqrt(2.0 * rho_part), delta_part * (1.0 - GDP_DISCRETE_MARGIN))
            return cks_epsilon(rho_part, delta_part)

        for s in shares:
            rho_k, rho_m = share * s * rho, (1.0 - share) * s * rho
            parts.append((rho_k, rho_m,
                          part_epsilon(rho_k, share * s * delta_conv) if rho_k else 0.0, share * s * delta_conv + delta_beta / levels,
                          part_epsilon(rho_m, (1.0 - share) * s * delta_conv), (1.0 - share) * s * delta_conv, beta))
        eps_spent = part_epsilon(rho, delta_conv)
        delta_gauss = gdp_delta(math.sqrt(2.0 * rho), eps) / (1.0 - GDP_DISCRETE_MARGIN) if gdp else cks_delta(rho, eps)
        delta_spent = delta_gauss + delta_beta + delta_sampler
    else:
        rho = delta_beta = delta_sampler = delta_conv = eps_spent = delta_spent = 0.0
        for s in shares:
            eps_l, delta_l = s * eps, s * delta
            if public:  # the paper's split without its key selection: perturbation alone, at (eps, delta)
                rho_m = cks_rho(eps_l, delta_l - C * draws * SAMPLER_TV_BOUND * (math.exp(eps_l) + 1.0))
                parts.append((0.0, rho_m, 0.0, 0.0, eps_l, delta_l, 0.0))
                rho += rho_m
                delta_sampler += (math.exp(eps_l) + 1.0) * C * draws * SAMPLER_TV_BOUND
                delta_conv += delta_l - (math.exp(eps_l) + 1.0) * C * draws * SAMPLER_TV_BOUND
                eps_spent += eps_l
                delta_spent += cks_delta(rho_m, eps_l) + (math.exp(eps_l) + 1.0) * C * draws * SAMPLER_TV_BOUND
                continue
            eps_k, eps_m = share * eps_l, (1.0 - share) * eps_l
            delta_k, delta_m = 2.0 * delta_l / 3.0, delta_l / 3.0
            beta = budget.beta
            if beta is None:
                beta = 0.5 * delta_k / ((math.exp(eps_k) + 1.0) * C)
            beta_term = (math.exp(eps_k) + 1.0) * C * beta
            sampler_k = (math.exp(eps_k) + 1.0) * C * draws * SAMPLER_TV_BOUND
            sampler_m = (math.exp(eps_m) + 1.0) * C * draws * SAMPLER_TV_BOUND
            conv_k = delta_k - beta_term - sampler_k
            if conv_k <= 0:
                raise _no_delta_left(budget, draws)  # rounding at the ceiling
            rho_k = cks_rho(eps_k, conv_k)
            rho_m = cks_rho(eps_m, delta_m - sampler_m)
            parts.append((rho_k, rho_m, eps_k, delta_k, eps_m, delta_m, beta))
            rho += rho_k + rho_m
            delta_beta += beta_term
            delta_sampler += sampler_k + sampler_m
            delta_conv += conv_k + delta_m - sampler_m
            eps_spent += eps_k + eps_m
            delta_spent += cks_delta(rho_k, eps_k) + beta_term + cks_delta(rho_m, eps_m) + sampler_k + sampler_m

    sigmas = []
    for rho_k, rho_m, *_ in parts:
        ck = budget.per_key_bound or C
        weights = budget.selection_weights
        if public:
            weights = None
        elif weights is not None:
            # a user's j-th key adds w_j to that key's round stream (one stream per key with c_k
            # = 1, the slots distinct): squared sensitivity sum_j w_j^2 per unit of ||c||^2
            squares, l1, touched = sum(x * x for x in weights), sum(weights), sum(1 for x in weights if x)
            sigma_k = (lattice_sigma(2.0 * rho_k, squares, l1, touched, T, counter) if counter.lattice
                       else math.sqrt(squares * h / (2.0 * rho_k)))
        if counter.lattice:
            # one stream per (key, round) fed with unit increments, C of them per user; the
            # rounding slack widens each (dpstream.accountant.counters.slack_sigma)
            if weights is None:
                sigma_k = 0.0 if public else slack_sigma(2.0 * rho_k / C, 1, 1.0, T, counter)
            column_sigmas = [slack_sigma(2.0 * rho_m / ncols, C, C * (budget.clamp if kind == VALUE else 1.0), T, counter,
                                         per_stream=ck * (budget.clamp if kind == VALUE else 1.0))
                             for kind in kinds]
        elif ck < C:
            if weights is None:
                sigma_k = 0.0 if public else math.sqrt(C * h / (2.0 * rho_k))
            # a user adds at most c_k B to a key and C B in all: the squared L2 change over keys,
            # per read level, is at most C c_k B^2 (perturbation_squares)
            column_sigmas = [math.sqrt(perturbation_squares(C, ck)) * (budget.clamp if kind == VALUE else 1.0)
                             * math.sqrt(h / (2.0 * rho_m / ncols)) for kind in kinds]
        else:
            sigma_k = 0.0 if public else math.sqrt(C * h / (2.0 * rho_k))
            # the columns' trees share the level's perturbation rho equally (zCDP composition); a
            # column's per-tree sensitivity is C times its per-record bound (1, or L for values)
            column_sigmas = [C * (budget.clamp if kind == VALUE else 1.0) * math.sqrt(h / (2.0 * rho_m / ncols)) for kind in kinds]
        if sigma_k > MAX_SAMPLER_SIGMA:
            raise BudgetError("contribution_bound", f"key-selection noise sigma {sigma_k:.4g} is beyond the sampler's range")
        sigmas.append((sigma_k, column_sigmas))
    # one value grid for all levels: every record goes to every level with the same grid value
    value_sigmas = [sig for _, cols in sigmas for kind, sig in zip(kinds, cols) if kind == VALUE]
    resolution = _choose_resolution(budget, min(value_sigmas) if value_sigmas else 1.0)
    conversion = PrivacyPlan.conversion
    if budget.composition == "gdp":
        conversion = GDP_CONVERSION
        if not counter.lattice:
            # the exact discrete Gaussian curve of the worst-case user (docs/privacy.md, "Accounting")
            widened = _calibrate_discrete(budget, h, sigmas, parts, resolution, rho, delta_conv, delta_beta + delta_sampler)
            if widened is not None:
                sigmas, parts, rho, eps_spent, delta_spent = widened
                conversion = EXACT_DISCRETE_CONVERSION
    plans = []
    for level, ((rho_k, rho_m, eps_k, delta_k, eps_m, delta_m, beta), (sigma_k, column_sigmas), s) in enumerate(
            zip(parts, sigmas, shares), 1):
        columns = []
        for kind, sigma in zip(kinds, column_sigmas):
            step = resolution if kind == VALUE else 1.0
            if sigma / step > MAX_SAMPLER_SIGMA:
                field_name = "contribution_bound" if kind == ONE else "resolution"
                raise BudgetError(field_name, f"perturbation noise is {sigma / step:.4g} grid steps, beyond the sampler's range")
            columns.append((kind, sigma, sigma / step, step))
        _, sigma_m, sigma_m_units, _ = columns[0]
        z = 0.0 if public else tail_multiplier(budget.triggers, beta)
        # a lattice counter's prefix also carries a bounded rounding part: bias_units lattice
        # steps, each at most 2 sigma / LATTICE_TARGET_SIGMA (dpstream.accountant.counters.lattice_scale)
        bias_step = 2.0 * sigma_k / LATTICE_TARGET_SIGMA if counter.lattice else 0.0
        plans.append(PrivacyPlan(
            epsilon=eps,
            delta=delta,
            composition=budget.composition,
            triggers=budget.triggers,
            tree_height=h if counter is BINARY_TREE else 0,
            contribution_bound=C,
            clamp=float(budget.clamp),
            aggregate=budget.aggregate,
            resolution=resolution,
            key_threshold=float(budget.key_threshold),
            beta=beta,
            delta_beta=delta_beta,
            delta_sampler=delta_sampler,
            delta_conversion=delta_conv,
            rho_total=rho,
            rho_key_selection=rho_k,
            rho_key_selection_per_tree=rho_k / C,
            rho_perturbation=rho_m,
            sigma_key_selection=sigma_k,
            sigma_perturbation=sigma_m,
            sigma_perturbation_units=sigma_m_units,
            epsilon_key_selection=eps_k,
            delta_key_selection=delta_k,
            epsilon_perturbation=eps_m,
            delta_perturbation=delta_m,
            epsilon_spent=eps_spent,
            delta_spent=delta_spent,
            tail_multiplier=z,
            thresholds=tuple(z * sigma_k * math.sqrt(counter.step_variance(r, T)) + (counter.bias_units(r, T) * bias_step if bias_step else 0.0)
                             for r in range(1, T + 1)),
            expected_stddev=sigma_m * math.sqrt(counter.step_variance(budget.triggers, budget.triggers)),
            level=level,
            levels=levels,
            level_share=s,
            columns=tuple(columns) if ncols > 1 else None,
            counter=None if counter is BINARY_TREE else counter.name,
            counter_sensitivity_sq=None if counter is BINARY_TREE else h,
            per_key_bound=budget.per_key_bound,
            perturbation_steps="release" if budget.perturbation_steps == "release" else None,
            selection_weights=tuple(budget.selection_weights) if budget.selection_weights is not None else None,
            public_keys=True if public else None,
            conversion=conversion,
        ))
    if budget.composition == "gdp" and not counter.lattice:
        # never return an unverified plan: the curve at the plans' own fields
        found = discrete_gaussian_delta([p for plan in plans for part in worst_case_parts(plan) for p in part], eps)
        if not found <= delta_conv:
            raise ArithmeticError(f"the discrete Gaussian calibration failed its check: delta {found!r} > {delta_conv!r}")
    return tuple(plans)


# ---------------------------------------------------------------------------------------------
# Composition over a horizon, and what a plan releases (`dpstream plan`: docs/plan.md)
# ---------------------------------------------------------------------------------------------

DAY_MS = 86_400_000
#: the horizons `dpstream plan` composes over: one UTC day and 30 consecutive UTC days
HORIZONS: tuple[tuple[str, int], ...] = (("1d", DAY_MS), ("30d", 30 * DAY_MS))
BASIC_COMPOSITION = ("basic (sequential) composition: the epsilons and the deltas of every window a user's data can "
                     "reach add up (docs/privacy.md, \"The guarantee and the neighbour relation\" and \"Windows and "
                     "budget\"); an upper bound: a tighter accountant would give less, never more")


@dataclass(frozen=True)
class Spend:
    """What one query spends, all public: its (epsilon, delta) per window as the budget ledger
    charges them (the plan's ``epsilon_spent``, ``delta_spent``: dpstream.processor.engine.budget),
    the input topic whose records it reads, and its window. ``window_ms`` None: a dynamic query,
    charged once for its whole life (docs/privacy.md, "Dynamic counts")."""

    name: str
    topic: str
    epsilon: float
    delta: float
    window_ms: Optional[int]
    unit: str = "user"  # the query's own privacy unit (a dynamic query's: one update, or a unit_field value)
    principal: Optional[str] = None  # the budget ledger's principal for the query, when there is a ledger


def windows_in(horizon_ms: int, window_ms: Optional[int], start_step_ms: int = DAY_MS) -> int:
    """The most windows a span of ``horizon_ms`` can reach when it starts at a multiple of
    ``start_step_ms`` (a UTC midnight by default; 1 for any span). Windows are epoch-aligned
    (``start = t - t mod window``), so with ``g = gcd(start_step, window)`` a span starts at most
    ``window - g`` into a window, and reaches ``floor((window - g + horizon - 1) / window) + 1``
    windows: 24 one-hour windows in a UTC day, 25 in some 24 hours. ``window_ms`` None (a
    dynamic query, one guarantee for its whole life): 1."""
    if window_ms is None:
        return 1
    g = math.gcd(int(start_step_ms), int(window_ms))
    return (window_ms - g + horizon_ms - 1) // window_ms + 1


def windows_charged(period_ms: int, window_ms: Optional[int]) -> int:
    """The most windows the budget ledger charges in one refresh period: one charge per window,
    at the window's start, so at most ``ceil(period / window)`` starts fall in a period; a dynamic
    query is charged once (docs/privacy.md, "Windows and budget")."""
    if window_ms is None:
        return 1
    return -(-period_ms // window_ms)


def compose_horizons(spends: list[Spend], horizons=HORIZONS) -> list[dict]:
    """Per input topic (one topic, one set of users: the privacy unit), the planned total over
    each horizon by basic composition: each query's per-window (epsilon, delta) times the windows
    a UTC-aligned horizon reaches (:func:`windows_in`), summed over the topic's queries. Also the
    total for any span of that length (``*_any_span``: one more window of a query whose windows
    a span can straddle) and the sum of one window of every query (``per_window``)."""
    topics: dict[str, list[Spend]] = {}
    for s in spends:
        topics.setdefault(s.topic, []).append(s)
    out = []
    for topic, group in topics.items():
        queries = []
        for s in group:
            windows = {name: windows_in(ms, s.window_ms) for name, ms in horizons}
            any_span = {name: windows_in(ms, s.window_ms, 1) for name, ms in horizons}
            queries.append({
                "name": s.name, "unit": s.unit, "window_ms": s.window_ms, "principal": s.principal,
                "epsilon_per_window": s.epsilon, "delta_per_window": s.delta,
                "windows": windows, "windows_any_span": any_span,
                "epsilon": {name: n * s.epsilon for name, n in windows.items()},
                "delta": {name: n * s.delta for name, n in windows.items()},
            })
        out.append({
            "topic": topic,
            "queries": queries,
            "per_window": {"epsilon": sum(s.epsilon for s in group), "delta": sum(s.delta for s in group)},
            "epsilon": {name: sum(q["epsilon"][name] for q in queries) for name, _ in horizons},
            "delta": {name: sum(q["delta"][name] for q in queries) for name, _ in horizons},
            "epsilon_any_span": {name: sum(q["windows_any_span"][name] * q["epsilon_per_window"] for q in queries)
                                 for name, _ in horizons},
            "delta_any_span": {name: sum(q["windows_any_span"][name] * q["delta_per_window"] for q in queries)
                               for name, _ in horizons},
        })
    return out


def budget_outlook(spends: list[Spend], principal: str, max_epsilon: float, max_delta: float,
                   refresh_ms: Optional[int]) -> dict:
    """A ledger principal's cap next to what its queries are planned to spend: per refresh period
    (:func:`windows_charged`; basic composition, as the ledger adds), or, for a budget that never
    refreshes, per day and the days until the cap is reached."""
    mine = [s for s in spends if s.principal == principal]
    out = {"principal": principal, "max_epsilon": max_epsilon, "max_delta": max_delta, "refresh_ms": refresh_ms,
           "queries": [s.name for s in mine]}
    if refresh_ms is not None:
        eps = sum(windows_charged(refresh_ms, s.window_ms) * s.epsilon for s in mine)
        delta = sum(windows_charged(refresh_ms, s.window_ms) * s.delta for s in mine)
        out.update(planned_epsilon_per_period=eps, planned_delta_per_period=delta,
                   exceeds=eps > max_epsilon * (1 + 1e-12) or delta > max_delta * (1 + 1e-12))
    else:
        # windows charged per day on average (a dynamic query's one charge is up front)
        per_day_eps = sum(DAY_MS / s.window_ms * s.epsilon for s in mine if s.window_ms is not None)
        per_day_delta = sum(DAY_MS / s.window_ms * s.delta for s in mine if s.window_ms is not None)
        once_eps = sum(s.epsilon for s in mine if s.window_ms is None)
        once_delta = sum(s.delta for s in mine if s.window_ms is None)
        days = [((limit - once) / rate) for limit, once, rate in ((max_epsilon, once_eps, per_day_eps), (max_delta, once_delta, per_day_delta))
                if rate > 0]
        out.update(planned_epsilon_per_day=per_day_eps, planned_delta_per_day=per_day_delta,
                   days_until_exhausted=max(0.0, min(days)) if days else None)
    return out


def release_outlook(plans, key_users: float) -> dict:
    """What a query can release, from its plans' public numbers only (docs/plan.md, "When a
    setting releases nothing useful"), for a stated plausible scale of ``key_users`` distinct
    users per key and window:

    * ``min_users_to_release``: the fewest distinct users (weighted units with selection weights)
      a key needs in one round to be released at all, ``mu + min_i tau_i`` over the levels (a
      threshold of the most favourable trigger). Above ``key_users``: **no key of that scale is
      ever released**.
    * ``relative_stddev``: the expected noise stddev of a release at the last trigger over the
      value of a key whose ``key_users`` users add one full record each (``key_users`` for a
      count, ``key_users * L`` for a sum). Above 1: the noise is larger than such a key's value.
    """
    first = plans[0]
    bar = min(p.key_threshold + min(p.thresholds) for p in plans)
    per_record = first.clamp if first.aggregate == "sum" or (first.columns and first.columns[0][0] == VALUE) else 1.0
    stddev = max(p.expected_stddev for p in plans)
    return {
        "key_users": key_users,
        "public_keys": bool(first.public_keys),  # every declared key released at every trigger: no bar
        "tau_1": first.thresholds[0],
        "min_users_to_release": bar,
        "expected_stddev": stddev,
        "relative_stddev": stddev / (key_users * per_record),
        "releases_nothing": bar > key_users,
        "noise_dominates": stddev > key_users * per_record,
    }
