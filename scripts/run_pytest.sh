#!/usr/bin/env bash
# Run the test suite; pytest's exit code 5 (no tests collected) is a failure here, said plainly.
# The 25 slowest tests are listed at the end: where the suite's time goes, run after run.
set -uo pipefail
.venv/bin/python -m pytest --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests" >&2
fi
exit "$rc"
