# Sourced by the scripts/gpu_*.sh runners (not run by itself): the shared start of a run on
# the lent GPU machine. Goes to the checkout's root, makes OUT_DIR (the first argument,
# else $OUT, else ./out), picks PY, installs the wheels carried in .whl/ (lmdb, pydantic,
# platformdirs: the machine lacks them) into /tmp/site when lmdb is missing, maps the
# checkout to kvtier, kvtier.engine, kvtier.kernels and kvtier.cli (tools/bare_checkout.py:
# no pip install needed), and defines KV (the kvtier command) and `stage NAME` (true when
# NAME is in $STAGES; set STAGES before sourcing).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT_DIR=${1:-${OUT:-out}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
PY=${PY:-$(command -v python3 || command -v python)}
WHL=.whl; [ -d "$WHL" ] || WHL=../../.whl  # a copy of the tree under .gpu/<name>/
if ! $PY -c "import lmdb" 2>/dev/null && ls "$WHL"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHL"/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY tools/bare_checkout.py > /dev/null
KV="$PY -m kvtier.cli.main"
stage() { case " $STAGES " in *" $1 "*) return 0;; *) return 1;; esac; }
