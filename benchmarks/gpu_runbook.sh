#!/usr/bin/env bash
# GPU checks and figures for tmt, in a few short commands: each stage fits a command of at most
# 10 minutes. What the figures mean, and those measured so far: docs/benchmarks/ (index.md for
# this script, training.md, decoding.md, memory.md).
#
# Each figure is one JSON line, `{"figure": ..., "commit": ...}`: `grep -h '^{"figure"' OUT/*.log`
# collects them. COMMIT=<hash> names the version in them where the GPU machine's copy of the tree
# has no .git. From a bare machine:
#   DATA=/path/to/corpora bash benchmarks/gpu_runbook.sh prepare        # beside the corpora: data and wheels into .gpu/
#   COMMIT=abc1234 bash benchmarks/gpu_runbook.sh check decode          # GPU tests; decoding speed against HF Marian
#   COMMIT=abc1234 bash benchmarks/gpu_runbook.sh multi30k bench        # the recipe end to end; training speed, base model
#   COMMIT=abc1234 bash benchmarks/gpu_runbook.sh variants              # what each piece of the training engine buys
#   COMMIT=abc1234 bash benchmarks/gpu_runbook.sh check multi30k-seed2  # GPU tests; the recipe's second seed
# Stages joined by commas run at the same time (the tiny recipe leaves most of the GPU and the
# host's cores idle), so the GPU tests and three seeds of a recipe variant share one command; their
# times are then not those of a machine alone. TAG names the runs apart from the plain recipe's, so
# a warm machine never resumes one as the other:
#   COMMIT=abc1234 BUDGET=420 TAG=levers SETS="train.lr_schedule=cosine train.ema_decay=0.9999" \
#       bash benchmarks/gpu_runbook.sh check,multi30k,multi30k-seed2,multi30k-seed3 decode   # again to resume
# and `scout` trains several variants of the recipe at once, one run each (below).
# The training engine's goals (docs/benchmarks/training.md, "Open on a GPU"), every figure in two commands of at
# most 8 minutes, the engine as it stands measured first (a machine stopped early still leaves figures):
#   COMMIT=abc1234 BUDGET=420 bash benchmarks/gpu_runbook.sh goal-bench multi30k goals
#   COMMIT=abc1234 BUDGET=420 bash benchmarks/gpu_runbook.sh multi30k-seed2,multi30k-seed3 goals compare
# Other stages:
#   SETS="train.max_steps=10000" bash benchmarks/gpu_runbook.sh tatoeba   # again at once to resume
#   bash benchmarks/gpu_runbook.sh profile bench-large                  # host time per update; 64k-token batches
#   bash benchmarks/gpu_runbook.sh bench-more suite                     # if time is left
#
# Stages:
#   prepare        copies Multi30k and Tatoeba from DATA (required; it must hold
#                  multi30k_en_de, tatoeba_anki_en_it and iwslt14_de_en_eval), IWSLT'14's evaluation
#                  sets as a second training corpus (.gpu/data/iwslt14_eval_as_train, for scouting
#                  `data.corpora`) and the wheels the GPU image lacks (datasets and what it needs) into
#                  .gpu/, which git ignores. Copy `.gpu` into the GPU machine's checkout.
#   bench          benchmarks/train.py, preset base, on Multi30k and on the demo corpus, at the
#                  batch size tmt chooses for the device (`train.batch_tokens: auto`): tokens/s, MFU,
#                  `tmt_vs_hf_marian`, peak memory; figures bench-multi30k, bench-demo.
#   variants       the same on Multi30k (3 rounds of 30 steps), one piece changed at a time:
#                  `train.compile=true` (compiled kernels inside the captured step; compile and capture
#                  seconds in its line), 16,384 tokens per batch, `train.cuda_graphs=false` (the eager
#                  step), `pad_to_multiple=1`; a variant that no longer fits before BUDGET prints a
#                  skipped line, one that runs past it is stopped and prints a timed_out line.
#   bench-large    the same on Multi30k at 65,536 tokens per batch (what a bigger batch buys in MFU).
#   goal-bench     the same on Multi30k (3 rounds of 30 steps, attention dropout 0 for tmt and Marian, as
#                  the recipe has it: the variable-length kernel has none): the packed and the padded engine
#                  side by side with HF Marian, MFU and real-token share each; figure goal-bench.
#   goals          one JSON line per goal (benchmarks/goal_figures.py) from the figures in OUT's logs:
#                  MFU, x HF Marian, real-token share (goal-bench), ms per update, seconds to the test
#                  score, captures and capture seconds (multi30k), the mean test BLEU of seeds 1-3;
#                  a figure not measured yet is a line with "met": null and why.
#   profile        cProfile of 1,500 updates of configs/multi30k-en-de.yaml (where the host's time
#                  goes per update), its top functions into the log and the .prof file into OUT.
#   bench-more     on Multi30k: without padding to 8, then with torch.compile (compiling takes minutes).
#   decode         benchmarks/decode.py, preset base, bf16, on Multi30k: tmt greedy and beam 4 at batch
#                  1 and 32 against HF MarianMTModel.generate of the same size (and CTranslate2 where it is
#                  installed), then 1,000 test sentences with beam 5 (`decode_1000_beam5_s`, start-up not
#                  counted); with CUDNN=1 then the same with cuDNN's attention forced, the kernel auto avoids.
#   finetune       benchmarks/finetune.py: a Marian of OPUS-MT's size (d_model 512, 6+6 layers,
#                  58,101 entries) built with transformers and fitted 60 steps so that it ends its
#                  sentences, `tmt import`ed, fine-tuned by tmt and by
#                  Seq2SeqTrainer on the same batches (fp32, AdamW), then decoded at batch 32, beam 4 by
#                  tmt's CTranslate2 and torch engines and `generate`; on cuda (figures finetune-cuda-train,
#                  finetune-cuda-decode), then on the host's CPU (finetune-cpu-*). Needs sentencepiece and
#                  accelerate: `prepare` carries their wheels for an image without them.
#   check          the engine's self-check for real: two tiny `tmt train` runs of configs/demo.yaml on the
#                  GPU engine (bf16, CUDA graphs, attention dropout 0), one with packed batches, one
#                  padded; figures self-check-packed, self-check-padded (summary.json's engine_check:
#                  each path's loss, gradient and update errors against its reference); the stage fails
#                  if any path fell back or was not checked. Then the GPU tests (tests/test_gpu.py), the
#                  compiled ones included (TMT_TEST_COMPILE=1).
#   suite          the rest of the test suite on the machine's torch (CI runs it too, on CPU).
#   multi30k       trains configs/multi30k-en-de.yaml into runs/gpu-multi30k-en-de, then prints its
#                  figure (benchmarks/recipe_figures.py): ms per update, seconds from the command to the
#                  test score, test BLEU, and the validation BLEU (beam 5) of the test's checkpoint
#                  and of the last step's EMA, the measure recipe variants are compared on.
#   multi30k-seed2 the same with seed 2, in runs/gpu-multi30k-en-de-seed2.
#   multi30k-seed3 the same with seed 3, in runs/gpu-multi30k-en-de-seed3.
#   tatoeba        trains configs/tatoeba-en-it.yaml into runs/gpu-tatoeba-en-it.
#   compare        `tmt compare` over the finished Multi30k runs in runs/ (the plain recipe's first, then
#                  seeds and TAG variants): each one's test scores with 95 % intervals, p-values against
#                  the first, seed groups with mean ± sd; figure compare (the report, less the sentences).
#   scout          several recipes of configs/multi30k-en-de.yaml at once, one run each, from
#                  SCOUT="name:key=value key=value;name:..." (each run's sets after SETS), into
#                  runs/gpu-multi30k-en-de-NAME; one log, each line tagged [NAME], figures at its end:
#                    SCOUT="post:model.norm=post;drop:tokenizer.bpe_dropout=0.1" \
#                        bash benchmarks/gpu_runbook.sh scout
# A training stage stops with SIGTERM (a checkpoint; the stage still exits 0) before BUDGET seconds
# (default 480, for a 10-minute command) have passed since the command started, and resumes from
# its newest checkpoint when run again on the same machine while runs/ is still there (a fresh
# machine has none: the stage then starts at step 0, and says so).
# SETS="key=value ..." adds `--set` overrides to the training stages; TAG=x appends -x to their run names. Each stage writes STAGE.log
# into OUT (default gpu-out/), beside setup.log; after each stage (or group of stages at once) the runs
# trained so far in the command go into runs.tar.gz (their logs, scores and TensorBoard events; no
# checkpoints), one file, for a machine from which only a few files can be copied back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
BUDGET=${BUDGET:-480}
SETS=${SETS:-}
export PYTHONUNBUFFERED=1
# The GPU image's interpreter; here, whatever python3 the caller's environment gives.
PY=${PYTHON:-python3}
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export COMMIT  # train.py and recipe_figures.py put it in their JSON lines

