#!/usr/bin/env bash
# Training tools that drive DeepSpeed, run unchanged on zerotune: for each TOOL, one virtual environment
# with the tool installed next to this environment's packages (torch, transformers, accelerate, zerotune:
# seen through a .pth file, never reinstalled) and `zerotune deepspeed-alias install`, then the tool's case
# script (scripts/ecosystem/TOOL_case.py) on 2 CPU ranks: its own non-DeepSpeed run, then ZeRO 2 and ZeRO 3
# through its DeepSpeed path, logged losses compared. One line per tool:
#
#   TOOL VERSION: ZeRO 2 <ok|FAILED: why|MISMATCH: ...> | ZeRO 3 <...> | max rel loss diff vs non-DeepSpeed R (methods)
#   TOOL VERSION: NOT INSTALLABLE: <the pin that conflicts with this environment / zerotune's bounds>
#
#   scripts/ecosystem_check.sh [--fresh] TOOL...        TOOL: trl, ray, llamafactory, axolotl, lightning, accelerate
#
# The tool's version is the registry's pin below; TOOL_VERSION=latest (e.g. TRL_VERSION=latest) or
# TRL_VERSION=1.15.0 picks another. The tool is installed with --no-deps; what `pip check` then finds
# missing is installed with --no-deps too (pure-Python packages only: torch, CUDA wheels and DeepSpeed are
# never installed); a requirement this environment does not meet is printed as the conflicting pin, with
# zerotune's own bound for that package (pyproject.toml), and the tool is not run.
# Work directory: ${ECOSYSTEM_DIR:-${TMPDIR:-/tmp}/zerotune-ecosystem}/TOOL (the venv, run/ with the case's
# outputs, failures.log with the ranks' output of a failed mode); --fresh rebuilds the venv.
#
# Adding a tool: a registry line below (pip name, pinned version) and scripts/ecosystem/TOOL_case.py, a
# driver that prints the line above with --line (scripts/ecosystem/common.py does the launching,
# comparing and printing).
set -uo pipefail

# TOOL -> "pip-name pinned-version"
declare -A REGISTRY=(
  [trl]="trl 1.16.0"
  [ray]="ray 2.60.0"
  [llamafactory]="llamafactory 0.9.5"
  [axolotl]="axolotl 0.19.0"
  [lightning]="lightning 2.6.6"
  [accelerate]="accelerate 1.16.0"
)
# Never installed into a tool's venv, whatever it asks for (heavy, CUDA-bound, or what zerotune stands in for).
NEVER='^(torch|torchvision|torchaudio|triton|deepspeed|vllm|xformers|flash[-_]attn|bitsandbytes|nvidia-.*|liger[-_]kernel)$'

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
fresh=0 tools=()
while [ $# -gt 0 ]; do
  case "$1" in
    --fresh) fresh=1; shift ;;
    -h|--help) usage ;;
    -*) echo "ecosystem_check: unknown option $1" >&2; usage ;;
    *) tools+=("$1"); shift ;;
  esac
