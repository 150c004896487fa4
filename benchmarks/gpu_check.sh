#!/usr/bin/env bash
# One check for a lent GPU, under 8 minutes: what the device is, the kernel and differential
# tests on CUDA, and the large-queue benchmark on CUDA up to 2^20 waiting requests.
#
# Usage: benchmarks/gpu_check.sh OUTDIR
#   OUTDIR gets: status.tsv (section, exit status, seconds), env.txt, pytest_<group>.log/.xml,
#   profile.log + profile_<policy>_<mode>_<backend>.json (benchmarks/profile_step.py),
#   bench_queue.log, bench_queue_cuda.json, bench_queue_cuda.png, plot.log,
#   bench_kernels.log + bench_kernels.json (benchmarks/bench_kernels.py), sanitizer.log (when
#   GPU_CHECK_SANITIZER_S is set).
#   GPU_CHECK_DRY_RUN=1: the same flow on a CPU machine (tiny sizes, cpu backends), to check
#   the script itself.
#
# Every section runs under `timeout`; a failing or timed-out section is recorded in
# status.tsv and the next one still runs. The script exits non-zero if any section failed.
# Section limits (s; 0 skips a section): env 15, install 60 (only where gpu_sched is not
# importable, a few seconds), radix kernel tests $GPU_CHECK_RADIX_S (50), recorded-step / CUDA
# graph tests $GPU_CHECK_GRAPH_S (75), other kernel tests $GPU_CHECK_KERNELS_S (100),
# differential tests $GPU_CHECK_DIFF_S (60), bench $GPU_CHECK_BENCH_S (110, less the seconds
# the install took; no new row in its last 30 s), kernel variants $GPU_CHECK_KBENCH_S (20),
# step profiles $GPU_CHECK_PROFILE_S (30), compute-sanitizer $GPU_CHECK_SANITIZER_S (0: off),
# plot 15: at most 475 s plus kill grace (the
# 2026-12-04 run's section times: benchmarks/results/gpu_tests_h200_20261204.txt). Tests: $GPU_CHECK_WORKERS xdist workers (12), one test
# at most $GPU_CHECK_TEST_TIMEOUT_S (60) where pytest-timeout is installed. Bench: queue sizes
# $GPU_CHECK_SIZES, policies $GPU_CHECK_POLICIES (benchmarks/README.md).
set -euo pipefail

OUT="${1:?usage: benchmarks/gpu_check.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
PY="${PYTHON:-python}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
STATUS="$OUT/status.tsv"
printf 'section\tstatus\tseconds\n' > "$STATUS"
FAILED=0

# section NAME LIMIT_S LOG CMD...: run CMD under timeout with stdout+stderr into LOG, record status
section() {
    local name="$1" limit="$2" log="$3"
    shift 3
    local t0 rc=0
    t0=$(date +%s)
    echo "== $name (limit ${limit}s) -> $log"
    timeout --kill-after=15 "$limit" "$@" > "$log" 2>&1 || rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$STATUS"
    if [[ "$rc" != 0 ]]; then
        FAILED=1
        echo "   $name failed with status $rc (124: timed out); last lines:"
        tail -n 5 "$log" | sed 's/^/   | /'
    fi
    return 0
}

env_info() {
    date -u +%Y-%m-%dT%H:%M:%SZ
    git rev-parse HEAD 2>/dev/null || true
    git status --short 2>/dev/null | head -20 || true
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu,clocks.sm \
            --format=csv,noheader
    elif [[ "$DRY" == 1 ]]; then
        echo "nvidia-smi: not found (dry run)"
    else
        echo "nvidia-smi: not found"
        return 1
    fi
    "$PY" - <<'EOF'
import platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__)
print("cuda available:", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF
}

# Test files, in four pytest processes, the GPU-specific ones first (a process compiles each
# kernel it uses once). Without CUDA the test files choose Triton's interpreter themselves.
pick() { local f; for f in "$@"; do [[ -f "$f" ]] && printf '%s\n' "$f"; done; return 0; }
mapfile -t T_RADIX < <(pick tests/test_kernels_radix.py)
mapfile -t T_GRAPH < <(pick tests/test_step_graph.py tests/test_step_core.py tests/test_kernels_admission.py)
mapfile -t T_KERNELS < <(pick tests/test_radix_device.py tests/test_match_hints.py tests/test_policy_device.py tests/test_kernels_sort_keys.py \
    tests/test_state.py tests/test_conformance_device.py)
mapfile -t T_DIFF < <(pick tests/test_step_differential.py tests/test_scheduler_differential.py \
    tests/test_ordering_mooncake.py tests/test_radix_mooncake.py)