log() { echo "== $(date -u +%H:%M:%S) $*"; }
threads_each() { echo "${OMP_NUM_THREADS:-$(( ($(nproc) + $1 - 1) / $1 ))}"; }  # the host's cores shared by $1 runs, unless OMP_NUM_THREADS says

prepare() {
    local data=${DATA:?"set DATA to the folder holding multi30k_en_de, tatoeba_anki_en_it and iwslt14_de_en_eval"}
    mkdir -p .gpu/data .gpu/wheels
    for corpus in multi30k_en_de tatoeba_anki_en_it; do
        [ -d "$data/$corpus" ] || { echo "gpu_runbook: no corpus at $data/$corpus (set DATA)" >&2; return 2; }
        rm -rf ".gpu/data/$corpus" && cp -r "$data/$corpus" .gpu/data/
    done
    # For scouting data.corpora: IWSLT'14's evaluation sets (TED talks, lowercased and tokenized as
    # Multi30k's tok/ files are) as a second en->de training corpus, without the lines holding <unk>.
    local iwslt=$data/iwslt14_de_en_eval extra=.gpu/data/iwslt14_eval_as_train
    [ -d "$iwslt" ] || { echo "gpu_runbook: no corpus at $iwslt (set DATA)" >&2; return 2; }
    mkdir -p "$extra"
    paste <(cat "$iwslt/valid.en" "$iwslt/test.en") <(cat "$iwslt/valid.de" "$iwslt/test.de") | grep -v '<unk>' \
        > "$extra/pairs.tsv" || return 1
    cut -f1 "$extra/pairs.tsv" > "$extra/train.en" && cut -f2 "$extra/pairs.tsv" > "$extra/train.de" || return 1
    rm "$extra/pairs.tsv"
    # The GPU image has torch, tokenizers, transformers, pyarrow, pandas, xxhash, huggingface-hub and
    # fsspec, but not datasets nor two of its needs; fsspec comes too, at a version datasets accepts
    # (it pins fsspec <= 2026.9.0, and the image's version is not known).
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/wheels \
        datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 || return 1
    # The finetune stage's: the OPUS-MT tokenizer's SentencePiece and Seq2SeqTrainer's accelerate (with psutil).
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu/wheels/finetune \
        sentencepiece==0.2.3 accelerate==1.16.0 psutil==7.2.2 || return 1
    git check-ignore -q .gpu || echo "gpu_runbook: .gpu is not git-ignored; add /.gpu/ to .gitignore" >&2
    du -sh .gpu
}

