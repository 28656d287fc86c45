#!/bin/sh
echo "coverage is not supported in the offline moed build" >&2
exit 1