# The Mooncake trace: $GPU_SCHED_TRACE, else the usual places; without it the benchmark uses
# the synthetic shared-prefix queue.
TRACE=""
for c in "${GPU_SCHED_TRACE:-}" shared/traces/mooncake/conversation_trace.jsonl \
         ../shared/traces/mooncake/conversation_trace.jsonl /work/shared/traces/mooncake/conversation_trace.jsonl; do
    if [[ -n "$c" && -f "$c" ]]; then TRACE="$c"; break; fi
done
if [[ -n "$TRACE" ]]; then
    QUEUE_ARGS=(--queue mooncake --trace "$TRACE")
else
    QUEUE_ARGS=(--queue synthetic --distinct 8192)
fi
echo "== benchmark queue: ${QUEUE_ARGS[*]}"

if [[ "$DRY" == 1 ]]; then
    TEST_DEV=cpu
    # the full files take ~12 min in Triton's interpreter: a dry run only collects them
    PYTEST_ARGS=(-q -n 0 --collect-only)
    BENCH_ARGS=(--backends reference,torch-cpu --min-exp 6 --max-exp 8 --ref-max-exp 7 --warm 50
                --max-prompt-len 1024 --reps 2 --budget-s 0.1 --max-seconds 5 --deadline-s 100)
else
    unset TRITON_INTERPRET
    TEST_DEV=cuda
    # xdist workers compile the kernels in parallel (Triton compiles one kernel at a time per
    # process); -vv gives a line per test (addopts' -q cancels one -v), so a log cut by the
    # section's limit still names what passed; a hung test (a spinning kernel) is ended by
    # pytest-timeout where the machine has it
    PYTEST_ARGS=(-vv -n "${GPU_CHECK_WORKERS:-12}" --dist worksteal -rfE --tb=short --maxfail=10
                 -p no:cacheprovider)
    if "$PY" -c "import pytest_timeout" > /dev/null 2>&1; then
        PYTEST_ARGS+=(--timeout "${GPU_CHECK_TEST_TIMEOUT_S:-60}")
    fi
    # torch and triton on CUDA at $GPU_CHECK_SIZES: the recorded step (graph: one CUDA-graph
    # replay; gstep: the whole step() through it) at every size, the eager step and the plan
    # check at 2^9, the reference to 2^15 for ratios; Mooncake prefixes capped at 2048 tokens; a call over 10 s
    # ends a backend/policy; no new row in the section's last 30 s
    BENCH_ARGS=(--backends reference,torch-cuda,triton-cuda
                --policies "${GPU_CHECK_POLICIES:-lpm,fcfs,dfs-weight}"
                --stages step,graph,gstep --sizes "${GPU_CHECK_SIZES:-512,4096,131072}"
                --ref-max-exp 15 --eager-max-exp 9 --check-max-exp 9 --warm 500 --max-prompt-len 2048
                --reps 5 --budget-s 0.2 --max-seconds 10 --slow-s 1 --slow-reps 1)
fi

