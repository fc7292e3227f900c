# Sourced by the next_call_gpu*.sh scripts (from the repository root on the GPU machine): installs glm53 and the
# carried ml_collections wheel (the machine has no network; its bare `pip` installs for another interpreter, hence
# `python -m pip`), and defines T0, el (elapsed-time echo), LIMIT (the call's seconds, default 560) and R (the
# revision: GLM53_GIT_REVISION).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
LIMIT=${LIMIT:-560}
R=$GLM53_GIT_REVISION
for whl in .whl/ml_collections-*.whl; do [ -e "$whl" ] && python -m pip install -q --no-deps "$whl"; done
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Running pip" | tail -2
