#!/usr/bin/env bash
# Run the test suite; pytest's exit code 5 (no tests collected) is a failure here, said plainly.
set -uo pipefail
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests" >&2
fi
exit "$rc"
