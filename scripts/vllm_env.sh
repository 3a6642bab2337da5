#!/usr/bin/env bash
# Build .venv-vllm-<VERSION>, a virtual environment in which real vLLM's KV-cache core
# (BlockPool, KVCacheManager and friends, the worker BlockTable, kv_events) imports on a
# CPU-only machine, next to kvspec's conformance machinery, for side-by-side benchmarks
# and audits. Usage (from the repo root): bash scripts/vllm_env.sh 0.13.0|0.33.0
#
# vLLM cannot be installed with its dependencies here: they pin a CUDA torch. So the
# recipe (docs/vllm-envs.md) is: the CPU torch first, then
# vllm with --no-deps, then only what importing the core modules needs, with torch held
# in place by a pip constraint. Re-running on a finished environment only checks it.
#
# Environment: PYTHON (interpreter for the venv, default python3), VLLM_WHEEL (a local
# vLLM wheel to install instead of the PyPI release, e.g. a patched fork; VERSION then
# picks which release's dependency pins to use), VLLM_ENV_DIR (venv path override).
set -euo pipefail

readonly TORCH_VERSION="2.13.0"
readonly CORE_MODULES=(
    vllm.v1.core.block_pool
    vllm.v1.core.kv_cache_manager
    vllm.v1.core.kv_cache_utils
    vllm.v1.core.kv_cache_coordinator
    vllm.v1.core.single_type_kv_cache_manager
    vllm.v1.worker.block_table
    vllm.distributed.kv_events
)
# What kvspec's conformance machine needs in the same interpreter.
readonly KVSPEC_PACKAGES=(hypothesis pytest "numpy>=1.26" cbor2 xxhash mypy_extensions)

die() {
    printf 'vllm_env.sh: error: %s\n' "$*" >&2
    exit 2
}

[[ $# -eq 1 ]] || die "usage: bash scripts/vllm_env.sh VERSION   (VERSION: 0.13.0 or 0.33.0)"
readonly VERSION="$1"

# Per-version import closure. RESOLVED: installed with their dependencies (under the
# torch constraint). NO_DEPS: their declared dependencies would drag in torch/CUDA
# builds or packages the imports never touch.
case "$VERSION" in
    0.13.0)
        RESOLVED=(
            packaging psutil numpy pyzmq urllib3 regex msgspec pydantic cbor2
            "transformers>=4.56,<5" aiohttp requests "openai>=1.99.1,<3" pillow pybase64
            cachetools cloudpickle py-cpuinfo prometheus_client fastapi starlette
            gguf blake3 diskcache einops
        )
        NO_DEPS=("openai-harmony>=0.0.3" "xgrammar==0.1.27" "llguidance>=1.3,<1.4")
        ;;
    0.33.0)
        RESOLVED=(
            packaging psutil numpy pyzmq urllib3 regex msgspec pydantic cbor2
            "transformers>=5.16.1,<5.21.0" "aiohttp>=3.14.4" requests "openai>=2.25.0"
            "pillow>=13.0.0" pybase64 cachetools cloudpickle uvloop py-cpuinfo
            prometheus_client "fastapi>=0.133.0,<0.137.0" "starlette>=1.0.1"
            partial-json-parser "apache-tvm-ffi==0.1.11" einops
        )
        NO_DEPS=(oss-harmony "xgrammar==0.2.8" "llguidance>=1.7.0,<1.8.0")
        ;;
    *)
        die "unsupported vLLM version '$VERSION' (known pin sets: 0.13.0, 0.33.0)"
        ;;
esac

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly REPO_ROOT
readonly VENV="${VLLM_ENV_DIR:-$REPO_ROOT/.venv-vllm-$VERSION}"
readonly PY="$VENV/bin/python"
readonly STAMP="$VENV/.kvspec-vllm-env"
readonly LOG="$VENV/kvspec-build.log"
readonly CONSTRAINTS="$VENV/kvspec-constraints.txt"
readonly START_SECONDS="$SECONDS"

step() {
    printf '[vllm-env %s %4ds] %s\n' "$VERSION" "$((SECONDS - START_SECONDS))" "$*"
}

# pip, quietly: the full output goes to the build log, and only a failure shows it.
pip_install() {
    if ! "$PY" -m pip install --disable-pip-version-check --no-input "$@" >>"$LOG" 2>&1; then
        printf 'vllm_env.sh: pip install %s failed; last lines of %s:\n' "$*" "$LOG" >&2
        grep -v 'is ignored: it is neither a file nor a directory' "$LOG" | tail -n 25 >&2
        exit 1
    fi
}

