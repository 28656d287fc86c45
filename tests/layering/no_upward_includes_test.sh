#!/bin/bash
# Fails when a file of a lower floor includes a header of a higher one (ARCHITECTURE.md,
# "Folders"): client/, transport/ and base/ never include server/; transport/ never client/;
# base/ neither transport/ nor client/.
set -u
fail=0
check() {  # check FOLDER FORBIDDEN_PREFIX...
  local folder=$1
  shift
  local files=("${folder}"/*.h "${folder}"/*.cc)
  [ -e "${files[0]}" ] || { echo "no sources under ${folder} (runfiles?)"; fail=1; return; }
  for prefix in "$@"; do
    if grep -nE "^[[:space:]]*#[[:space:]]*include[[:space:]]*\"${prefix}/" "${files[@]}"; then
      echo "FAIL: ${folder}/ includes ${prefix}/ (a higher floor)"
      fail=1
    fi
  done
}
check client server
check transport server client
check base server client transport
[ "${fail}" -eq 0 ] && echo "PASS: no upward includes"
exit "${fail}"
