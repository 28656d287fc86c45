#!/usr/bin/env bash
# Runs tests/deploy/deploy_test.py under Debian's /usr/bin/python3 (it has python3-yaml) from
# the runfiles root, where deploy/, setup.sh, docs/DEPLOY.md and the built binaries sit.
set -euo pipefail
cd "${TEST_SRCDIR:-$PWD}/${TEST_WORKSPACE:-moed}" 2>/dev/null || true
exec /usr/bin/python3 tests/deploy/deploy_test.py "$@"
