#!/usr/bin/env bash
# DeepSpeed-Chat's training scripts (DeepSpeedExamples/applications/DeepSpeed-Chat, fetched outside this
# repository) run unchanged on zerotune through the `deepspeed` alias, on 2 CPU ranks, with a tiny OPT.
#
#   scripts/deepspeed_chat_check.sh DSCHAT_DIR
#
# DSCHAT_DIR holds dschat/ and training/ (a checkout, or `git archive HEAD applications/DeepSpeed-Chat`).
# Runs step 1 (supervised fine-tuning) and step 2 (reward model) at ZeRO 0, 2 and 3, step 3 (PPO) at
# ZeRO 2 and 3 from step 1's and step 2's ZeRO-2 outputs, and step 3 with --enable_hybrid_engine, each
# through `zerotune run --as-deepspeed --nproc_per_node 2 main.py ...`; prints one line per run: step,
# ZeRO stage, PASS/FAIL, then the final loss (step 1: the loss curve, rank mean per step) or the
# exact error with the line that raised it. Dropout is off (--dropout 0.0), so the stages' losses
# differ only by rounding. Lines starting with '#' say what the environment adapted.
#
# The scripts are copied unmodified into the work directory, because DeepSpeed-Chat's `local/jsonfile`
# dataset reads <DeepSpeed-Chat>/data/{train,eval}.json beside its package; the data (prompt / chosen /
# rejected rows), the tokenizer (byte-level BPE saved as vocab.json + merges.txt, OPT's layout) and
# the model (OPTForCausalLM, hidden 32, 2 layers) are made there. A venv of its own sees this
# environment's packages (torch, transformers, datasets, zerotune) through a .pth file, with
# `zerotune deepspeed-alias install`. DeepSpeed-Chat was written for transformers 4: on transformers 5
# the venv re-exports no_init_weights from transformers.modeling_utils (moved to
# transformers.initialization), and step 3 gets the tokenizer files step 1/2's save_vocabulary no
# longer writes. DSCHAT_DTYPE (default fp16, DeepSpeed-Chat's default; or bf16) picks --dtype.
# Work directory: $DSCHAT_CHECK_DIR (default ${TMPDIR:-/tmp}/zerotune-dschat); logs/ keeps each run's log.
set -uo pipefail

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -eq 1 ] || usage
case "$1" in -h|--help) usage ;; esac
src=$(cd "$1" 2>/dev/null && pwd) || { echo "deepspeed_chat_check: no directory '$1'" >&2; exit 2; }
[ -f "$src/training/step1_supervised_finetuning/main.py" ] && [ -d "$src/dschat" ] ||
  { echo "deepspeed_chat_check: '$1' has no dschat/ and training/ (give DeepSpeedExamples/applications/DeepSpeed-Chat)" >&2; exit 2; }

here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
work=${DSCHAT_CHECK_DIR:-${TMPDIR:-/tmp}/zerotune-dschat}
dtype=${DSCHAT_DTYPE:-fp16}
chat=$work/DeepSpeed-Chat venv=$work/venv
rm -rf "$chat" "$work/out" "$work/logs" "$work/data_files"
mkdir -p "$chat" "$work/out" "$work/logs" || exit 1
cp -r "$src/dschat" "$src/training" "$chat/" || exit 1

[ -x "$venv/bin/python" ] || "$python" -m venv --without-pip "$venv" || exit 1
inner=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
outer=$("$python" -c 'import site; print("\n".join(site.getsitepackages()))')
printf '%s\n%s\n%s\n' "$outer" "$here" "$chat" > "$inner/_zerotune_dschat_paths.pth"
(cd "$work" && "$venv/bin/python" -m zerotune.cli.main deepspeed-alias install > /dev/null) || exit 1
if "$venv/bin/python" -c 'import sys, transformers; sys.exit(int(transformers.__version__.split(".")[0]) < 5)'; then
  cat > "$inner/_dschat_transformers5.py" <<'EOF'
