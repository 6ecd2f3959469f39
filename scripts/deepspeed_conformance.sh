#!/usr/bin/env bash
# DeepSpeed's own unit tests (tests/unit of a DeepSpeed checkout, fetched outside this repository) run
# through zerotune's `deepspeed` alias, and -- with --baseline VERSION -- the same tests against the real
# DeepSpeed VERSION on the same machine; one JUnit file per test module and side, then one table.
#
#   scripts/deepspeed_conformance.sh DS_REPO [--baseline VERSION] [--timeout SECONDS] [--report-only]
#                                    [--deselect TEST_ID]... [PATTERN...]
#
# DS_REPO is a directory holding tests/unit (a checkout, or `git archive TAG tests | tar -x -C DIR`); use
# the tests of the DeepSpeed release given to --baseline. PATTERNs select modules by path under tests/unit
# (shell globs, e.g. 'runtime/zero/*' 'checkpoint/*'); none selects every module. Each module runs in its
# own pytest process under `timeout` (default 900 s): a hang costs one module, not the run. --deselect TEST_ID
# (pytest's, repeatable, applied on both sides; the id as the log prints it, e.g.
# 'v1/zero/test_zero.py::TestX::test[1]') leaves out a test that makes DeepSpeed's harness wait until the limit --
# one expecting an exception the side under test does not raise -- so the rest of its module gets a result.
#
# Both sides keep DeepSpeed's own pytest.ini (its marker filter: no nightly, sequential or inference
# tests, as DeepSpeed's CPU CI runs them). Both sides run on CPU with LOCAL_SIZE=4, which DeepSpeed's
# CPU accelerator and zerotune's both read
# as the device count, so the 2- and 4-process tests run instead of skipping. The tests are copied into
# the work directory so no DeepSpeed source tree sits beside them: the zerotune side imports only the
# alias (a fresh venv with `zerotune deepspeed-alias install`), the baseline only the installed wheel.
# Both venvs see this environment's packages (torch, transformers, pytest, zerotune) through a .pth file.
# Harness-only packages: DeepSpeed's tests import a few of DeepSpeed's own dependencies directly (hjson, for
# runtime/test_ds_config_dict.py); the DeepSpeed venv has them from the wheel, and the script pip-installs them
# into the zerotune venv alone (never into this environment), so they stay out of zerotune's dependencies.
# Work directory: $CONFORMANCE_DIR (default ${TMPDIR:-/tmp}/zerotune-conformance); results/ keeps the XML.
set -uo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }  # the header
[ $# -ge 1 ] || usage
ds_repo=$1; shift
baseline="" timeout_s=900 report_only=0 patterns=() deselect=()
while [ $# -gt 0 ]; do
  case "$1" in
    --baseline) baseline=${2:?--baseline needs a DeepSpeed version, e.g. 0.19.5}; shift 2 ;;
    --timeout) timeout_s=${2:?--timeout needs seconds}; shift 2 ;;
    --report-only) report_only=1; shift ;;
    # a test id as the log prints it (relative to tests/unit); pytest's node ids start at tests/ (pytest.ini's dir)
    --deselect) deselect+=(--deselect "unit/${2:?--deselect needs a test id, e.g. v1/zero/test_zero.py::TestX::test[1]}"); shift 2 ;;
    -h|--help) usage ;;
    *) patterns+=("$1"); shift ;;
  esac
done
[ -d "$ds_repo/tests/unit" ] || { echo "deepspeed_conformance: no tests/unit under '$ds_repo' (give a DeepSpeed checkout)" >&2; exit 2; }

here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
work=${CONFORMANCE_DIR:-${TMPDIR:-/tmp}/zerotune-conformance}
harness_packages=(hjson)  # import name = PyPI name for each
mkdir -p "$work/results"

make_venv() {  # make_venv DIR [pip]: a venv (with pip if asked) that also sees this environment's site-packages
  local dir=$1 pip_flag="--without-pip"
  [ "${2:-}" = pip ] && pip_flag=""
  [ -x "$dir/bin/python" ] || "$python" -m venv $pip_flag "$dir" || return 1
  local outer inner
  outer=$("$python" -c 'import site, sys; print("\n".join(site.getsitepackages()))')
  inner=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n%s\n' "$outer" "$here" > "$inner/_zerotune_conformance_outer.pth"
}

if [ "$report_only" = 0 ]; then
  rm -rf "$work/tests" && cp -r "$ds_repo/tests" "$work/tests"
  make_venv "$work/zerotune" || exit 1
  "$work/zerotune/bin/python" -m zerotune.cli.main deepspeed-alias install || exit 1
  for package in "${harness_packages[@]}"; do  # see the header: for DeepSpeed's tests, not for zerotune
    "$work/zerotune/bin/python" -c "import $package" 2>/dev/null && continue
    "$python" -m pip install -q --disable-pip-version-check --no-deps \
      --target "$("$work/zerotune/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
      "$package" || echo "deepspeed_conformance: could not install '$package'; modules importing it will not collect" >&2
  done
  sides=(zerotune)
  if [ -n "$baseline" ]; then
    make_venv "$work/deepspeed" pip || exit 1
    if ! "$work/deepspeed/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '$baseline')" 2>/dev/null; then
      "$work/deepspeed/bin/pip" install -q wheel setuptools &&
        DS_BUILD_OPS=0 "$work/deepspeed/bin/pip" install -q --no-build-isolation "deepspeed==$baseline" || exit 1
    fi
    sides+=(deepspeed)
  fi

  cd "$work/tests/unit" || exit 1
  mapfile -t modules < <(find . -name 'test_*.py' | sed 's|^\./||' | sort)
  for module in "${modules[@]}"; do
    if [ ${#patterns[@]} -gt 0 ]; then
      keep=0; for p in "${patterns[@]}"; do [[ $module == $p ]] && keep=1; done
      [ $keep = 1 ] || continue
    fi
    for side in "${sides[@]}"; do
      xml="$work/results/$side/${module%.py}.xml"; mkdir -p "$(dirname "$xml")"; rm -f "$xml"
      start=$(date +%s)
      env LOCAL_SIZE=4 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES="" DS_UNITTEST_TIMEOUT=300 \
        timeout -k 10 "$timeout_s" "$work/$side/bin/python" -m pytest -q -p no:cacheprovider -p no:randomly \
        --junitxml="$xml" "${deselect[@]}" "$module" > "${xml%.xml}.log" 2>&1
      rc=$?
      echo "$rc $(( $(date +%s) - start ))" > "${xml%.xml}.rc"
      printf '%-10s %-60s rc %3s  %4ss\n' "$side" "$module" "$rc" "$(( $(date +%s) - start ))"
    done
  done
fi
"$python" "$here/scripts/conformance_report.py" "$work/results"