setup() {  # on the GPU machine: the carried wheels where `datasets` is missing, then what it has
    export PYTHONPATH=$PWD
    if ! "$PY" -c 'import datasets' 2>/dev/null && compgen -G ".gpu/wheels/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .gpu/wheels/*.whl || return 1
        export PYTHONPATH=/tmp/site:$PWD  # the tests' subprocesses keep it (tests/helpers.py PYTHONPATH)
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    "$PY" - <<'EOF' || { echo "gpu_runbook: a package tmt needs does not import (above); datasets 5.2.0 needs pyarrow >= 24" >&2; return 1; }
from importlib import metadata
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
for name in ("tokenizers", "datasets", "pyarrow", "fsspec", "huggingface-hub", "numpy", "transformers", "sacrebleu"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "not installed")
import datasets, tokenizers, sacrebleu, tensorboard  # noqa: F401,E401  (fail here, not in a stage)
EOF
}

check() {  # with the compiled tests (the compiled and captured update; about a minute of compiling)
    local rc=0
    self_check || rc=1
    log "GPU tests"
    TMT_TEST_COMPILE=1 "$PY" -m pytest tests/test_gpu.py -rs -s -p no:cacheprovider || rc=1
    return $rc
}

self_check() {  # a few steps each, no test: the self-check runs before the first step
    local rc=0 batching run
    for batching in packed padded; do
        run=runs/gpu-self-check-$batching
        log "engine self-check: train.batching $batching, CUDA graphs on"
        "$PY" -m transformer_mt train --config configs/demo.yaml --run-dir "$run" --overwrite --no-progress \
            --set train.batching=$batching --set model.attention_dropout=0 --set train.max_steps=4 \
            --set train.eval_every_steps=4 --set train.save_every_steps=4 --set train.test_at_end=false \
            || { rc=1; continue; }
        "$PY" - "$run/summary.json" "$batching" <<'EOF' || rc=1
import json, os, sys
check = json.load(open(sys.argv[1], encoding="utf-8"))["engine_check"] or {}
print(json.dumps({"figure": f"self-check-{sys.argv[2]}", "commit": os.environ["COMMIT"], **check}))
expected = ["packed", "captured"] if sys.argv[2] == "packed" else ["captured"]
failed = [part for part in expected if not check.get(part, {}).get("passed")]
if failed:
    sys.exit(f"gpu_runbook: the engine self-check fell back or did not run: {', '.join(failed)}")
EOF
    done
    return $rc
}

