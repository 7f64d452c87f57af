#!/usr/bin/env bash
# Set up a fresh Debian 12 machine and run the demo:
#   1. install the Debian packages flowrun needs (only those missing; sudo if not root),
#   2. PyTorch 2.x, whose libtorch flowrun builds against and the benchmarks' peers run on: a
#      Python you name (PYTHON=/path/to/python, PyTorch >= 2.11), else python3 when its torch is
#      recent enough, else .venv/ in the checkout with requirements.txt (pip; about 2.6 GB of
#      wheels, 4.8 GB installed, 1-2 minutes where PyPI is fast),
#   3. configure and build the flowrun binary into build/ (RelWithDebInfo, ccache if present;
#      the tests are built by scripts/test.sh); with an NVIDIA GPU, nvcc and a CUDA PyTorch, the
#      CUDA build (FLOWRUN_CUDA=ON; FLOWRUN_CUDA=0 or 1 in the environment decides instead),
#   4. make the demo data (scripts/data.sh) and run the demo: graphs/vae.yaml and
#      graphs/dit_base.yaml (trained once each; an interrupted training continues where it
#      stopped), then graphs/hydit_lora.yaml.
# Options: --no-demo (stop after building), BUILD_DIR=... to build elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
# The cores (nproc alone answers $OMP_NUM_THREADS where it is set, and the build would crawl).
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
BUILD_DIR=${BUILD_DIR:-build}
demo=1
for a in "$@"; do
  case $a in
    --no-demo) demo=0 ;;
    *) echo "setup.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

