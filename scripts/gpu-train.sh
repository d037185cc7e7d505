#!/usr/bin/env bash
# One prepared GPU run that retrains the demo models on the corpus mix (issue 23):
# scripts/gpu-train.sh OUT_DIR [--cpu-smoke]
#
# `ar` and `diffusion` are trained on at once on the one GPU (`nowait train KIND --tier mixed`, each
# from its bundled weights, on training documents no earlier run has seen: --data-start), for
# NOWAIT_TRAIN_MINUTES minutes each (default 3; `--minutes` plans the steps from the measured rate so
# the learning rate still decays at the end). Each exports its best checkpoint (validation on the mix)
# to OUT_DIR/ar and OUT_DIR/diffusion. Then, on the same device, each exported model is measured per
# tier (`nowait eval ... --json`: clean and hard on the test split, hard on a fresh seed): ar,
# diffusion's fast default and its template mode. OUT_DIR/models.tgz holds both exported models (with their
# training logs), the files a session brings back; summary.tsv lists each step's exit status and
# seconds, as scripts/gpu-check.sh's does. The training steps' timeouts are the budget plus 150 s
# (start, the last evaluation, the export), the evaluations' 30 s a group: with the wheels' 90 s the
# timeouts add up to 8.5 minutes at the default budget (the device call's timeout_s: 590).
#
# Afterwards, on the CPU: `nowait calibrate --model OUT_DIR/diffusion --ar-model OUT_DIR/ar --tier mixed`
# (writes calibration.json beside the model), `nowait eval --engine routed --model OUT_DIR/diffusion
# --ar-model OUT_DIR/ar --tier hard`, and the bundled models replaced only when the clean tier holds
# (docs/training.md, "Retraining on the mix").
#
# --cpu-smoke (or NOWAIT_CPU_SMOKE=1) runs the same steps on the CPU with a few optimizer steps and
# documents each, to check the script without a GPU.
set -u
# shellcheck source=scripts/gpu-lib.sh
source "$(dirname "$0")/gpu-lib.sh" "$@"  # OUT_DIR and --cpu-smoke read there

minutes=${NOWAIT_TRAIN_MINUTES:-3}
runs=${NOWAIT_TRAIN_RUNS:-/tmp/nowait-train-runs}  # checkpoints and logs: not brought back
if [ "$smoke" = 1 ]; then
    scale=4 device=cpu
    budget=(--steps 2 --batch-size 2 --eval-every 2 --eval-documents 2)
    train_limit=150 n=4  # the 4th hard test document is a held-out layout
else
    scale=1 device=cuda
    # As the earlier GPU continuation (docs/training.md): batch 128, 4 data workers per run (the
    # device's 16 cores hold both runs' workers), 200 validation documents on the mix.
    budget=(--minutes "$minutes" --data-workers 4 --batch-size 128 --learning-rate 1e-3 --eval-every 1000
            --eval-documents 200)
    train_limit=$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 + 150 }') n=200
fi
common=(--device "$device" --tier mixed --data-start 40000000 --threads 1 "${budget[@]}")
rm -rf "$runs"

step train-ar "$train_limit" train ar "${common[@]}" --init-from "$root/src/nowait/assets/ar" \
    --run-dir "$runs/ar" --out "$out/ar" &
step train-diffusion "$train_limit" train diffusion "${common[@]}" --init-from "$root/src/nowait/assets/diffusion" \
    --prompt-isolation 0.5 --run-dir "$runs/diffusion" --out "$out/diffusion" &
wait

# Per tier and sample, the three measurements at once (the GPU and 16 cores hold them): clean and
# hard on the test split (hard: 40% held-out layouts), hard on a fresh seed.
for where in "clean test" "hard test" "hard fresh"; do
    read -r tier sample <<< "$where"
    split=(--split test)
    [ "$sample" = fresh ] && split=(--seed 2318)
    args=(--tier "$tier" --n "$n" --device "$device" --json "${split[@]}")
    step "eval-ar-$tier-$sample" 30 eval --engine ar --model "$out/ar" "${args[@]}" &
    step "eval-diffusion-$tier-$sample" 30 eval --engine diffusion --model "$out/diffusion" "${args[@]}" &
    step "eval-template-$tier-$sample" 30 eval --engine diffusion --structured --model "$out/diffusion" "${args[@]}" &
    wait
done

if [ -d "$out/ar" ] && [ -d "$out/diffusion" ]; then
    tar czf "$out/models.tgz" -C "$out" ar diffusion
    printf 'models\t%s\t0\n' "$?" >> "$out/summary.tsv"
else
    printf 'models\tmissing (a training step failed)\t0\n' >> "$out/summary.tsv"
fi
cat "$out/summary.tsv" >&2
# Exit 0 only when every step that ran succeeded.
! awk -F '\t' 'NR > 1 && $2 ~ /^[0-9]+$/ && $2 != 0 { bad = 1 } END { exit !bad }' "$out/summary.tsv"