"""DeepSpeed-Chat imports no_init_weights from transformers.modeling_utils; transformers 5 moved it to
transformers.initialization. Re-export it there when transformers.modeling_utils is imported."""
import importlib.abc, importlib.util, sys


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "transformers.modeling_utils":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if not hasattr(module, "no_init_weights"):
                from transformers.initialization import no_init_weights
                module.no_init_weights = no_init_weights

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
EOF
  echo "import _dschat_transformers5" > "$inner/_dschat_transformers5.pth"
  echo "# transformers 5: transformers.modeling_utils.no_init_weights re-exported for dschat/utils/model/model_utils.py"
else
  rm -f "$inner/_dschat_transformers5.py" "$inner/_dschat_transformers5.pth"
fi

export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export HF_DATASETS_CACHE=$work/hf_datasets
tiny=$work/tiny-opt
"$venv/bin/python" - "$tiny" "$chat" <<'EOF' > "$work/logs/assets.log" 2>&1 || { echo "deepspeed_chat_check: building the tiny model failed: $work/logs/assets.log" >&2; exit 1; }
import json, random, sys
from pathlib import Path

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import OPTConfig, OPTForCausalLM

tiny, chat = Path(sys.argv[1]), Path(sys.argv[2])
tiny.mkdir(parents=True, exist_ok=True)
colors = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow"}
words = ["human", "assistant", "what", "color", "is", "the", "i", "do", "not", "know", "maybe", *colors, *colors.values()]
bpe = ByteLevelBPETokenizer()  # OPT's tokenizer is GPT-2's byte-level BPE: vocab.json + merges.txt
bpe.train_from_iterator([" " + " ".join(words)] * 3, vocab_size=300, min_frequency=1,
                        special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
bpe.save_model(str(tiny))
(tiny / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>", "eos_token": "</s>", "unk_token": "<unk>",
    "pad_token": "<pad>", "add_bos_token": True, "errors": "replace"}))
vocab = json.loads((tiny / "vocab.json").read_text())
torch.manual_seed(0)
OPTForCausalLM(OPTConfig(vocab_size=len(vocab), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                         word_embed_proj_dim=32, max_position_embeddings=128, pad_token_id=1, bos_token_id=2,
                         eos_token_id=2)).save_pretrained(tiny)
rng = random.Random(0)


def rows(n):
    out = []
    for i in range(n):
        thing = list(colors)[i % len(colors)]
        wrong = rng.choice([c for c in colors.values() if c != colors[thing]])
        out.append({"prompt": f"human what color is the {thing} assistant", "chosen": f"the {thing} is {colors[thing]}",
                    "rejected": f"i do not know maybe {wrong}"})
    return out


(chat / "data").mkdir(exist_ok=True)
(chat / "data" / "train.json").write_text(json.dumps(rows(120)))  # split 2,4,4: 24 / 48 / 48 rows per phase
(chat / "data" / "eval.json").write_text(json.dumps(rows(40)))
EOF

summarize() {  # summarize STEP ZERO RC LOG: the run's line
  "$venv/bin/python" - "$@" "$chat" <<'EOF'
import re, sys
step, zero, rc, log, chat = sys.argv[1:]
text = open(log, errors="replace").read()
lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in text.splitlines()]
summary = ""
if step == "step1":
    per_step = {}
    for s, loss in re.findall(r"Step: (\d+), Rank: \d+, loss = ([-\d.e+naif]+)", text):
        per_step.setdefault(int(s), []).append(float(loss))
    curve = [sum(v) / len(v) for _, v in sorted(per_step.items())]
    if curve:
        summary = f"final loss {curve[-1]:.4f} (rank mean; curve {' '.join(f'{x:.4f}' for x in curve)})"
elif step == "step2":
    found = re.findall(r"Epoch \d+/\d+ with loss ([-\d.e+naif]+)", text)
    acc = re.findall(r"acc \(higher is better\) : ([-\d.e+naif]+)", text)
    if found:
        summary = f"final loss {float(found[-1]):.4f} (rank 0, epoch mean); eval acc {float(acc[-1]):.3f}" if acc else \
            f"final loss {float(found[-1]):.4f}"
