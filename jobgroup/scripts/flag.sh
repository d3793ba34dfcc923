#!/usr/bin/env bash
# Read an on/off environment variable the way every launcher of this project does.
#
#   flag.sh NAME           exit 0 when $NAME is true, 1 when false or unset, 2 (with a message) otherwise
#   flag.sh --print NAME   print true or false and exit 0; exit 2 (with a message) otherwise
#
# true: true, 1, yes, on; false: false, 0, no, off, empty or unset (case-insensitive, spaces ignored).
# jobgroup/flags.py is the same rule in Python (python -m jobgroup.local).
set -uo pipefail
print=0
[ "${1:-}" = "--print" ] && { print=1; shift; }
name=${1:?usage: flag.sh [--print] NAME}
value=${!name:-}
word=$(printf '%s' "$value" | tr -d '[:space:]' | tr '[:upper:]' '[:lower:]')
case $word in
  true|1|yes|on) answer=true ;;
  false|0|no|off|'') answer=false ;;
  *) echo "error: $name=$value is not a flag: use true/false, 1/0 or yes/no" >&2; exit 2 ;;
esac
if [ $print = 1 ]; then echo "$answer"; exit 0; fi
[ $answer = true ]
