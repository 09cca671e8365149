#!/usr/bin/env bash
# The engine's copy threads on a many-core CPU host: bench/first_touch.py on 2 and 4 processes with the process's
# intra-op threads and the engine's copy threads varied; one JSON per setting into the folder named (default
# bench/results/threads; 13 runs, about 6 minutes on 16 cores). Usage: bash bench/cpu_threads.sh [folder]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/threads}
mkdir -p "$OUT"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CORES=$(nproc)
[ "$CORES" -ge 8 ] || { echo "bench/cpu_threads.sh needs 8 cores or more (this host has $CORES)" >&2; exit 2; }
run() {  # run processes threads copy_threads(or "default")
    local ct=()
    [ "$4" != default ] && ct=(--copy-threads "$4")
    echo "== $1: $3 threads per process, copy threads $4" >&2
    "$PY" bench/first_touch.py --runs "$1" --ways during --repeats 6 --threads "$3" "${ct[@]}" \
        --json "$OUT/$1_t$3_c$4.json" | tail -n 2
}
half=$((CORES / 2)); quarter=$((CORES / 4))
run same-world 2 1 default
for ct in "$CORES" $((CORES - 1)) "$half" default 2; do run same-world 2 "$CORES" "$ct"; done  # oversubscribed
for ct in "$half" $((half - 1)) default 2 1; do run same-world 2 "$half" "$ct"; done  # what the launchers give
for ct in "$quarter" default 1; do run scale-out 4 "$quarter" "$ct"; done