else:
    found = re.findall(r"Step: (\d+) \| PPO Epoch: \d+ \| Actor Loss: ([-\d.e+naif]+) \| Critic Loss: ([-\d.e+naif]+)", text)
    reward = re.findall(r"Average reward score: ([-\d.e+naif]+)", text)
    if found:
        s, actor, critic = found[-1]
        summary = f"{len(found)} PPO steps; final actor loss {float(actor):.4f}, critic loss {float(critic):.4f}" + \
            (f", reward {float(reward[-1]):.4f}" if reward else "")
if rc == "0":
    print(f"{step:<6} zero{zero:<5} PASS  {summary}")
    sys.exit()
skip = re.compile(r"ChildFailedError|Connection closed by peer|CommError|Signal \d+ \(SIG|^\s*$")
error_at = next((i for i, line in enumerate(lines)
                 if re.match(r"^[\w.]*(Error|Exception|Exit|NotSupported\w*)\b.*?: ", line) and not skip.search(line)), None)
if error_at is None:
    error = f"exit status {rc}, no exception in the log (timeout 124)"
else:
    error = lines[error_at].strip()
    frames = [(i, m) for i in range(error_at) for m in [re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', lines[i])] if m]
    mine = [(i, m) for i, m in frames if m.group(1).startswith(chat) or m.group(1) == "main.py"]
    if mine:
        i, m = mine[-1]
        where = m.group(1).replace(chat + "/", "")
        code = lines[i + 1].strip() if i + 1 < len(lines) else ""
        error += f"  [at {where}:{m.group(2)} {m.group(3)}: {code}]"
after = f"after training ({summary}): " if summary else ""
print(f"{step:<6} zero{zero:<5} FAIL  {after}{error}")
EOF
}

run() {  # run NAME STEP ZERO DIR ARGS...: one `zerotune run --as-deepspeed` of DIR/main.py
  local name=$1 step=$2 zero=$3 dir=$4; shift 4
  local log=$work/logs/$name.log
  (cd "$chat/training/$dir" && timeout -k 10 900 "$venv/bin/python" -m zerotune.cli.main run --as-deepspeed \
    --nproc_per_node 2 main.py --data_path local/jsonfile --data_output_path "$work/data_files/$name" \
    --dtype "$dtype" --output_dir "$work/out/$name" "$@") > "$log" 2>&1
  summarize "$step" "$zero" "$?" "$log"
}

for zero in 0 2 3; do
  run "step1_zero$zero" step1 "$zero" step1_supervised_finetuning --model_name_or_path "$tiny" --zero_stage "$zero" \
    --per_device_train_batch_size 2 --max_seq_len 64 --num_train_epochs 1 --dropout 0.0 --print_loss
done
for zero in 0 2 3; do
  run "step2_zero$zero" step2 "$zero" step2_reward_model_finetuning --model_name_or_path "$tiny" --zero_stage "$zero" \
    --per_device_train_batch_size 2 --max_seq_len 64 --num_train_epochs 1 --dropout 0.0
done
for name in step1_zero2 step2_zero2; do  # transformers 5's save_vocabulary writes vocab.json as tokenizer.model only
  if [ -d "$work/out/$name" ] && [ ! -f "$work/out/$name/vocab.json" ]; then
    rm -f "$work/out/$name/tokenizer.model"
    cp "$tiny/vocab.json" "$tiny/merges.txt" "$tiny/tokenizer_config.json" "$work/out/$name/"
    echo "# $name: tokenizer files (vocab.json, merges.txt) copied beside the saved model for step 3"
  fi
done
step3=(--actor_model_name_or_path "$work/out/step1_zero2" --critic_model_name_or_path "$work/out/step2_zero2"
       --num_padding_at_beginning 1 --per_device_generation_batch_size 2 --per_device_training_batch_size 2
       --max_prompt_seq_len 32 --max_answer_seq_len 16 --actor_dropout 0.0 --critic_dropout 0.0 --seed 1234
       --enable_test_mode --test_stop_step 3)
for zero in 2 3; do
  run "step3_zero$zero" step3 "$zero" step3_rlhf_finetuning "${step3[@]}" --actor_zero_stage "$zero" --critic_zero_stage "$zero"
done
run step3_zero2_hybrid_engine step3 "2+HE" step3_rlhf_finetuning "${step3[@]}" --actor_zero_stage 2 --critic_zero_stage 2 \
  --enable_hybrid_engine
