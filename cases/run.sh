#!/usr/bin/env bash
# Run every case script (*.py) of a cases folder from the repo root, each with the copy in
# cases/adapted/ where one exists (see cases/README.md); print "name: last line" of each and a
# final count. Exit 1 if any script's last non-empty line does not start with PASS.
#
#   bash cases/run.sh [FOLDER]     FOLDER defaults to ../shared/cases (from the repo root;
#                                  in a git worktree, from the main checkout too)
#   PYTHON=... (default .venv/bin/python), CASE_TIMEOUT=seconds per script (default 900)
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
folder="${1:-}"
if [ -z "$folder" ]; then
    folder="../shared/cases"
    if [ ! -d "$folder" ]; then  # a worktree elsewhere: the main checkout's ../shared/cases
        common="$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null)"
        [ -n "$common" ] && folder="$(dirname "$common")/../shared/cases"
    fi
fi
[ -d "$folder" ] || { echo "run.sh: no cases folder: $folder (pass it: bash cases/run.sh FOLDER)" >&2; exit 2; }
python="${PYTHON:-.venv/bin/python}"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's sources win
shopt -s nullglob
scripts=("$folder"/*.py)
[ ${#scripts[@]} -gt 0 ] || { echo "run.sh: no *.py in $folder" >&2; exit 2; }
orphans=()
for copy in cases/adapted/*.py; do
    [ -e "$folder/$(basename "$copy")" ] || orphans+=("$(basename "$copy" .py)")
done
[ ${#orphans[@]} -eq 0 ] || echo "note: cases/adapted/ copies with no original in $folder: ${orphans[*]}"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
pass=0 total=0
for script in "${scripts[@]}"; do
    base="$(basename "$script")"
    name="${base%.py}"
    run="$script"
    [ -e "cases/adapted/$base" ] && { run="cases/adapted/$base"; name="$name (adapted)"; }
    timeout "${CASE_TIMEOUT:-900}" "$python" "$run" >"$out" 2>&1
    rc=$?
    last="$(grep -v '^[[:space:]]*$' "$out" | tail -n 1)"  # a FAIL may end with stderr's newline
    [ $rc -eq 124 ] && last="TIMEOUT after ${CASE_TIMEOUT:-900} s (last line: $last)"
    echo "$name: $last"
    total=$((total + 1))
    case "$last" in PASS*) pass=$((pass + 1)) ;; esac
done
echo "$pass/$total PASS"
[ "$pass" -eq "$total" ]
