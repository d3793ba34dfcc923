#!/usr/bin/env bash
# The trainer's tool-call format under this group's settings, printed: TOOL_FORMAT when set, else hermes
# with the code interpreter (USE_CODE_EXECUTOR: Search-R1's tags call the search tool alone), else
# search_r1. train.sh trains with it, and the data-server's QA prompts follow it (--qa-instruction tools
# for hermes), so that the prompts teach the calls the trainer parses. Exits 2 on a flag that is not one.
set -uo pipefail
use_code_executor=$(bash "$(dirname "$0")/flag.sh" --print USE_CODE_EXECUTOR) || exit 2
if [ -n "${TOOL_FORMAT:-}" ]; then
  echo "$TOOL_FORMAT"
elif [ "$use_code_executor" = true ]; then
  echo hermes
else
  echo search_r1
fi
