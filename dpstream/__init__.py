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