run_pytest() {  # run_pytest NAME LIMIT FILES... (LIMIT 0: skipped)
    local name="$1" limit="$2"
    shift 2
    if [[ $# == 0 || "$limit" == 0 ]]; then
        printf '%s\tskipped\t0\n' "$name" >> "$STATUS"
        return 0
    fi
    section "$name" "$limit" "$OUT/$name.log" env GPU_SCHED_TEST_DEVICE="$TEST_DEV" \
        "$PY" -m pytest "${PYTEST_ARGS[@]}" --junitxml="$OUT/$name.xml" "$@"
}

export -f env_info
export DRY PY
section env 15 "$OUT/env.txt" bash -c env_info
INSTALL_S=0
if ! "$PY" -c "import gpu_sched.kernels" > /dev/null 2>&1; then
    # a bare GPU machine: its own torch/triton, this checkout installed in place, nothing fetched
    t_install=$(date +%s)
    section install 60 "$OUT/install.log" "$PY" -m pip install --no-deps --no-build-isolation --no-index -e .
    INSTALL_S=$(( $(date +%s) - t_install ))
fi
# the bench gives up what the install took, so that the whole check stays within 480 s
BENCH_S="${GPU_CHECK_BENCH_S:-110}"
if [[ "$BENCH_S" != 0 ]]; then
    BENCH_S=$(( BENCH_S - INSTALL_S > 40 ? BENCH_S - INSTALL_S : 40 ))
    if [[ "$DRY" != 1 ]]; then
        BENCH_ARGS+=(--deadline-s "$(( BENCH_S - 30 ))")
    fi
fi
run_pytest pytest_radix "${GPU_CHECK_RADIX_S:-50}" "${T_RADIX[@]}"
run_pytest pytest_graph "${GPU_CHECK_GRAPH_S:-75}" "${T_GRAPH[@]}"
run_pytest pytest_kernels "${GPU_CHECK_KERNELS_S:-100}" "${T_KERNELS[@]}"
run_pytest pytest_differential "${GPU_CHECK_DIFF_S:-60}" "${T_DIFF[@]}"
rm -f "$OUT/bench_queue_cuda.json"
if [[ "$BENCH_S" != 0 ]]; then
section bench "$BENCH_S" "$OUT/bench_queue.log" "$PY" benchmarks/bench_queue.py "${QUEUE_ARGS[@]}" "${BENCH_ARGS[@]}" \
    --threads 1 --out "$OUT/bench_queue_cuda.json"
fi
# The alternatives for the recorded step's costliest launches (sort key width, block sizes),
# side by side (benchmarks/bench_kernels.py). Dry run: tiny sizes in the interpreter.
if [[ "${GPU_CHECK_KBENCH_S:-20}" != 0 ]]; then
    if [[ "$DRY" == 1 ]]; then KB_ARGS=(--sizes 20 --reps 1 --device cpu); else KB_ARGS=(--sizes 4096,131072 --reps 50); fi
    section kernels_bench "${GPU_CHECK_KBENCH_S:-20}" "$OUT/bench_kernels.log" env TRITON_INTERPRET="$([[ "$DRY" == 1 ]] && echo 1 || echo 0)" \
        "$PY" benchmarks/bench_kernels.py "${KB_ARGS[@]}" --out "$OUT/bench_kernels.json"
fi
# Where a step's time goes (phases, host syncs by call site, kernel table) at 4096 waiting: lpm's
# and fcfs's whole step() through the recorded graph (triton; the eager step on a GPU is tens
# of ms of small launches, past this section's limit). Dry run: torch on the CPU at 256.
profiles() {
    local n=4096 spec pol mode be q=(--queue synthetic)
    local specs=("lpm graph triton" "fcfs graph triton")
    if [[ "$DRY" == 1 ]]; then n=256; specs=("lpm graph torch" "fcfs eager torch"); fi
    if [[ -n "$TRACE" ]]; then q=(--queue mooncake --trace "$TRACE"); fi
    for spec in "${specs[@]}"; do
        read -r pol mode be <<< "$spec"
        echo "=== $pol $mode $be n=$n"
        "$PY" benchmarks/profile_step.py --policy "$pol" --n "$n" --mode "$mode" --backend "$be" --steps 3 \
            --top 20 --out "$OUT/profile_${pol}_${mode}_${be}.json" "${q[@]}" || return 1
    done
}
export -f profiles
export OUT TRACE
if [[ "${GPU_CHECK_PROFILE_S:-30}" != 0 ]]; then
    section profile "${GPU_CHECK_PROFILE_S:-30}" "$OUT/profile.log" bash -c profiles
fi
# compute-sanitizer over the radix and sort-key kernel tests, reusing the kernels the test
# sections compiled: memcheck (out-of-bounds and misaligned device accesses) and initcheck
# (reads of device memory nothing wrote; the tests' poisoned torch.empty is off for it, or its
# fill would count as a write). What Triton's interpreter cannot show on a CPU, where
# tests/interp_races.py and the poison stand in. Off by default ($GPU_CHECK_SANITIZER_S = 0):
# the sections above spend the 8 minutes; a second call with spare device time sets it (60-120
# s). It needs a Firecracker machine (the nvidia-h100-x1 kind): gVisor's H200 refuses the
# device (.library/device/KINDS.md).
sanitize() {
    if ! command -v compute-sanitizer > /dev/null; then
        echo "compute-sanitizer: not found"
        return 1
    fi
    local tool
    for tool in memcheck initcheck; do
        echo "=== $tool"
        GPU_SCHED_POISON_EMPTY=0 GPU_SCHED_TEST_DEVICE=cuda compute-sanitizer --tool "$tool" --error-exitcode 9 \
            --target-processes all "$PY" -m pytest -q -n 0 -x -p no:cacheprovider \
            tests/test_kernels_radix.py tests/test_kernels_sort_keys.py || return 1
    done
}
export -f sanitize
SAN_S="${GPU_CHECK_SANITIZER_S:-0}"
if [[ "$SAN_S" == 0 || "$DRY" == 1 ]]; then
    printf 'sanitizer\tskipped\t0\n' >> "$STATUS"
else
    section sanitizer "$SAN_S" "$OUT/sanitizer.log" bash -c sanitize
fi
if [[ -s "$OUT/bench_queue_cuda.json" ]]; then
    # 3 s on the H200 machine; a dry run on a small shared CPU took 15 s and more
    section plot "$([[ "$DRY" == 1 ]] && echo 60 || echo 15)" "$OUT/plot.log" "$PY" benchmarks/plot_bench.py "$OUT/bench_queue_cuda.json" \
        --out "$OUT/bench_queue_cuda.png"
else
    printf 'plot\tskipped (no rows)\t0\n' >> "$STATUS"
fi

echo "== status ($STATUS)"
column -t -s $'\t' "$STATUS" 2>/dev/null || cat "$STATUS"
exit "$FAILED"
