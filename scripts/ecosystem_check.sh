#!/usr/bin/env bash
# Training tools that drive DeepSpeed, run unchanged on zerotune: for each TOOL, one virtual environment
# resolved with the tool's own pins, then `zerotune deepspeed-alias install` in it, then the tool's case script
# (scripts/ecosystem/TOOL_case.py) on 2 CPU ranks: its own non-DeepSpeed run, then ZeRO 2 and ZeRO 3 through its
# DeepSpeed path, logged losses compared. One line per tool:
#
#   TOOL VERSION: ZeRO 2 <ok|FAILED: why|MISMATCH: ...> | ZeRO 3 <...> | max rel loss diff vs non-DeepSpeed R (methods)
#   TOOL VERSION: NOT INSTALLABLE: <each pin that contradicts zerotune's bounds or this torch | what is never installed
#                 here yet imported on the case's path>
#
#   scripts/ecosystem_check.sh [--fresh] TOOL...        TOOL: trl, ray, llamafactory, axolotl, lightning, accelerate
#
# The tool's version is the registry's pin below; TOOL_VERSION=latest (e.g. TRL_VERSION=latest) or
# TRL_VERSION=1.15.0 picks another. The venv sees this checkout (zerotune) and this environment's site-packages
# through a .pth file, after its own site-packages: what the tool's requirements need (pip's resolver, run on the
# tool's requirements with this torch and zerotune's bounds, pyproject.toml, as constraints) is installed into the
# venv and shadows this environment's version; what this environment already meets is used as it is. Never
# installed: torch (this environment's), DeepSpeed (the alias stands in), CUDA-only packages (NEVER below; one a
# tool's case merely imports, IMPORT_ONLY below, is installed --no-deps where it imports cleanly here), and
# torchvision / torchaudio where no release is built for this torch. A tool is NOT INSTALLABLE only where its
# pins contradict zerotune's bounds or this torch (pip's conflict, each pin named), or where its case imports a
# package that is never installed here (the case's ModuleNotFoundError, with the importing file:line).
# Work directory: ${ECOSYSTEM_DIR:-${TMPDIR:-/tmp}/zerotune-ecosystem}/TOOL (the venv, pip.log, resolve/ with the
# resolver's input and report, run/ with the case's outputs, failures.log with the ranks' output of a failed
# mode); --fresh rebuilds the venv.
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
# Never installed into a tool's venv, whatever it asks for: torch (this environment's), DeepSpeed (the alias stands
# in), CUDA-only packages. TORCH_BUILT: installed only where a release built for this torch exists.
NEVER='^(torch|deepspeed|triton|vllm|xformers|flash[-_]attn|bitsandbytes|nvidia-.*|liger[-_]kernel)$'
TORCH_BUILT='^(torchvision|torchaudio)$'
# TOOL -> the CUDA-bound packages of NEVER that its case only imports (the kernels they serve are switched off by the
# case): installed as the tool asks (--no-deps: nothing else comes with them) and kept only where the package imports
# cleanly on this machine and names neither torch nor deepspeed among its own requirements; else skipped as the rest
# of NEVER. Never torch or deepspeed themselves.
#   axolotl: triton. axolotl imports it at module level on `axolotl train`'s path
#   (axolotl/monkeypatch/trainer/utils.py:17); its Triton LoRA kernels are off in the case; triton's wheel imports
#   on a CPU-only machine.
declare -A IMPORT_ONLY=(
  [axolotl]="triton"
)

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 2; }
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

make_venv() {  # make_venv DIR: a venv that also sees this checkout and this environment's site-packages, in that
  local dir=$1  # order, both after the venv's own site-packages (a .pth file's lines follow the directory it is in)
  [ -x "$dir/bin/python" ] || "$python" -m venv --without-pip "$dir" || return 1
  local outer inner
  outer=$("$python" -c 'import site; print("\n".join(site.getsitepackages()))')
  inner=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n%s\n' "$here" "$outer" > "$inner/_zerotune_ecosystem_outer.pth"
  # torch's console script, as a venv with torch installed has it (a tool's CLI that starts `torchrun` finds it
  # on PATH and its ranks run in the venv)
  printf '#!/bin/sh\nexec "%s" -m torch.distributed.run "$@"\n' "$dir/bin/python" > "$dir/bin/torchrun"
  chmod +x "$dir/bin/torchrun"
}

requested() {  # requested TOOL: the version asked for (TOOL_VERSION overrides the registry's pin)
  local package pinned override_var="${1^^}_VERSION"
  read -r package pinned <<< "${REGISTRY[$1]}"
  echo "${!override_var:-$pinned}"
}

pip_in() {  # pip_in VENV ARGS...: pip (this environment's, run by the venv's python) into the venv, logged
  local venv=$1; shift
  echo "+ pip $*" >> "$venv/pip.log"
  "$venv/bin/python" -m pip --disable-pip-version-check "$@" >> "$venv/pip.log" 2>&1
}

