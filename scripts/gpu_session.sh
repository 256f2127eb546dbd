#!/usr/bin/env bash
# The GPU checks and figures of docs/benchmarks.md and docs/results.md, in a few long commands.
#
#   bash scripts/gpu_session.sh prepare            # here: copy the corpora and wheels into .gpu/
#   bash scripts/gpu_session.sh check bench        # on the GPU machine (one command)
#   bash scripts/gpu_session.sh multi30k           # on the GPU machine; again to resume
#   bash scripts/gpu_session.sh tatoeba            # on the GPU machine; again to resume
#
# Stages:
#   prepare   copies ../shared/data's Multi30k and Tatoeba (DATA=... for another copy) and the wheels
#             the GPU image lacks (datasets and what it needs) into .gpu/, which git ignores. The
#             GPU machine sees only the repository: carry `.gpu` in the call.
#   check     the GPU tests (tests/test_gpu.py) and then the whole suite on the machine's torch.
#   bench     scripts/bench_train.py, preset base, on the demo corpus and on Multi30k, eager and
#             with torch.compile.
#   multi30k  trains configs/multi30k-en-de.yaml into runs/gpu-multi30k-en-de.
#   tatoeba   trains configs/tatoeba-en-it.yaml into runs/gpu-tatoeba-en-it.
# A training stage stops with SIGTERM (a checkpoint, exit 143) before BUDGET seconds (default 540,
# for a 10-minute command) have passed since the command started, and resumes from its newest
# checkpoint when run again on the same machine. Each stage writes STAGE.log and, for training,
# STAGE.tar.gz (the run's logs, scores and TensorBoard events; no checkpoints) into OUT (default
# gpu-out/): at most 8 files in all.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
BUDGET=${BUDGET:-540}
export PYTHONUNBUFFERED=1
# The GPU image's interpreter; here, whatever python3 the caller's environment gives.
PY=${PYTHON:-python3}

log() { echo "== $(date -u +%H:%M:%S) $*"; }

prepare() {
    local data=${DATA:-../shared/data}
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    mkdir -p .gpu/data .gpu/wheels
    for corpus in multi30k_en_de tatoeba_anki_en_it; do
        [ -d "$data/$corpus" ] || { echo "gpu_session: no corpus at $data/$corpus (set DATA)" >&2; return 2; }
        rm -rf ".gpu/data/$corpus" && cp -r "$data/$corpus" .gpu/data/
    done
    # The GPU image has torch, tokenizers, transformers, pyarrow, pandas, xxhash and fsspec, but not
    # datasets nor two of its needs (docs/benchmarks.md, "Taking the GPU figures").
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/wheels \
        datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 || return 1
    du -sh .gpu
}

setup() {  # on the GPU machine: the carried wheels where `datasets` is missing, then what it has
    export PYTHONPATH=$PWD
    if ! "$PY" -c 'import datasets' 2>/dev/null && compgen -G ".gpu/wheels/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .gpu/wheels/*.whl || return 1
        export PYTHONPATH=/tmp/site:$PWD
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    "$PY" -c 'import torch, tokenizers, datasets, sacrebleu; print("torch", torch.__version__, "cuda",
torch.cuda.is_available(), "tokenizers", tokenizers.__version__, "datasets", datasets.__version__,
"sacrebleu", sacrebleu.__version__)'
}

check() {  # fails if either run fails
    local rc=0 workers=()
    log "GPU tests"
    "$PY" -m pytest tests/test_gpu.py -rs -s -p no:cacheprovider || rc=1
    log "the rest of the suite on this machine's torch"
    "$PY" -c 'import xdist' 2>/dev/null && workers=(-n 8)
    "$PY" -m pytest "${workers[@]}" -p no:cacheprovider --ignore=tests/test_gpu.py || rc=1
    return $rc
}

bench() {  # fails if any run fails; each prints its JSON line last
    local rc=0 multi30k=.gpu/data/multi30k_en_de
    log "bench: base, demo corpus"
    "$PY" scripts/bench_train.py --device cuda --preset base || rc=1
    log "bench: base, Multi30k"
    "$PY" scripts/bench_train.py --device cuda --preset base --data $multi30k || rc=1
    log "bench: base, Multi30k, compiled"
    "$PY" scripts/bench_train.py --device cuda --preset base --data $multi30k --set train.compile=true --repeats 3 || rc=1
    return $rc
}

train_stage() {  # name config data-path
    local name=$1 config=$2 data=$3 run=runs/gpu-$1 resume=() code
    [ -d "$run/checkpoints" ] && compgen -G "$run/checkpoints/step_*.pt" > /dev/null && resume=(--resume)
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 60 ]; then
        log "$name: only ${left}s of BUDGET left; run the stage in a command of its own"
        return 0
    fi
    log "$name: training for at most ${left}s ${resume[*]}"
    timeout --preserve-status -s TERM --kill-after=60 "$left" "$PY" -m transformer_mt train --config "$config" \
        --set "data.path=$PWD/$data" --run-dir "$run" --no-progress "${resume[@]}"
    code=$?
    case $code in
        0) log "$name: finished" ;;
        143) log "$name: stopped at the time limit with a checkpoint: run the stage again to resume" ;;
        *) log "$name: tmt exited with $code" ;;
    esac
    tar -czf "$OUT/$name.tar.gz" --exclude=checkpoints --exclude=corpus_cache --exclude=token_cache "$run"
    return $code
}

multi30k() { train_stage multi30k-en-de configs/multi30k-en-de.yaml .gpu/data/multi30k_en_de/tok; }
tatoeba() { train_stage tatoeba-en-it configs/tatoeba-en-it.yaml .gpu/data/tatoeba_anki_en_it; }

[ $# -gt 0 ] || { sed -n '2,22p' "$0"; exit 2; }
status=0
if [ "$1" = prepare ]; then
    prepare
    exit $?
fi
for stage in "$@"; do
    case $stage in
        check|bench|multi30k|tatoeba) ;;
        *) echo "gpu_session: unknown stage '$stage' (check, bench, multi30k, tatoeba; prepare runs alone)" >&2
           exit 2 ;;
    esac
done
mkdir -p "$OUT"
setup > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
cat "$OUT/setup.log"
for stage in "$@"; do
    { "$stage" 2>&1 | tee "$OUT/$stage.log"; } || status=1
done
exit $status
