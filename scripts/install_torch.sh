#!/usr/bin/env bash
# Installs torch (the test extra's largest download) before the rest of the test extra, falling
# back to earlier releases when the newest one cannot be downloaded.
# Usage: scripts/install_torch.sh PYTHON
# Why: a CI run once failed because one file, torch-2.14.1's 555 MB wheel, broke off at the same
# byte (459.3 MB) on every resume and every fresh attempt, while the network itself worked. An
# earlier release is a different file; the tests need no particular torch release.
set -u
python=$1
here=$(dirname "$0")
"$python" -c "import torch" 2>/dev/null && exit 0
for spec in torch 'torch==2.14.0' 'torch==2.13.0'; do
  PIP_INSTALL_ATTEMPTS=2 "$here/pip_install.sh" "$python" -q "$spec" && exit 0
  echo "could not install $spec; trying an earlier release" >&2
done
echo "error: no torch release could be installed (network?)" >&2
exit 1