split_requirements() {  # split_requirements VENV PACKAGE: the installed PACKAGE's requirements (markers evaluated in
  # the venv, no extras) into VENV/resolve/requirements.txt, those of NEVER / TORCH_BUILT into never.txt; and
  # constraints.txt: this torch and zerotune's bounds (pyproject.toml: its dependencies and the hf extra)
  "$1/bin/python" - "$2" "$here/pyproject.toml" "$1/resolve" "$NEVER" "$TORCH_BUILT" <<'EOF'
import importlib.metadata as md, re, sys, tomllib
from pathlib import Path
from packaging.requirements import Requirement
package, pyproject, out, never, torch_built = sys.argv[1:]
out = Path(out)
out.mkdir(exist_ok=True)
keep, skip = [], []
for line in md.requires(package) or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    (skip if re.match(never, name) or re.match(torch_built, name) else keep).append(f"{req.name}{req.specifier}")
project = tomllib.loads(Path(pyproject).read_text())["project"]
bounds = [Requirement(spec) for spec in project["dependencies"] + project["optional-dependencies"]["hf"]]
constraints = [f"torch=={md.version('torch')}"] + [f"{r.name}{r.specifier}" for r in bounds
                                                 if r.name != "torch" and str(r.specifier)]
(out / "requirements.txt").write_text("".join(f"{r}\n" for r in keep))
(out / "never.txt").write_text("".join(f"{r}\n" for r in skip))
(out / "constraints.txt").write_text("".join(f"{c}\n" for c in constraints))
EOF
}

conflict() {  # conflict TOOL LOG: pip's "The conflict is caused by" lines, the tool's and zerotune's pins named
  sed -n '/The conflict is caused by:/,/^ *$/p' "$2" | sed '1d;/^ *$/d;s/^ *//' |
    sed "s/^The user requested (constraint) /zerotune: /;s/^The user requested /$1 requires /" | sort -u |
    paste -sd ';' | sed 's/;/; /g'
}

install_tool() {  # install_tool TOOL VENV: prints the installed version, or "NOT INSTALLABLE: why" and fails
  local tool=$1 venv=$2 package version spec name req why res=$2/resolve
  read -r package _ <<< "${REGISTRY[$tool]}"
  version=$(requested "$tool")
  spec=$package; [ "$version" = latest ] || spec="$package==$version"
  : > "$venv/pip.log"
  if ! pip_in "$venv" install -q --no-deps "$spec"; then
    echo "NOT INSTALLABLE: pip install --no-deps $spec failed: $(grep -m1 -i error "$venv/pip.log")"; return 1
  fi
  split_requirements "$venv" "$package" || { echo "NOT INSTALLABLE: could not read $package's requirements"; return 1; }
  # torchvision / torchaudio: resolved with the rest where a release built for this torch exists; else, like
  # NEVER, skipped (skipped.txt: "name: requirement (why)")
  : > "$res/skipped.txt"
  while IFS= read -r req; do
    name=$(sed 's/[<>=!~; ].*//' <<< "$req")
    if [[ ${name,,} =~ $TORCH_BUILT ]]; then
      if pip_in "$venv" install -q --dry-run "$req" -c "$res/constraints.txt"; then
        echo "$req" >> "$res/requirements.txt"
      else
        echo "$name: $req (no release for $(head -n1 "$res/constraints.txt"))" >> "$res/skipped.txt"
      fi
    else
      echo "$name: $req (never installed here)" >> "$res/skipped.txt"
    fi
  done < "$res/never.txt"
  # the tool's pins resolved against this torch and zerotune's bounds; what this environment meets is kept
  if ! pip_in "$venv" install -q --dry-run --report "$res/report.json" -r "$res/requirements.txt" \
       -c "$res/constraints.txt"; then
    why=$(conflict "$package" "$venv/pip.log")
    echo "NOT INSTALLABLE: ${why:-pip could not resolve its requirements: $(grep -m1 ERROR "$venv/pip.log")}"; return 1
  fi
  # what the resolver picked, less what is never installed (a dependency's dependency: into skipped.txt too)
  "$venv/bin/python" - "$res" "$NEVER" <<'EOF' || return 1
import json, re, sys
from pathlib import Path
res, never = Path(sys.argv[1]), sys.argv[2]
picked = [(item["metadata"]["name"], item["metadata"]["version"])
          for item in json.loads((res / "report.json").read_text())["install"]]
is_never = lambda name: re.match(never, re.sub(r"[-_.]+", "-", name).lower())
with open(res / "skipped.txt", "a") as handle:
    handle.writelines(f"{n}: {n}=={v} (a dependency's; never installed here)\n" for n, v in picked if is_never(n))
(res / "install.txt").write_text("".join(f"{n}=={v}\n" for n, v in picked if not is_never(n)))
EOF
  if [ -s "$res/install.txt" ] && ! pip_in "$venv" install -q --no-deps -r "$res/install.txt"; then
    echo "NOT INSTALLABLE: pip install --no-deps of the resolved set failed: $(grep -m1 ERROR "$venv/pip.log")"
    return 1
  fi
  import_only "$tool" "$venv" || return 1
  # a torchvision / torchaudio release that requires this torch's version may still be built for another variant
  # of it (CUDA wheels against a CPU torch): one that does not import here is removed again and skipped
  for name in $(grep -ioE "^(${TORCH_BUILT:2:-2})" "$res/requirements.txt"); do
    if ! why=$("$venv/bin/python" -c "import $name" 2>&1); then
      req="$name==$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$name'))")"
      pip_in "$venv" uninstall -y "$name"
      echo "$name: $req (does not load against torch $(sed -n 's/^torch==//p' "$res/constraints.txt"): $(tail -n1 <<< "$why" | sed 's#/[^ ]*/##g'))" >> "$res/skipped.txt"
    fi
  done
  "$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$package'))"
}