# Each phase's wall time, for the table at the end (phase NAME starts one and ends the last).
phase_names=() phase_secs=() phase_start=$SECONDS
phase() {
  local now=$SECONDS
  [ ${#phase_names[@]} = 0 ] || phase_secs+=($((now - phase_start)))
  phase_start=$now
  [ "$1" = end ] || phase_names+=("$1")
}
phase_table() {
  phase end
  echo "== time by phase (scripts/setup.sh, $(nproc) cores):"
  local total=0 i
  for i in "${!phase_names[@]}"; do
    printf "   %-34s %5d s\n" "${phase_names[$i]}" "${phase_secs[$i]}"
    total=$((total + phase_secs[i]))
  done
  printf "   %-34s %5d s\n" "total" "$total"
}

# ---- 1. Debian packages ---------------------------------------------------------------------
phase "Debian packages (apt)"
packages=(
  g++ cmake make ninja-build ccache pkg-config
  clang libclang-rt-14-dev                  # the sanitizer and fuzzing build (scripts/test.sh, scripts/fuzz.sh)
  python3 python3-venv                      # .venv/ for PyTorch (requirements.txt)
  libtbb-dev libyaml-cpp-dev libspdlog-dev libfmt-dev nlohmann-json3-dev libicu-dev
  libpng-dev libjpeg-dev                    # images: prep images/shapes, image_text_shards
  libsentencepiece-dev                      # sentencepiece_tokenize (T5/mT5), via an isolated shim
  libopenmpi-dev openmpi-bin
  libopenblas0-openmp                       # float32 CPU GEMMs of the linear layers (run.cpu_gemm)
  libgtest-dev libgmock-dev libbenchmark-dev
  graphviz                                  # flowrun dot | dot -Tsvg, and its test
  fortunes                                  # English text for the GPT demo and tests
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
prefix_args=()
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"; }; then
    # A machine that reaches no Debian registry (a GPU machine lent without network): the build's
    # libraries as .deb files fetched elsewhere (scripts/gpu_debs.sh into third_party/debs/,
    # carried here), unpacked into a prefix the build searches; the demo's extras stay missing.
    ls third_party/debs/*.deb > /dev/null 2>&1 ||
      { echo "setup.sh: apt-get could not install ${missing[*]} (and third_party/debs/ holds no .deb files: scripts/gpu_debs.sh fetches them on a machine with apt)" >&2; exit 1; }
    prefix=$BUILD_DIR/prefix
    case $prefix in /*) ;; *) prefix=$PWD/$prefix ;; esac  # CMake and LD_LIBRARY_PATH need it absolute
    if [ ! -f "$prefix/.unpacked" ] || [ ! -f "$prefix/unpack.env" ]; then
      echo "== no apt here: unpacking third_party/debs/ into $prefix"
      mkdir -p "$prefix"
      scripts/gpu_debs.sh unpack "$prefix" > "$prefix/unpack.env" && touch "$prefix/.unpacked"
    fi
    # The search paths of the unpacked tree, as gpu_debs.sh printed them (NAME=VALUE lines).
    while IFS='=' read -r name value; do
      case $name in
        CMAKE_PREFIX_PATH) prefix_args+=(-DCMAKE_PREFIX_PATH="$value") ;;
        LD_LIBRARY_PATH)  # the test binaries' discovery, libicudata
          export LD_LIBRARY_PATH="$value${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
          prefix_args+=(-DCMAKE_LIBRARY_PATH="$value") ;;
        PKG_CONFIG_PATH) export PKG_CONFIG_PATH="$value${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}" ;;
      esac
    done < "$prefix/unpack.env"
    command -v pkg-config > /dev/null || [ ! -x "$prefix/usr/bin/pkgconf" ] || prefix_args+=(-DPKG_CONFIG_EXECUTABLE="$prefix/usr/bin/pkgconf")
  fi
fi

# ---- 2. PyTorch -----------------------------------------------------------------------------
phase "PyTorch (.venv/, pip)"
torch_min=$(sed -n 's/^set(FLOWRUN_TORCH_MIN \([0-9.]*\)).*/\1/p' cmake/torch.cmake)  # its one home
torch_ok() {    # torch_ok PYTHON: it imports a torch >= torch_min
  "$1" -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); \
sys.exit(0 if v >= tuple(int(x) for x in '$torch_min'.split('.')) else 1)" 2> /dev/null
}
if [ -n "${PYTHON:-}" ]; then
  torch_ok "$PYTHON" || { echo "setup.sh: PYTHON=$PYTHON has no PyTorch >= $torch_min (pip install torch, or unset PYTHON for .venv/)" >&2; exit 1; }
  PY=$PYTHON
elif [ ! -x .venv/bin/python ] && command -v python3 > /dev/null && torch_ok python3; then
  PY=$(command -v python3)
  echo "== PyTorch: using $PY's ($(python3 -c 'import torch; print(torch.__version__)'))"
else
  if [ ! -x .venv/bin/python ]; then
    echo "== PyTorch: making .venv/ (python3 -m venv)"
    python3 -m venv .venv
  fi
  PY=$PWD/.venv/bin/python
  # Pinned versions already installed: pip says so without asking the index.
  echo "== PyTorch: pip install -r requirements.txt into .venv/ (the first time about 2.6 GB of wheels)"
  "$PY" -m pip install -q --disable-pip-version-check -r requirements.txt
fi
echo "== PyTorch $("$PY" -c 'import torch; print(torch.__version__)') from $PY"
# A Python of the user's own: say what requirements.txt's other packages it lacks (the tests'
# reference tokenizer, the benchmarks' data loaders); nothing is installed into it.
lacks=$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("numpy", "PIL", "tiktoken", "pyarrow") if u.find_spec(m) is None))')
[ -z "$lacks" ] || echo "== note: $PY lacks $lacks (pip install numpy pillow tiktoken pyarrow): the GPT-2 tokenizer test and the benchmarks need the first three, HunyuanDiT's Arrow data (cmake/arrow.cmake) pyarrow"

# ---- 3. build -------------------------------------------------------------------------------
phase "build (flowrun)"
# The CUDA build where there is a GPU to run it: nvidia-smi sees one, nvcc is found and the
# PyTorch is a CUDA build. NCCL: pip's nvidia package of it where PyTorch brought one.
cuda_args=(-DFLOWRUN_CUDA=OFF)  # said each time: a build folder keeps what it was configured with
want_cuda=${FLOWRUN_CUDA:-auto}
if [ "$want_cuda" = auto ]; then
  want_cuda=0
  if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
    nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2> /dev/null || true)
    if [ -z "$nvcc" ]; then
      echo "== a GPU is here but no nvcc (CUDA toolkit): building for the CPU; install the toolkit for the CUDA build"
    elif [ -z "$("$PY" -c 'import torch; print(torch.version.cuda or "")')" ]; then
      echo "== a GPU is here but $PY's PyTorch is CPU-only: building for the CPU"
    else
      want_cuda=1
    fi
  fi