done
[ ${#tools[@]} -ge 1 ] || usage

here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
work=${ECOSYSTEM_DIR:-${TMPDIR:-/tmp}/zerotune-ecosystem}

make_venv() {  # make_venv DIR: a venv that also sees this environment's site-packages and this checkout
  local dir=$1
  [ -x "$dir/bin/python" ] || "$python" -m venv --without-pip "$dir" || return 1
  local outer inner
  outer=$("$python" -c 'import site; print("\n".join(site.getsitepackages()))')
  inner=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n%s\n' "$outer" "$here" > "$inner/_zerotune_ecosystem_outer.pth"
}

zerotune_bound() {  # zerotune_bound PACKAGE: zerotune's own requirement on it (pyproject.toml), if any
  "$python" - "$1" "$here/pyproject.toml" <<'EOF'
import re, sys
name = re.sub(r"[-_.]+", "-", sys.argv[1]).lower()
for spec in re.findall(r'"([A-Za-z0-9_.\-\[\]]+[^"]*)"', open(sys.argv[2]).read()):
    head = re.match(r"[A-Za-z0-9_.\-]+", spec)
    if head and re.sub(r"[-_.]+", "-", head.group(0)).lower() == name:
        print(spec); break
EOF
}

requested() {  # requested TOOL: the version asked for (TOOL_VERSION overrides the registry's pin)
  local package pinned override_var="${1^^}_VERSION"
  read -r package pinned <<< "${REGISTRY[$1]}"
  echo "${!override_var:-$pinned}"
}

new_problems() {  # new_problems VENV: what `pip check` finds in the venv that it does not find out here
  local outer
  outer=$("$python" -m pip check --disable-pip-version-check 2>&1)
  "$1/bin/python" -m pip check --disable-pip-version-check 2>&1 | grep -vxF -e "No broken requirements found." \
    -f <(printf '%s\n' "$outer") || true
}

install_tool() {  # install_tool TOOL VENV: prints the installed version, or "NOT INSTALLABLE: why" and fails
  local tool=$1 venv=$2 package version spec vpy=$2/bin/python
  read -r package _ <<< "${REGISTRY[$tool]}"
  version=$(requested "$tool")
  spec=$package; [ "$version" = latest ] || spec="$package==$version"
  if ! "$vpy" -m pip install -q --no-deps --disable-pip-version-check "$spec" > "$venv/pip.log" 2>&1; then
    echo "NOT INSTALLABLE: pip install --no-deps $spec failed: $(grep -m1 -i error "$venv/pip.log")"; return 1
  fi
  local round problems missing conflicts name line out bound
  for round in 1 2 3 4 5; do  # missing dependencies, then theirs
    problems=$(new_problems "$venv")
    missing=$(sed -n 's/^.* requires \([A-Za-z0-9_.\-]*\), which is not installed\.$/\1/p' <<< "$problems" | sort -u)
    # every pin this environment does not meet, before anything else is installed: "X 1.0 has requirement
    # transformers>=4.56, but you have transformers 4.46.0." (only the tool's tree), and what it requires
    # that is never installed here
    out=""
    conflicts=$(grep ' has requirement ' <<< "$problems" || true)
    while IFS= read -r line; do
      [ -n "$line" ] || continue
      name=$(sed -n 's/^.* has requirement \([A-Za-z0-9_.\-]*\).*$/\1/p' <<< "$line")
      bound=$(zerotune_bound "$name" || true)
      out+="${out:+; }${line%.}${bound:+ (zerotune: $bound)}"
    done <<< "$conflicts"
    for name in $missing; do
      [[ ${name,,} =~ $NEVER ]] && out+="${out:+; }$(grep -m1 "requires $name," <<< "$problems" | sed 's/\.$//') (never installed here)"
    done
    [ -z "$out" ] || { echo "NOT INSTALLABLE: $out"; return 1; }
    [ -n "$missing" ] || break
    for name in $missing; do
      "$vpy" -m pip install -q --no-deps --disable-pip-version-check "$name" >> "$venv/pip.log" 2>&1 ||
        { echo "NOT INSTALLABLE: pip install --no-deps $name (a dependency) failed"; return 1; }
    done
  done
  "$vpy" -c "import importlib.metadata as m; print(m.version('$package'))"
}

status=0
for tool in "${tools[@]}"; do
  if [ -z "${REGISTRY[$tool]+x}" ] || [ ! -f "$here/scripts/ecosystem/${tool}_case.py" ]; then
    echo "$tool: unknown tool (known: ${!REGISTRY[*]})"; status=1; continue
  fi
  venv=$work/$tool
  [ "$fresh" = 1 ] && rm -rf "$venv"
  mkdir -p "$work"
  if ! make_venv "$venv"; then echo "$tool: could not make a venv at $venv"; status=1; continue; fi
  if ! version=$(install_tool "$tool" "$venv"); then
    echo "$tool $(requested "$tool"): $version"; status=1; continue
  fi
  if ! alias_out=$("$venv/bin/python" -m zerotune.cli.main deepspeed-alias install 2>&1); then
    echo "$tool $version: deepspeed-alias install failed: $(tail -n1 <<< "$alias_out")"; status=1; continue
  fi
  rm -rf "$venv/run" "$venv/failures.log"
  line=$(cd "$venv" && ECOSYSTEM_LOG="$venv/failures.log" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \
         "$venv/bin/python" "$here/scripts/ecosystem/${tool}_case.py" --line --workdir "$venv/run" 2> "$venv/driver.log")
  rc=$?
  if [ $rc -ne 0 ] || [ -z "$line" ]; then
    echo "$tool $version: case script failed (exit $rc): $(grep -v '^\s*$' "$venv/driver.log" | tail -n1)"; status=1
    continue
  fi
  echo "$line"
  [[ $line == *"ZeRO 2 ok | ZeRO 3 ok"* ]] || status=1
done
exit $status
