#!/usr/bin/env bash
# Runs `PYTHON -m pip install ARGS...`, retrying the whole install when the network fails.
# Usage: scripts/pip_install.sh PYTHON ARGS...
# pip resumes an interrupted download itself (--resume-retries), but a connection that stays
# broken exhausts those resumes at the same byte; a fresh attempt after a pause opens a new one.
# Wheels downloaded in full by an earlier attempt come from pip's cache, not the network again.
set -u
python=$1; shift
attempts=${PIP_INSTALL_ATTEMPTS:-4}
pause=15
resume=()  # --resume-retries exists from pip 25.1 (the venv's first pip may be older)
"$python" -m pip install --help 2>/dev/null | grep -q -- --resume-retries && resume=(--resume-retries 20)
for attempt in $(seq 1 "$attempts"); do
  "$python" -m pip install --disable-pip-version-check --retries 10 \
    "${resume[@]}" "$@" && exit 0
  [ "$attempt" -lt "$attempts" ] || break
  echo "pip install failed (attempt $attempt of $attempts); trying again in ${pause}s" >&2
  sleep "$pause"
  pause=$((pause * 2))
done
echo "error: pip install $* failed $attempts times (network?)" >&2
exit 1
