"""Sampler tables kept on disk between processes (docs/architecture.md, "Noise tables").

A discrete Gaussian table (dpstream.processor.mechanisms.noise.DiscreteGaussian) depends on its
sigma alone, a public number, but the lattice counters' tables take about a second of CPU each
to build exactly. A worker keeps each table it built in its state directory
(``<state-dir>/noise-tables``, or ``$DPSTREAM_NOISE_TABLE_DIR`` for several processes on one
machine), so a restart loads it in milliseconds.

One file per sigma, ``discrete-gaussian-v1-<sigma as float.hex>.npz``: the cumulative table's
words, its variance and truncated mass, and a SHA-256 over the format name, sigma and every
word. A file that does not check (cut short, another format, another sigma, flipped bits) is
ignored and the table built again and written over it. Files are written under a temporary
name and renamed, so two processes saving one table at once leave either's whole file.

The checksum catches damage, not an adversary: whoever can write the state directory can also
rewrite the budget ledger, so the directory is protected like the state itself
(docs/threat-model.md).
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

import numpy as np

from dpstream.processor.mechanisms.noise import DiscreteGaussian

log = logging.getLogger(__name__)

TABLE_DIR_ENV = "DPSTREAM_NOISE_TABLE_DIR"
#: the tables' directory inside a state directory
TABLE_DIR_NAME = "noise-tables"
FORMAT = "discrete-gaussian-v1"


def table_checksum(sigma: float, hi: np.ndarray, lo: np.ndarray, variance: float, truncation_mass: float) -> str:
    digest = hashlib.sha256()
    digest.update(f"{FORMAT} {float(sigma).hex()} {float(variance).hex()} {float(truncation_mass).hex()} {len(hi)}".encode())
    digest.update(np.ascontiguousarray(hi, dtype="<u8").tobytes())
    digest.update(np.ascontiguousarray(lo, dtype="<u8").tobytes())
    return digest.hexdigest()


class NoiseTableDirectory:
    """A directory of sampler tables (:class:`dpstream.processor.mechanisms.noise.TableKeeper`)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    @classmethod
    def for_state(cls, state_dir: str | Path) -> "NoiseTableDirectory":
        """``$DPSTREAM_NOISE_TABLE_DIR`` if set, else the state directory's ``noise-tables``."""
        return cls(os.environ.get(TABLE_DIR_ENV) or Path(state_dir) / TABLE_DIR_NAME)

    def path(self, sigma: float) -> Path:
        return self.directory / f"{FORMAT}-{float(sigma).hex()}.npz"

    def load(self, sigma: float) -> Optional[DiscreteGaussian]:
        """The kept table of ``sigma``, or None (none kept, or one that does not check)."""
        path = self.path(sigma)
        try:
            with np.load(path, allow_pickle=False) as data:
                hi, lo = data["hi"], data["lo"]
                variance, mass = float(data["variance"]), float(data["truncation_mass"])
                kept_sigma, checksum = float(data["sigma"]), str(data["checksum"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            log.warning("noise table %s cannot be read (%s): building it again", path, type(exc).__name__)
            return None
        if kept_sigma != float(sigma) or checksum != table_checksum(sigma, hi, lo, variance, mass):
            log.warning("noise table %s does not match its checksum: building it again", path)
            return None
        try:
            return DiscreteGaussian.from_words(sigma, hi, lo, variance, mass)
        except (ValueError, AssertionError) as exc:
            log.warning("noise table %s is not a table of sigma %r (%s): building it again", path, sigma, exc)
            return None

    def save(self, table: DiscreteGaussian) -> None:
        """Keep ``table`` (a failure to write is logged, never raised: the table is in memory)."""
        words = table.words()
        written = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=".writing-", suffix=".npz", delete=False) as f:
                written = f.name
                np.savez(f, sigma=np.float64(words["sigma"]), hi=words["hi"], lo=words["lo"],
                         variance=np.float64(words["variance"]), truncation_mass=np.float64(words["truncation_mass"]),
                         checksum=np.str_(table_checksum(**words)))
            os.replace(written, self.path(table.sigma))
        except OSError as exc:
            log.warning("noise table for sigma %r not kept in %s: %s", table.sigma, self.directory, exc)
            if written is not None:
                Path(written).unlink(missing_ok=True)