fi
if [ "$want_cuda" = 1 ]; then
  nvcc=${nvcc:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  nccl_h=$("$PY" -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2> /dev/null |
    xargs -r -I{} find {} -name nccl.h -path '*/include/*' 2> /dev/null | head -1 || true)
  cuda_args=(-DFLOWRUN_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" ${nccl_h:+-DFLOWRUN_NCCL_ROOT="$(dirname "$(dirname "$nccl_h")")"})
  echo "== the CUDA build (FLOWRUN_CUDA=ON, nvcc $nvcc${nccl_h:+, NCCL from the pip package nvidia-nccl})"
fi
gen=()
[ -f "$BUILD_DIR/CMakeCache.txt" ] || ! command -v ninja > /dev/null || gen=(-G Ninja)
echo "== building flowrun in $BUILD_DIR (the tests: scripts/test.sh)"
# CMAKE_ARGS: more -D settings (tests/gpu/run.sh: -DFLOWRUN_BENCH=OFF).
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFLOWRUN_PYTHON="$PY" "${cuda_args[@]}" \
  "${prefix_args[@]}" ${CMAKE_ARGS:-} \
  > "$BUILD_DIR.cmake.log" 2>&1 || { cat "$BUILD_DIR.cmake.log"; exit 1; }
rm -f "$BUILD_DIR.cmake.log"
cmake --build "$BUILD_DIR" -j "$CORES" --target flowrun

# ---- 4. data and the demo -------------------------------------------------------------------
phase "data (scripts/data.sh)"
echo "== data: GPT-2 BPE files, fortunes token shards, the shapes image sets (data/)"
PYTHON=$PY scripts/data.sh "$BUILD_DIR/engine/flowrun"

if [ $demo = 1 ]; then
  B="$BUILD_DIR/engine/flowrun"
  # The HunyuanDiT-style LoRA demo in latent space (README): the VAE and the base DiT, each
  # trained to its graph's last step once (run.resume=auto: the first time from step 1; after an
  # interruption, Ctrl-C included, from its last checkpoint; when finished, nothing to do), then
  # the LoRA fine-tune that teaches the base the color purple.
  vae_before=$(cat runs/vae/checkpoints/latest 2> /dev/null || true)
  phase "demo 1/3: the VAE (graphs/vae.yaml)"
  echo "== demo 1/3: flowrun graphs/vae.yaml run.resume=auto (the VAE: 32x32 shapes <-> 4x8x8 latents; trained once)"
  "$B" graphs/vae.yaml run.resume=auto
  if [ "$(cat runs/vae/checkpoints/latest)" != "$vae_before" ] && [ -d runs/dit_base ]; then
    # The VAE trained (further) now, so a base trained before does not fit it: kept, moved aside.
    old=runs/dit_base.before-vae-$(date +%Y%m%d-%H%M%S)
    echo "== the VAE changed: moving the base trained with the earlier one, runs/dit_base, to $old"
    mv runs/dit_base "$old"
  fi
  phase "demo 2/3: the base DiT (dit_base)"
  echo "== demo 2/3: flowrun graphs/dit_base.yaml run.resume=auto (the base DiT on the shapes set, in the VAE's latents; trained once)"
  "$B" graphs/dit_base.yaml run.resume=auto
  phase "demo 3/3: LoRA (graphs/hydit_lora.yaml)"
  echo "== demo 3/3: flowrun graphs/hydit_lora.yaml (LoRA: purple shapes)"
  # A rerun of this script starts the fine-tune over; the earlier one's checkpoints move to
  # runs/hydit_lora/checkpoints.previous-*, its metrics to metrics.previous-*.jsonl.
  "$B" graphs/hydit_lora.yaml run.resume=never
  # What the samples show, checked against the demo's bars (scripts/demo_outcome.py says which):
  # the base draws its own colors, the LoRA taught purple and kept the base's colors.
  outcome=0
  PYTHONDONTWRITEBYTECODE=1 python3 scripts/demo_outcome.py runs || outcome=$?
  echo "== samples: runs/dit_base/samples/, runs/hydit_lora/samples/ (step_0000001.png = the base, the last = after LoRA); VAE reconstructions: runs/vae/recon/"
  echo "== adapters: runs/hydit_lora/checkpoints/latest names the folder; graph: $B dot graphs/hydit_lora.yaml | dot -Tsvg > g.svg"
fi
phase_table
if [ $demo = 1 ] && [ $outcome != 0 ] && [ $outcome != 2 ]; then exit $outcome; fi
