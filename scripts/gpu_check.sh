#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, run the `cuda`-marked tests and the benchmarks of scripts/, and write
# a report of what ran, on what, with which result.
#
#   bash scripts/gpu_check.sh                      # everything; the report goes to gpu_report/REPORT.md
#   bash scripts/gpu_check.sh OUT tests memory     # only some steps (tests, smoke, memory, overhead, auto, compile,
#                                                    ddp, fsdp, peers, levers, vision, embeddings) into OUT/
#
# Steps: `tests` (pytest -m cuda: the CUDA correctness tests, e.g. tests/cuda/test_cuda_correctness.py), `smoke` (the
# default job on the GPU, then accutrain-check), `memory` (scripts/bench_memory.py: peak memory and samples/s
# against micro_batch), `overhead` (scripts/bench_overhead.py: accutrain's loop against the hand-written one, on
# resnet18 and on the MLP), `auto` (scripts/bench_auto_batch.py: micro_batch=auto against the largest that fits),
# `compile` (the same with trainer.compile=true: compiled against eager samples/s), `ddp`
# (scripts/bench_ddp.py, NCCL; needs 2 GPUs, else skipped and said), `fsdp` (scripts/bench_memory.py --strategies:
# DDP vs FSDP each/last/offload at devices=2; needs 2 GPUs), `peers` (scripts/compare_lm_peers.py: LoRA at the 0.5B and
# 1.5B shapes beside the HF Trainer and TRL: tokens/s, peak memory, MFU), `levers` (the same, accutrain with one speed
# lever at a time), `vision` (resnet50 at 224 px, bf16, against the hand-written loop), `embeddings`
# (scripts/compare_embedding_peers.py beside sentence-transformers' cached loss). Each step's full output is
# OUT/<step>.log;
# REPORT.md has the machine, the versions, and per step the command, exit code, wall time and the output's end.
# The exit code is the number of steps that failed (0: all passed).
#
# accutrain must import: installed (pip install -e ".[dev]"), or its dependencies installed (hydra-core, omegaconf,
# tqdm, matplotlib): then src/ is used in place. On a machine without internet, bring hydra-core, omegaconf and
# antlr4-python3-runtime as wheels and set WHEELS=dir: they are installed from there first.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${1:-gpu_report}
shift $(( $# > 0 ? 1 : 0 ))
STEPS=${*:-tests smoke memory overhead auto compile ddp fsdp peers levers vision embeddings}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPORT="$OUT/REPORT.md"
export PYTHONUNBUFFERED=1

if [ -n "${WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --find-links "$WHEELS" hydra-core omegaconf >"$OUT/wheels.log" 2>&1 \
        || echo "could not install from $WHEELS: see $OUT/wheels.log" >&2
fi
if ! $PY -c "import accutrain" 2>/dev/null; then
    export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"  # configs/ is found beside src/ in a checkout
fi
if ! $PY -c "import accutrain.runtime.launch" 2>"$OUT/import.log"; then
    echo "accutrain does not import: $(tail -1 "$OUT/import.log") (pip install -e \".[dev]\", or WHEELS=dir)" >&2
    exit 2
fi

{
    echo "# accutrain GPU check"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    smi=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | paste -sd ';' -)
    echo "- GPUs (nvidia-smi): ${smi:-none found}"
    $PY - <<'EOF'
import platform, torch
cuda = torch.cuda.is_available()
print(f"- python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}, {torch.cuda.device_count()} visible GPU(s)"
      + (f": {torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}" if cuda else
         " — NO CUDA DEVICE: the cuda tests skip and the benchmarks run on the CPU"))
EOF
    echo "- steps: $STEPS"
    echo
} >"$REPORT"

failed=0
run_step() {  # run_step NAME COMMAND...: run it, log it, and add its section to the report
    local name=$1; shift
    local start=$SECONDS
    echo "== $name: $*" >&2
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    [ $rc -ne 0 ] && failed=$((failed + 1))
    {
        echo "## $name — $([ $rc -eq 0 ] && echo passed || echo "FAILED (exit $rc)"), $((SECONDS - start)) s"
        echo
        echo '```'
        echo "\$ $*"
        tail -n "${TAIL:-40}" "$OUT/$name.log"
        echo '```'
        echo
    } >>"$REPORT"
}

skip_step() {
    echo "## $1 — skipped: $2" >>"$REPORT"
    echo >>"$REPORT"
}

gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
for step in $STEPS; do
    case $step in
        tests)
            run_step tests $PY -m pytest -m cuda -n 0 -p no:cacheprovider -rA --junitxml="$OUT/cuda-tests.xml" ;;
        smoke)
            run_step smoke bash -c "set -e; cd '$OUT' && $PY -m accutrain trainer.device=cuda hydra.run.dir=smoke_run \
                && $PY -c 'from accutrain.cli.main import check_main; check_main()' trainer.device=cuda batchnorm.convert=group" ;;
        memory)
            run_step memory $PY scripts/bench_memory.py --steps 12 --out "$OUT/memory_gpu.png" ;;
        overhead)
            run_step overhead $PY scripts/bench_overhead.py --device cuda --rounds 5 accum=4
            run_step overhead_mlp $PY scripts/bench_overhead.py --device cuda --rounds 7 --steps 60 model=mlp \
                micro_batch=8 accum=8 ;;
        auto)
            run_step auto $PY scripts/bench_auto_batch.py ;;
        compile)
            run_step compile $PY scripts/bench_overhead.py --device cuda --rounds 3 --steps 60 --warmup 12 accum=4 \
                trainer.compile=true trainer.log_every=1000000 ;;
        ddp)
            if [ "$gpus" -ge 2 ]; then
                run_step ddp $PY scripts/bench_ddp.py trainer.device=cuda micro_batch=16
            else
                skip_step ddp "needs 2 GPUs for NCCL, $gpus visible"
            fi ;;
        fsdp)
            if [ "$gpus" -ge 2 ]; then
                run_step fsdp $PY scripts/bench_memory.py --strategies --rounds 3 trainer.device=cuda
            else
                skip_step fsdp "needs 2 GPUs for DDP vs FSDP at devices=2, $gpus visible"
            fi ;;
        peers)
            run_step peers_0.5b $PY scripts/compare_lm_peers.py --device cuda --shape 0.5b
            run_step peers_1.5b $PY scripts/compare_lm_peers.py --device cuda --shape 1.5b ;;
        levers)
            run_step levers $PY scripts/compare_lm_peers.py --device cuda --shape 0.5b --levers ;;
        vision)
            run_step vision $PY scripts/compare_lm_peers.py --device cuda --vision ;;
        embeddings)
            run_step embeddings $PY scripts/compare_embedding_peers.py --device cuda ;;
        *)
            skip_step "$step" "unknown step (tests, smoke, memory, overhead, auto, compile, ddp, fsdp, peers, levers, vision, embeddings)" ;;
    esac
done

echo "**$failed step(s) failed.**" >>"$REPORT"
echo "report: $REPORT" >&2
exit $failed
