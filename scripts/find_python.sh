#!/usr/bin/env bash
# Prints the path of a Python >= 3.12, preferring 3.12: on PATH first, then under pyenv.
# Exits 1 with a message when there is none.
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
pyenv_versions=$(command -v pyenv >/dev/null 2>&1 && pyenv versions --bare 2>/dev/null | sort -rV)
for name in python3.12 python3.13 python3.14 python3; do
  path=$(command -v "$name" 2>/dev/null) && ok "$path" && { echo "$path"; exit 0; }
  for version in $pyenv_versions; do
    path=$(PYENV_VERSION="$version" pyenv which "$name" 2>/dev/null) && ok "$path" && { echo "$path"; exit 0; }
  done
done
echo "error: jaxlora needs Python >= 3.12 (jax >= 0.11 does); none found on PATH or under pyenv." >&2
echo "       Install one (e.g. 'pyenv install 3.12') or run: make PYTHON=/path/to/python3.12 ..." >&2
exit 1