suite() {
    local workers=()
    log "the rest of the suite on this machine's torch"
    "$PY" -c 'import xdist' 2>/dev/null && workers=(-n 8)
    "$PY" -m pytest "${workers[@]}" -p no:cacheprovider --ignore=tests/test_gpu.py
}

bench() {  # fails if any run fails; each prints its JSON line last
    local rc=0
    log "bench: base, Multi30k, train.batch_tokens auto (tmt's choice for this device)"
    "$PY" benchmarks/train.py --device cuda --preset base --data .gpu/data/multi30k_en_de \
        --label bench-multi30k || rc=1
    log "bench: base, demo corpus"
    "$PY" benchmarks/train.py --device cuda --preset base --label bench-demo || rc=1
    return $rc
}

variants() {  # one piece at a time, Multi30k base; later ones are skipped when BUDGET runs short
    # The compiled step first: it is the variant expected to raise MFU most, and it takes longest
    # (each batch shape compiles before its capture: compile_seconds in its line's cuda_graphs, not
    # in the rates).
    # Each run is stopped at BUDGET, printing a timed_out line, so the command stays within it.
    local rc=0 name args left code
    local variants=("variant-compiled|--set train.compile=true" "variant-16k-tokens|--batch-tokens 16384"
                    "variant-no-cuda-graphs|--set train.cuda_graphs=false" "variant-pad1|--set train.pad_to_multiple=1")
    for variant in "${variants[@]}"; do
        name=${variant%%|*}
        read -ra args <<< "${variant#*|}"
        left=$((BUDGET - SECONDS))
        if [ "$left" -lt 90 ]; then
            echo "{\"figure\": \"$name\", \"commit\": \"$COMMIT\", \"skipped\": \"under 90 s of BUDGET=$BUDGET left\"}"
            continue
        fi
        log "bench: base, Multi30k, $name (${args[*]}), at most ${left}s"
        timeout -s TERM --kill-after=15 "$left" "$PY" benchmarks/train.py --device cuda --preset base \
            --data .gpu/data/multi30k_en_de --repeats 3 --steps 30 --label "$name" "${args[@]}"
        code=$?
        if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
            echo "{\"figure\": \"$name\", \"commit\": \"$COMMIT\", \"timed_out\": \"stopped after ${left} s, at BUDGET=$BUDGET\"}"
        fi
        [ "$code" -eq 0 ] || rc=1
    done
    return $rc
}

goal-bench() {
    log "bench: base, Multi30k, packed and padded engines, train.batch_tokens auto"
    "$PY" benchmarks/train.py --device cuda --preset base --data .gpu/data/multi30k_en_de \
        --attention-dropout 0 --repeats 3 --steps 30 --tutorial-steps 5 --label goal-bench
}

