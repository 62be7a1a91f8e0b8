"""dpstream: continually updated, user-level differentially private histograms from Kafka streams.

One top-level package. The design card's folders are its subpackages (docs/architecture.md):
``dpstream.accountant`` (calibration, the privacy report, the budget ledger), ``dpstream.state``
(the only door to RocksDB), ``dpstream.topics`` (records, decoders, Kafka topics) and
``dpstream.processor`` (mechanisms, the engine, the Faust adapter, the CLI).
"""
import os as _os

__version__ = "0.2.0"

# In a checkout the four folders sit beside this one (the wheel copies them inside it): map them
# under the package so that ``dpstream.processor`` is ``<checkout>/processor``.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "processor")) \
        and _os.path.isfile(_os.path.join(_root, "processor", "__init__.py")):
    __path__.append(_root)  # noqa: F821 (the package's own __path__)


def plan(config, key_users: float = 10_000, max_daily_epsilon: float = 10.0) -> dict:
    """What ``dpstream plan --config FILE --json`` prints, as a dict: each query's calibration,
    ``totals`` (privacy loss per input topic over a day and 30 days), ``budget``, ``usefulness``
    and ``warnings`` (docs/plan.md). ``config``: a YAML path, a dict of its content, or a loaded
    config. Needs no noise secret."""
    from dpstream.processor.planning import plan_document

    return plan_document(config, key_users=key_users, max_daily_epsilon=max_daily_epsilon)


def preview(config, sample) -> dict:
    """What ``dpstream plan --sample EVENTS.jsonl --json`` adds under ``preview``: the config's
    queries run over ``sample`` with a throwaway secret, publishing nothing; keys released per
    trigger, error by key frequency, records dropped by C and a suggested C (docs/plan.md)."""
    from dpstream.processor.preview import preview as run_preview

    return run_preview(config, sample)
