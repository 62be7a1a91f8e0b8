#!/usr/bin/env bash
# Create ./.venv and install dpstream with its pinned dependencies (and test extras).
# Every transitive version is fixed by constraints.txt. Re-installs only when pyproject.toml or
# constraints.txt changed since the last install. Safe to run repeatedly.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "dpstream needs Python >= 3.11 (found: $("$python" --version 2>&1))" >&2
  exit 1
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating $venv" >&2
  "$python" -m venv "$venv"
fi
stamp="$venv/.dpstream-installed"
want="$(cat "$root/pyproject.toml" "$root/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing pinned dependencies into $venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$root/constraints.txt" -e "$root[test,bench]"
  echo "$want" > "$stamp"
fi