goals() {  # from every stage's log in OUT so far (this one's aside)
    local logs=()
    for f in "$OUT"/*.log; do
        [ -f "$f" ] && [ "$f" != "$OUT/goals.log" ] && logs+=("$f")
    done
    log "goals: from ${#logs[@]} logs in $OUT"
    "$PY" benchmarks/goal_figures.py "${logs[@]}"
}

bench-large() {
    log "bench: base, Multi30k, 65,536 tokens per batch"
    "$PY" benchmarks/train.py --device cuda --preset base --data .gpu/data/multi30k_en_de \
        --batch-tokens 65536 --repeats 3 --label bench-large
}

profile() {  # the host's time per update of the tiny model, which a CUDA graph step waits on
    log "profile: 1,500 updates of configs/multi30k-en-de.yaml under cProfile"
    rm -rf runs/gpu-profile
    "$PY" -m cProfile -o "$OUT/multi30k-1500.prof" -m transformer_mt train --config configs/multi30k-en-de.yaml \
        --set "data.path=$PWD/.gpu/data/multi30k_en_de/tok" --set train.max_steps=1500 \
        --set train.test_at_end=false --run-dir runs/gpu-profile --no-progress 2>&1 | grep -v "INFO example\|  source:\|  reference:\|  hypothesis:"
    "$PY" -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(30)" \
        "$OUT/multi30k-1500.prof"
}

bench-more() {  # what the multiple of 8 buys (MFU counts real tokens only), and what compile does
    local rc=0
    log "bench: base, Multi30k, pad_to_multiple 1"
    "$PY" benchmarks/train.py --device cuda --preset base --data .gpu/data/multi30k_en_de \
        --set train.pad_to_multiple=1 || rc=1
    log "bench: base, Multi30k, compiled"
    "$PY" benchmarks/train.py --device cuda --preset base --data .gpu/data/multi30k_en_de \
        --set train.compile=true --repeats 3 || rc=1
    return $rc
}

decode() {  # each run prints JSON lines: the beam-5 test figure, then the summary last
    local rc=0 data=.gpu/data/multi30k_en_de
    log "decode: base, bf16, Multi30k, decode.attention_backend auto"
    "$PY" benchmarks/decode.py --device cuda --preset base --precision bf16 --data "$data" \
        --test-beam 5 --test-sentences 1000 || rc=1
    [ "${CUDNN:-0}" = 1 ] || return $rc  # its figures: docs/benchmarks/decoding.md; CUDNN=1 measures it again
    log "decode: the same at batch 32, cuDNN's attention forced (a new execution plan per shape)"
    "$PY" benchmarks/decode.py --device cuda --preset base --precision bf16 --data "$data" \
        --attention-backend cudnn --batch-sizes 32 --n-sentences 320 --n-uncached 32 --without hf_marian \
        --test-beam 5 --test-sentences 1000 || rc=1
    return $rc
}

finetune() {  # an imported OPUS-MT-sized model: tmt against Seq2SeqTrainer and generate, then CTranslate2 on the CPU
    local rc=0
    if ! "$PY" -c 'import sentencepiece, accelerate' 2>/dev/null; then  # carried by prepare, where the image lacks them
        compgen -G ".gpu/wheels/finetune/*.whl" > /dev/null || { echo "gpu_runbook: finetune needs sentencepiece" \
            "and accelerate: run prepare (.gpu/wheels/finetune)" >&2; return 1; }
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-finetune \
            .gpu/wheels/finetune/*.whl || return 1
        export PYTHONPATH=$PYTHONPATH:/tmp/site-finetune
    fi
    log "finetune: OPUS-MT's size on the demo corpus, fp32 on cuda, 8,192 tokens per batch"
    "$PY" benchmarks/finetune.py --device cuda --threads "$(threads_each 1)" --batch-tokens 8192 \
        --warmup-steps 5 --steps 30 --label finetune-cuda || rc=1
    log "finetune: the same on the host's CPU, as on the development machines"
    "$PY" benchmarks/finetune.py --threads "$(threads_each 1)" --label finetune-cpu || rc=1
    return $rc
}

train_stage() {  # name config data-path [extra --set ...]
    local name=$1${TAG:+-$TAG} config=$2 data=$3 resume=() overrides=() sets=() code started
    local run=runs/gpu-$name
    shift 3
    overrides+=("$@")
    if [ -d "$run/checkpoints" ] && compgen -G "$run/checkpoints/step_*.pt" > /dev/null; then
        resume=(--resume)
    else
        log "$name: NO CHECKPOINT in $run: training starts at step 0 (on a machine that went cold, earlier progress is lost)"
    fi
    read -ra sets <<< "$SETS"  # split on spaces, no glob expansion (a YAML list is a bracket glob)
    for kv in "${sets[@]}"; do overrides+=(--set "$kv"); done
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 60 ]; then
        log "$name: only ${left}s of BUDGET left; run the stage in a command of its own"
        return 0
    fi
    log "$name: training for at most ${left}s ${resume[*]} ${overrides[*]}"
    touch "$STAMPS/$name"  # a checkpoint or summary newer than this was written by this command
    started=$SECONDS
    # tmt stops on SIGTERM after the step it is in and writes a checkpoint (seconds for a base model);
    # --kill-after bounds a stop that hangs, so the archive below still gets written within the command.
    timeout --preserve-status -s TERM --kill-after=45 "$left" "$PY" -m transformer_mt train --config "$config" \
        --set "data.path=$PWD/$data" "${overrides[@]}" --run-dir "$run" --no-progress "${resume[@]}"
    code=$?
    case $code in
        0) log "$name: finished" ;;
        143) # tmt exits 143 after writing its checkpoint, but a SIGTERM before training starts
             # (tokenizers, caches, loading a checkpoint) kills it with the same code and none
             if [ -n "$(find "$run/checkpoints" -name 'step_*.pt' -newer "$STAMPS/$name" 2>/dev/null)" ]; then
                 log "$name: stopped at the time limit with a checkpoint: run the stage again at once to resume"
                 code=0
             else
                 log "$name: stopped at the time limit before any checkpoint was written: give it a longer BUDGET"
             fi ;;
        *) log "$name: tmt exited with $code" ;;
    esac
    # The stage's figure, one JSON line, from a summary this command wrote: on a warm machine an
    # older run of the same name (refused, or already finished) must not pass for this one.
    if [ "$run/summary.json" -nt "$STAMPS/$name" ]; then
        "$PY" benchmarks/recipe_figures.py "$run" --label "$name" --stage-seconds $((SECONDS - started)) \
            ${resume[0]:+--resumed} --score-valid || code=1
    elif [ -f "$run/summary.json" ]; then
        log "$name: no figure: $run/summary.json is older than this command (tmt exited $code)"
        code=1
    fi
    rm -f "$STAMPS/$name"
    echo "$run" >> "$TRAINED"  # archived after the stage (stages at once would race on one archive)
    return $code
}

scout() {  # several Multi30k recipes at once, each from SCOUT="name:key=value ...;name:...", into one log
    local entry name pids=() names=() rc=0 i
    [ -n "${SCOUT:-}" ] || { echo "gpu_runbook: scout needs SCOUT=\"name:key=value ...;name:...\"" >&2; return 2; }
    case $SCOUT in *$'\n'*)  # `read` would keep the first line only
        echo "gpu_runbook: SCOUT holds a line break; continue its lines with a backslash" >&2; return 2 ;;
    esac
    IFS=';' read -ra entries <<< "$SCOUT"
    for entry in "${entries[@]}"; do
        [[ ${entry%%:*} =~ ^[A-Za-z0-9._-]+$ && $entry == *:* ]] || {
            echo "gpu_runbook: SCOUT entry '$entry' is not name:key=value ... (a name of letters, digits, . _ -)" >&2
            return 2; }
    done
    log "scout: ${#entries[@]} runs at once, $(threads_each ${#entries[@]}) CPU threads each (their times are not those of a machine alone)"
    for entry in "${entries[@]}"; do
        name=${entry%%:*}
        # Each run's own overrides after SETS (a later --set wins); its lines tagged with its name.
        { OMP_NUM_THREADS=$(threads_each ${#entries[@]}) \
            SETS="$SETS ${entry#*:}" train_stage "multi30k-en-de-$name" configs/multi30k-en-de.yaml \
            .gpu/data/multi30k_en_de/tok 2>&1 | sed -u "s/^/[$name] /"; } &
        pids+=($!)
        names+=("$name")
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || { rc=1; log "scout: ${names[$i]} failed"; }
    done
    log "scout: the figures"
    sed -n 's/^\[[^]]*\] \({"figure".*\)/\1/p' "$OUT/scout.log" 2>/dev/null  # untagged, as `grep '^{"figure"'` finds
    return $rc
}

compare() {  # the finished Multi30k runs on this machine, the plain recipe's first: `tmt compare` as one figure
    local runs=() run
    for run in runs/gpu-multi30k-en-de runs/gpu-multi30k-en-de-*; do
        [ -f "$run/evaluation/test_scores.json" ] && runs+=("$run")
    done
    if [ "${#runs[@]}" -lt 2 ]; then
        echo "{\"figure\": \"compare\", \"commit\": \"$COMMIT\", \"skipped\": \"fewer than two finished Multi30k runs in runs/\"}"
        return 0
    fi
    log "compare: ${runs[*]}"
    "$PY" -m transformer_mt compare "${runs[@]}" --format json > "$OUT/compare.json" || return 1
    # Scores with 95 % intervals, p-values against the first run, seed groups (mean ± sd), config differences.
    "$PY" -c 'import json, os, sys; r = json.load(open(sys.argv[1])); r.pop("segments")
print(json.dumps({"figure": "compare", "commit": os.environ["COMMIT"], **r}, ensure_ascii=False))' "$OUT/compare.json"
}

multi30k() { train_stage multi30k-en-de configs/multi30k-en-de.yaml .gpu/data/multi30k_en_de/tok; }
multi30k-seed2() { train_stage multi30k-en-de-seed2 configs/multi30k-en-de.yaml .gpu/data/multi30k_en_de/tok --set seed=2; }
multi30k-seed3() { train_stage multi30k-en-de-seed3 configs/multi30k-en-de.yaml .gpu/data/multi30k_en_de/tok --set seed=3; }
tatoeba() { train_stage tatoeba-en-it configs/tatoeba-en-it.yaml .gpu/data/tatoeba_anki_en_it; }

[ $# -gt 0 ] || { awk 'NR > 1 { if (!/^#/) exit; print }' "$0"; exit 2; }  # the comment block above
status=0
if [ "$1" = prepare ]; then
    prepare
    exit $?
fi
for group in "$@"; do
    IFS=, read -ra stages <<< "$group"
    for stage in "${stages[@]}"; do
        case $stage in
            check|suite|bench|variants|bench-large|goal-bench|goals|bench-more|decode|finetune|profile|multi30k|multi30k-seed2|multi30k-seed3|tatoeba|scout|compare) ;;
            *) echo "gpu_runbook: unknown stage '$stage' (bench, bench-large, bench-more, decode, finetune, profile, variants, check," \
                    "suite, multi30k, multi30k-seed2, multi30k-seed3, tatoeba, scout, compare, goal-bench, goals; joined by commas to run at once;" \
                    "prepare runs alone)" >&2
               exit 2 ;;
        esac
    done
done
mkdir -p "$OUT"
TRAINED=$(mktemp)  # the run directories the training stages of this command used, one per line
STAMPS=$(mktemp -d)  # each stage's start time (outside OUT: a killed command leaves no extra file there)

archive_runs() {  # every run trained so far in this command, into one archive
    [ -s "$TRAINED" ] || return 0
    sort -u "$TRAINED" | tar -czf "$OUT/runs.tar.gz" --exclude=checkpoints --exclude=corpus_cache \
        --exclude=token_cache -T -
}

setup > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 1; }
cat "$OUT/setup.log"
for group in "$@"; do
    IFS=, read -ra stages <<< "$group"
    if [ "${#stages[@]}" -eq 1 ]; then
        { "$group" 2>&1 | tee "$OUT/$group.log"; } || status=1
    else
        log "at once: ${stages[*]}, each into its own STAGE.log, $(threads_each ${#stages[@]}) CPU threads each"
        pids=()
        for stage in "${stages[@]}"; do
            OMP_NUM_THREADS=$(threads_each ${#stages[@]}) "$stage" > "$OUT/$stage.log" 2>&1 &
            pids+=($!)
        done
        for i in "${!pids[@]}"; do
            wait "${pids[$i]}" || { status=1; log "${stages[$i]} failed"; }
        done
        for stage in "${stages[@]}"; do  # each one's end: its figure line, its test summary
            log "$stage.log ends:"
            tail -n 4 "$OUT/$stage.log"
        done
    fi
    archive_runs
done
rm -rf "$TRAINED" "$STAMPS"
exit $status
