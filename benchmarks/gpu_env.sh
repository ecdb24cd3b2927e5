# Sourced by the benchmarks/gpu_*.sh runners (not run by itself): the shared start of a run
# on the lent GPU machine. Goes to the checkout's root, answers --help with the runner's
# leading comment, makes OUT_DIR (the first argument, else $OUT, else ./out), picks PY,
# installs the wheels carried in .whl/ (lmdb, pydantic, platformdirs: the machine lacks
# them) into /tmp/site when lmdb is missing, maps the checkout to kvtier, kvtier.engine,
# kvtier.kernels and kvtier.cli (tools/bare_checkout.py: no pip install needed), and defines
#   KV               the kvtier command
#   stage NAME       true when NAME is in $STAGES (set STAGES before sourcing)
#   limit SECONDS CMD...   runs CMD under `timeout` (SIGABRT: Python's faulthandler writes
#                    every thread's stack to the stage's log first)
#   env_report       the card, driver and library versions
# DRY_RUN=1 runs nothing: each `limit` command is appended to OUT_DIR/commands.txt instead
# (tests/benchmarks checks them on a CPU machine).
case "${1:-}" in
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
               exit 0;;
esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR=${1:-${OUT:-out}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
unset TRITON_INTERPRET
PY=${PY:-$(command -v python3 || command -v python)}
KV="$PY -m kvtier.cli.main"
DRY_RUN=${DRY_RUN:-0}
stage() { case " $STAGES " in *" $1 "*) return 0;; *) return 1;; esac; }
limit() {
    local seconds=$1
    shift
    if [ "$DRY_RUN" = 1 ]; then
        printf '%q ' "$@" >> "$OUT_DIR/commands.txt"
        echo >> "$OUT_DIR/commands.txt"
        return 0
    fi
    timeout -s ABRT "$seconds" "$@"
}
env_report() {
    [ "$DRY_RUN" = 1 ] && return 0
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
}
if [ "$DRY_RUN" != 1 ]; then
    WHL=.whl; [ -d "$WHL" ] || WHL=../../.whl  # a copy of the tree under .gpu/<name>/
    if ! $PY -c "import lmdb" 2>/dev/null && ls "$WHL"/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$WHL"/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    # pytest is pure Python; use a carried copy when the machine has none.
    if ! $PY -c "import pytest" 2>/dev/null && [ -d .whl/pylib ]; then
        export PYTHONPATH="$PWD/.whl/pylib${PYTHONPATH:+:$PYTHONPATH}"
    fi
    $PY tools/bare_checkout.py > /dev/null
fi
