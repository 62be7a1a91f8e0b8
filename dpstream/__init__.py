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


def plan(config, key_users: float = 10_000, max_daily_epsilon: float = 10.0, total_delta: float | None = None) -> dict:
    """What ``dpstream plan --config FILE --json`` prints, as a dict: each query's calibration,
    ``totals`` (privacy loss per input topic over a day and 30 days: basic, zcdp, pld), ``budget``, ``usefulness``
    and ``warnings`` (docs/plan.md). ``config``: a YAML path, a dict of its content, or a loaded
    config. Needs no noise secret."""
    from dpstream.processor.planning import plan_document

    return plan_document(config, key_users=key_users, max_daily_epsilon=max_daily_epsilon, total_delta=total_delta)


def preview(config, sample) -> dict:
    """What ``dpstream plan --sample EVENTS.jsonl --json`` adds under ``preview``: the config's
    queries run over ``sample`` with a throwaway secret, publishing nothing; keys released per
    trigger, error by key frequency, records dropped by C and a suggested C (docs/plan.md)."""
    from dpstream.processor.preview import preview as run_preview

    return run_preview(config, sample)


def replay(config, events, *, noise_key_file=None, noise_label=None, start=None, until=None, state_dir=None) -> list[dict]:
    """Run ``config``'s queries over ``events`` with the embedded store, as ``dpstream replay``
    does (docs/user-guide.md), and return the releases (dicts, in output order).

    ``events``: a JSONL file (optionally .gz), or an iterable of event dicts. The noise secret
    comes from ``noise_key_file``, else ``$DPSTREAM_NOISE_KEY_FILE``, else ``$DPSTREAM_NOISE_KEY``:
    never from code. ``noise_label``: reuse a run's noise on purpose (default: a random label per
    new state directory). ``start``/``until``: the clock's public start and end (epoch ms or
    ISO-8601). ``state_dir``: keep the state to resume (default: a temporary one)."""
    import io
    import json
    import tempfile

    from dpstream.processor.adapters.replay import ReplayRunner
    from dpstream.processor.config import parse_time_ms
    from dpstream.processor.mechanisms.noise import load_noise_secret
    from dpstream.processor.planning import as_config

    cfg = as_config(config)
    secret = load_noise_secret(noise_key_file)
    with tempfile.TemporaryDirectory(prefix="dpstream-api-") as tmp:
        path = events
        if not isinstance(events, (str, _os.PathLike)):
            path = _os.path.join(tmp, "events.jsonl")
            with open(path, "w") as fh:
                for event in events:
                    fh.write(json.dumps(event) + "\n")
        runner = ReplayRunner(cfg, secret, state_dir, noise_label=noise_label,
                              start_ms=parse_time_ms(start) if start is not None else None)
        out = io.StringIO()
        try:
            runner.run(str(path), out, until_ms=parse_time_ms(until) if until is not None else None)
        finally:
            runner.close()
    return [json.loads(line) for line in out.getvalue().splitlines()]
