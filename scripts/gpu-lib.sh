# Shared by scripts/gpu-check.sh and scripts/gpu-train.sh (sourced with the script's arguments):
# OUT_DIR (`out`) and --cpu-smoke or NOWAIT_CPU_SMOKE=1 (`smoke`); the interpreter that runs nowait
# (the device's, or a venv built from the wheels that scripts/gpu-wheels.sh put in .gpu-wheels/);
# OUT_DIR/summary.tsv; and `step`, which runs one `nowait` command under its own timeout (times
# `scale`), its JSON kept and its exit status recorded.
# NOWAIT_GPU_CHECK_ONLY=NAME,NAME runs only those steps (the others are listed as skipped).
if [ $# -lt 1 ]; then
    echo "usage: scripts/$(basename "$0") OUT_DIR [--cpu-smoke]" >&2
    exit 2
fi
out=$1
smoke=${NOWAIT_CPU_SMOKE:-0}
[ "${2:-}" = "--cpu-smoke" ] && smoke=1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
[ -x "$root/.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && python="$root/.venv/bin/python"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
printf 'step\texit\tseconds\n' > "$out/summary.tsv"

# The device has torch with CUDA but may lack nowait's other packages, and no network: when
# `import nowait.cli` fails, install the wheels scripts/gpu-wheels.sh put in .gpu-wheels/ (carried
# with the run) into a venv that also sees the device's own packages, its CUDA torch first of all.
# NOWAIT_GPU_WHEELS names another folder; NOWAIT_GPU_FORCE_WHEELS=1 installs even when the import
# works (to check this path on a machine that has everything).
wheels=${NOWAIT_GPU_WHEELS:-$root/.gpu-wheels}
venv=${NOWAIT_GPU_VENV:-/tmp/nowait-gpu-venv}
install_wheels() {
    rm -rf "$venv"
    "$python" -m venv --system-site-packages "$venv" || "$python" -m venv --system-site-packages --without-pip "$venv" \
        || return
    # --system-site-packages reaches the base interpreter's packages only; the device's python3 is
    # itself a venv (its torch in that venv), so its site folders are added after the new venv's.
    local site
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return
    "$python" -c 'import site; print("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages()))' \
        > "$site/device-site.pth" || return
    local pip=("$venv/bin/python" -m pip)
    "${pip[@]}" --version > /dev/null 2>&1 || pip=("$python" -m pip --python "$venv/bin/python")
    "${pip[@]}" install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --find-links "$wheels" "$wheels"/*.whl || return
    # The editable install gives nowait its metadata; with src/ on PYTHONPATH the benches run without it.
    "${pip[@]}" install -q --no-index --no-deps --no-build-isolation --no-cache-dir --disable-pip-version-check \
        -e "$root" || echo "$(basename "$0" .sh): the editable install of nowait failed; src/ on PYTHONPATH serves" >&2
    "$venv/bin/python" -c "import nowait.cli"
}
# A venv an earlier call on the same (still warm) machine built is used as it is: the second of the
# two prepared runs saves the install's minute.
if [ "${NOWAIT_GPU_FORCE_WHEELS:-0}" != 1 ] && ! "$python" -c "import nowait.cli" 2> /dev/null \
        && [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import nowait.cli" 2> /dev/null; then
    python="$venv/bin/python"
    printf 'wheels\treused %s\t0\n' "$venv" >> "$out/summary.tsv"
elif [ "${NOWAIT_GPU_FORCE_WHEELS:-0}" = 1 ] || ! "$python" -c "import nowait.cli" 2> "$out/wheels.err"; then
    started=$SECONDS
    if compgen -G "$wheels/*.whl" > /dev/null; then
        # Its own limit, outside the steps' 480 s: the device call's timeout_s (590, docs/bench.md) holds both.
        export root python venv wheels
        export -f install_wheels
        timeout --kill-after=5 90 bash -c install_wheels >> "$out/wheels.err" 2>&1 && python="$venv/bin/python"
        printf 'wheels\t%s\t%s\n' "$?" "$((SECONDS - started))" >> "$out/summary.tsv"
    else
        echo "$(basename "$0" .sh): nowait does not import with $python and $wheels holds no wheels (scripts/gpu-wheels.sh)" >&2
        printf 'wheels\tskipped (no wheels)\t0\n' >> "$out/summary.tsv"
    fi
fi

only=${NOWAIT_GPU_CHECK_ONLY:-}
step() {  # step NAME TIMEOUT_S ARGS...: one `nowait` command, its JSON kept, its exit status recorded
    local name=$1 limit=$2
    shift 2
    if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then
        printf '%s\tskipped (not in NOWAIT_GPU_CHECK_ONLY)\t0\n' "$name" >> "$out/summary.tsv"
        return
    fi
    local started=$SECONDS
    timeout --kill-after=10 "$((limit * scale))" "$python" -m nowait.cli "$@" > "$out/$name.json" 2> "$out/$name.err"
    local status=$?
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - started))" >> "$out/summary.tsv"
    echo "$name: exit $status in $((SECONDS - started)) s" >&2
}