import_only() {  # import_only TOOL VENV: TOOL's IMPORT_ONLY packages installed (--no-deps) as skipped.txt's
  # requirement names them, and taken out of skipped.txt where one imports cleanly and requires no torch / deepspeed
  # (import_only.txt lists them); one that does not is uninstalled again and stays skipped, with why
  local name req why res=$2/resolve
  local check='import importlib, importlib.metadata as md, re, sys
from packaging.requirements import Requirement
name = sys.argv[1]
pulls = [r for r in md.requires(name) or []
         if re.sub(r"[-_.]+", "-", Requirement(r).name).lower() in ("torch", "deepspeed")]
if pulls:
    raise SystemExit("it requires " + ", ".join(pulls))
importlib.import_module(name.replace("-", "_"))'
  : > "$res/import_only.txt"
  for name in ${IMPORT_ONLY[$1]:-}; do
    [[ ${name,,} =~ ^(torch|deepspeed)$ ]] && { echo "NOT INSTALLABLE: IMPORT_ONLY names $name"; return 1; }
    req=$(grep -i -m1 "^$name:" "$res/skipped.txt" | sed 's/^[^:]*: //;s/ (.*//')
    [ -n "$req" ] || continue  # not asked for
    if ! pip_in "$2" install -q --no-deps "$req"; then
      why="import-only; pip install --no-deps failed: $(grep -m1 ERROR "$2/pip.log")"
    elif ! why=$("$2/bin/python" -c "$check" "$name" 2>&1); then
      why="import-only; not kept: $(tail -n1 <<< "$why" | sed 's#/[^ ]*/##g')"
    else
      why=
    fi
    if [ -n "$why" ]; then
      pip_in "$2" uninstall -y "$name"
      sed -i "s|^\($name: [^(]*\)(.*|\1($why)|I" "$res/skipped.txt"
    else
      sed -i "/^$name:/Id" "$res/skipped.txt"
      echo "$name: $req -> $name==$("$2/bin/python" -c "import importlib.metadata as m; print(m.version('$name'))") (imports here)" >> "$res/import_only.txt"
    fi
  done
}

never_imported() {  # never_imported VENV LINE: "NOT INSTALLABLE: ..." where the case stopped importing a package
  # that is never installed here (skipped.txt says why), else nothing
  local module name why where while
  module=$(sed -n "s/.*No module named '\([A-Za-z0-9_]*\).*/\1/p" <<< "$2" | head -n1)
  [ -n "$module" ] || return 0
  name=${module//_/-}
  why=$(grep -i -m1 "^$name:" "$1/resolve/skipped.txt" 2>/dev/null | sed 's/^[^:]*: //')
  [ -n "$why" ] || [[ ! ${name,,} =~ $NEVER ]] || why="never installed here"
  [ -n "$why" ] || return 0
  where=$(sed -n 's/.*\[File "\([^"]*\)", line \([0-9]*\).*/\1:\2/p' <<< "$2" | head -n1 | sed 's#.*/site-packages/##')
  while=$(sed -n 's/.*(while: \([^)]*\)).*/\1/p' <<< "$2" | head -n1)
  echo "NOT INSTALLABLE: its case imports $module${where:+ (at $where${while:+; while: $while})}: $why"
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
  line=$(cd "$venv" && PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv" ECOSYSTEM_LOG="$venv/failures.log" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \
         "$venv/bin/python" "$here/scripts/ecosystem/${tool}_case.py" --line --workdir "$venv/run" 2> "$venv/driver.log")
  rc=$?
  if [ $rc -ne 0 ] || [ -z "$line" ]; then
    echo "$tool $version: case script failed (exit $rc): $(grep -v '^\s*$' "$venv/driver.log" | tail -n1)"; status=1
    continue
  fi
  if never=$(never_imported "$venv" "$line") && [ -n "$never" ]; then line="$tool $version: $never"; fi
  echo "$line"
  [[ $line == *"ZeRO 2 ok | ZeRO 3 ok"* ]] || status=1
done
exit $status
