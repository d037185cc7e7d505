#!/usr/bin/env bash
# One prepared GPU run of nowait's benches (issue 24): scripts/gpu-check.sh OUT_DIR [--cpu-smoke]
#
# On a machine with this repo and PyTorch with CUDA, no network: bench physics, bench engines and
# bench batching on the bundled models, the real-shape steps of llama-3.1-8b and llada-8b at batch 1
# and 8 (bf16, random weights), DiffusionGemma-26B-A4B's denoiser step at batch 1 and 8 (bf16,
# random weights built on the GPU, about 50 GB; issue 27), bench batching again with CUDA Graphs off, and bench
# peers when transformers imports. Every step writes
# OUT_DIR/<step>.json (stdout) and <step>.err, under its own timeout, so one failure loses only
# itself; OUT_DIR/summary.tsv lists each step's exit status and seconds. The timeouts add up to
# under 8 minutes. --cpu-smoke (or NOWAIT_CPU_SMOKE=1) runs the same steps on the CPU, shrunk to
# seconds each (the `tiny` and `diffusiongemma-tiny` shapes for the real ones), to check the script
# without a GPU. NOWAIT_GPU_CHECK_ONLY=NAME,NAME runs only those steps (the others are listed as
# skipped), e.g. to check one step's command line on a CPU.
set -u
# shellcheck source=scripts/gpu-lib.sh
source "$(dirname "$0")/gpu-lib.sh" "$@"  # OUT_DIR and --cpu-smoke read there

# The timeouts are the GPU's; a smoke run on a shared CPU gets four times each.
if [ "$smoke" = 1 ]; then
    scale=4 device=cpu dtype=fp32 big_ar=tiny big_diffusion=tiny big_gemma=diffusiongemma-tiny
    physics=(--budget 0.05 --host-budget 0.2)
    engines=(--n 1)
    ar_batching=(--concurrency 1,2 --max-tokens 8 --rounds 1)
    diffusion_batching=(--concurrency 1,2 --max-tokens 32 --rounds 1)
    ar_eager=(--concurrency 1,2 --max-tokens 8 --rounds 1)
    diffusion_eager=(--concurrency 1 --max-tokens 32 --rounds 1)
    peers=(--n 2 --batches 1,2 --max-tokens 8 --rounds 1)
else
    scale=1 device=cuda dtype=bf16 big_ar=llama-3.1-8b big_diffusion=llada-8b big_gemma=diffusiongemma-26b-a4b
    physics=(--budget 0.5 --host-budget 2)
    engines=(--n 20)
    ar_batching=(--concurrency 1,4,16,64 --rounds 1)
    diffusion_batching=(--concurrency 1,8 --rounds 1)
    ar_eager=(--concurrency 1,16 --max-tokens 64 --rounds 1)
    diffusion_eager=(--concurrency 1 --rounds 1)
    peers=(--n 10 --batches 1,8,64 --rounds 1)
fi

timeout 20 "$python" - > "$out/env.json" 2> "$out/env.err" <<'PY'
import json, platform, sys, torch
from importlib import metadata
cuda = torch.cuda.is_available()
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
print(json.dumps({"python": platform.python_version(), "python_executable": sys.executable,
                  "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda": cuda,
                  "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor(),
                  "cpu_threads": torch.get_num_threads(), "torch_file": torch.__file__,
                  "packages": {name: version(name) for name in ("numpy", "pydantic", "fastapi", "typer",
                               "tokenizers", "safetensors", "llguidance", "transformers")}}))
PY
printf 'env\t%s\t0\n' "$?" >> "$out/summary.tsv"

step physics 35 bench physics --device "$device" --json "${physics[@]}"
# spec and grammar-constrained AR run on the CPU only: the GPU run takes the plain entries.
step engines 50 bench engines --device "$device" --only ar,diffusion-reference,diffusion --json "${engines[@]}"
step batching-ar 60 bench batching --model ar --device "$device" --json "${ar_batching[@]}"
step batching-diffusion 60 bench batching --model diffusion --device "$device" --json "${diffusion_batching[@]}"
# The same engines with CUDA Graphs off (on by default with a CUDA device): the graphs' gain, and
# the outputs compared with the runs above (docs/bench.md).
step batching-ar-eager 25 bench batching --model ar --device "$device" --cuda-graphs off --json "${ar_eager[@]}"
step batching-diffusion-eager 20 bench batching --model diffusion --device "$device" --cuda-graphs off --json \
    "${diffusion_eager[@]}"
step shape-ar-$big_ar 55 bench batching --shape "$big_ar" --dtype "$dtype" --concurrency 1,8 \
    --diffusion-concurrency 1,8 --device "$device" --json
step shape-diffusion-$big_diffusion 55 bench batching --shape "$big_diffusion" --dtype "$dtype" --concurrency 1,8 \
    --diffusion-concurrency 1,8 --device "$device" --json
# DiffusionGemma has no AR step: --concurrency is unused, the denoiser runs at each diffusion batch.
step shape-$big_gemma 45 bench batching --shape "$big_gemma" --dtype "$dtype" --concurrency 1 \
    --diffusion-concurrency 1,8 --device "$device" --json
if "$python" -c "import transformers" 2> /dev/null; then
    step peers 45 bench peers --device "$device" --json "${peers[@]}"
else
    printf 'peers\tskipped (no transformers)\t0\n' >> "$out/summary.tsv"
fi
cat "$out/summary.tsv" >&2
# Exit 0 only when every step that ran succeeded.
! awk -F '\t' 'NR > 1 && $2 ~ /^[0-9]+$/ && $2 != 0 { bad = 1 } END { exit !bad }' "$out/summary.tsv"