# kvspec itself, editable (edits show at once) and without dependencies (they are above):
# this registers the `kvspec` command and the vLLM plugin entry point, and puts only the
# `kvspec` import package on the path.
install_kvspec() {
    step "installing kvspec (editable, --no-deps) from $REPO_ROOT"
    rm -f "$site_packages/kvspec-repo-root.pth"  # how earlier builds put the repo on the path
    # KVSPEC_PURE_PYTHON=1: no mypyc build here; the checkout's own (make setup) is used.
    # One build in the source tree at a time (tests/tree_build.py says why).
    mkdir -p "$REPO_ROOT/build"
    exec 9> "$REPO_ROOT/build/.tree-build.lock"
    if command -v flock > /dev/null; then flock 9; fi
    KVSPEC_PURE_PYTHON=1 pip_install --quiet --no-deps -e "$REPO_ROOT"
    exec 9>&-
}

check_env() {
    step "checking torch is still the CPU build ${TORCH_VERSION}"
    local torch_version
    torch_version="$("$PY" -W ignore -c 'import torch; print(torch.__version__)')"
    if [[ "$torch_version" != "${TORCH_VERSION}+cpu" ]]; then
        printf 'vllm_env.sh: torch in %s is %s, expected %s+cpu\n' \
            "$VENV" "$torch_version" "$TORCH_VERSION" >&2
        exit 1
    fi
    echo "torch $torch_version"

    step "smoke import of vLLM's KV-cache core and kvspec (VLLM_TARGET_DEVICE=cpu)"
    VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=WARNING "$PY" - "$VERSION" "${CORE_MODULES[@]}" <<'PYEOF'
import importlib
import sys
import time

expected_version, *modules = sys.argv[1:]
started = time.perf_counter()
for name in modules:
    importlib.import_module(name)
elapsed = time.perf_counter() - started

import vllm  # noqa: E402  (already imported above; only read its version)

import hypothesis, mypy_extensions, numpy, pytest  # noqa: E401,E402,F401
import kvspec.impl, kvspec.spec  # noqa: E401,E402,F401  (installed editable, below)

if vllm.__version__ != expected_version:
    print(f"note: vllm reports {vllm.__version__}; the dependency pins are {expected_version}'s")
print(f"vllm {vllm.__version__}: imported {len(modules)} core modules in {elapsed:.1f} s")
PYEOF
}

if [[ -f "$STAMP" && -x "$PY" ]]; then
    step "$VENV exists; checking it (delete it to rebuild)"
    site_packages="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$PY" -c 'import importlib.metadata as m, sys; sys.exit(not any(e.name == "kvspec" for e in m.entry_points(group="vllm.general_plugins")))' \
        || install_kvspec
    check_env
    step "ok"
    exit 0
fi

if [[ ! -x "$PY" ]]; then
    step "creating $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
fi
: >"$LOG"
step "build log: $LOG"

# "+cpu" matches only the CPU build (this machine kind has it in pip's find-links), so a
# machine without it fails here at once instead of downloading a CUDA torch.
step "installing torch==${TORCH_VERSION}+cpu (the CPU build on disk) first"
pip_install --quiet "torch==${TORCH_VERSION}+cpu"
installed_torch="$("$PY" -W ignore -c 'import torch; print(torch.__version__)')"
[[ "$installed_torch" == "${TORCH_VERSION}+cpu" ]] \
    || { echo "vllm_env.sh: pip chose torch $installed_torch, not ${TORCH_VERSION}+cpu" >&2; exit 1; }
# Every later install resolves under this constraint, so nothing can replace torch.
printf 'torch==%s\n' "$installed_torch" >"$CONSTRAINTS"

if [[ -n "${VLLM_WHEEL:-}" ]]; then
    [[ -f "$VLLM_WHEEL" ]] || die "VLLM_WHEEL=$VLLM_WHEEL is not a file"
    step "installing $VLLM_WHEEL (--no-deps, pins of vllm $VERSION)"
    pip_install --quiet --no-deps "$VLLM_WHEEL"
else
    step "downloading and installing vllm==${VERSION} (--no-deps; a wheel of some 300-500 MB)"
    pip_install --quiet --no-deps "vllm==${VERSION}"
fi

step "installing what the core modules import (${#RESOLVED[@]} packages, torch held)"
pip_install --quiet -c "$CONSTRAINTS" "${RESOLVED[@]}"

step "installing ${NO_DEPS[*]} (--no-deps)"
pip_install --quiet --no-deps -c "$CONSTRAINTS" "${NO_DEPS[@]}"

step "installing kvspec's conformance needs: ${KVSPEC_PACKAGES[*]}"
pip_install --quiet -c "$CONSTRAINTS" "${KVSPEC_PACKAGES[@]}"

site_packages="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# vLLM picks its platform at import time; this venv only has CPU torch, so default to cpu
# (an exported VLLM_TARGET_DEVICE still wins).
printf '%s\n' "import os; os.environ.setdefault('VLLM_TARGET_DEVICE', 'cpu')" \
    >"$site_packages/kvspec-vllm-cpu.pth"

install_kvspec

check_env
"$PY" -m pip freeze --disable-pip-version-check >"$VENV/kvspec-freeze.txt" 2>/dev/null
touch "$STAMP"
step "done: $VENV ($(du -sh "$VENV" | cut -f1); packages listed in $VENV/kvspec-freeze.txt)"
