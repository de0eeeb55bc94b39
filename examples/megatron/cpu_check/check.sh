#!/usr/bin/env bash
# Runs real Megatron-LM pretrain_gpt.py (core_v0.16.1 .. core_v0.19.0) on CPU, 2 ranks, gloo: stock cp = 1 with
# its dense EOD document mask against l3plugin's CP = 2 (launcher, both layouts, both K/V modes; the two-line
# patch), the stock refusal, the planner's emitted flags, and the flexible schedule against stock's at PP 2 (with
# and without virtual stages); from 0.19 the data loader's documents (--dataloader-inter-document-masking, idm_*)
# under l3plugin's CP; prints each run's lm loss per iteration.
# See ../README.md, "Checked with the real script".
# Usage: MLM=/path/to/Megatron-LM VENV=/path/to/venv DATA=/path/prefix_text_document [TAG=core_v0.19.0] check.sh [RUN...]
# (TAG picks patches/megatron-lm-$TAG-pretrain_gpt.patch; l3plugin must be importable in VENV or on PYTHONPATH.)
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
MLM=${MLM:?Megatron-LM checkout}; VENV=${VENV:?venv with torch, megatron-core, l3plugin, six, regex, pyyaml, pybind11}
DATA=${DATA:?indexed dataset prefix (make_data.py)}; OUT=${OUT:-$PWD/cpu_check_logs}; ITERS=${ITERS:-5}
TAG=${TAG:-core_v0.16.1}
mkdir -p "$OUT"; cd "$MLM"
export PATH="$VENV/bin:$PATH" OMP_NUM_THREADS=1
TINY="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2
 --seq-length 256 --micro-batch-size 1 --global-batch-size 4"
# What a CPU run needs besides the model: local attention, fp32 on gloo, no dropout, no fused kernels; the data.
CPU="--max-position-embeddings 256 --position-embedding-type rope --transformer-impl local
 --attention-dropout 0 --hidden-dropout 0 --use-cpu-initialization --distributed-backend gloo
 --train-iters $ITERS --lr 1e-3 --lr-decay-style constant --clip-grad 0
 --seed 1234 --tokenizer-type NullTokenizer --vocab-size 1023 --data-path $DATA --split 100,0,0
 --log-interval 1 --eval-iters 0 --eval-interval 1000 --no-rope-fusion --no-masked-softmax-fusion
 --no-bias-gelu-fusion --no-bias-dropout-fusion --no-gradient-accumulation-fusion --no-persist-layer-norm"
# make_data.py ends every document with id 1023 = --vocab-size, NullTokenizer's EOD up to 0.17; from 0.18 its EOD
# defaults to vocab_size - 1 (1022, an ordinary token of the data): name 1023, else the EOD masks cut at random 1022s.
case "$TAG" in core_v0.16*|core_v0.17*) ;; *) CPU="$CPU --null-tokenizer-eod-id 1023" ;; esac
MODEL="$TINY $CPU"
MODEL4="${MODEL/--num-layers 2/--num-layers 4}"  # pp 2 x 2 virtual stages of one layer each
PP2="--pipeline-model-parallel-size 2"; VP2="$PP2 --num-layers-per-virtual-pipeline-stage 1"
DOCS="--reset-attention-mask --reset-position-ids --eod-mask-loss --calculate-per-token-loss"
CP="--context-parallel-size 2 --cp-comm-type l3plugin_all_gather"
# Megatron-LM 0.19+: the data loader's own document boundaries (cu_seqlens; pretrain_gpt builds "thd" PackedSeqParams).
IDM="--dataloader-inter-document-masking --eod-mask-loss --calculate-per-token-loss"
RUN="torchrun --nproc-per-node 2 $HERE/cpu_run.py"
LAUNCH="$RUN -m l3plugin.megatron.launch pretrain_gpt.py"
LAUNCH4="${LAUNCH/--nproc-per-node 2/--nproc-per-node 4}"; LAUNCH8="${LAUNCH/--nproc-per-node 2/--nproc-per-node 8}"
RUN4="${RUN/--nproc-per-node 2/--nproc-per-node 4}"
# 4D layouts: 4 layers (one per stage, or per virtual stage), 3 iterations (8 ranks on 2 cores are slow).
MODEL4="${MODEL/--num-layers 2/--num-layers 4}"; MODEL4="${MODEL4/--train-iters $ITERS/--train-iters ${ITERS4:-3}}"
VP2="--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"
TP2PP2="--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"
INIT="--load $OUT/init_ckpt --finetune --no-load-optim --no-load-rng"
[ -f pretrain_gpt_l3plugin.py ] || patch -p1 -o pretrain_gpt_l3plugin.py pretrain_gpt.py \
    < "$HERE/../../../patches/megatron-lm-$TAG-pretrain_gpt.patch" >/dev/null

# The planner's Megatron-LM arguments for the same tiny model on 2 GPUs with CP 2 (bf16, distributed optimizer).
plan() { "$VENV/bin/python" -m l3plugin plan --model "$HERE/tiny_model.json" --gpus 2 --seq-len 256 --global-batch-tokens 1024 \
    --tp 1 --pp 1 --cp 2 --cp-policy any --cp-kv "$1" --emit megatron | grep -v '^#' | tr -d '\\\n'; }
PLAN_REGATHER=$(plan regather); PLAN_KEEP=$(plan keep)
# The 131K plan's shape (TP, CP, PP, uneven virtual stages 'E|(t|)*nL', flexible schedule) for 4 layers on 8 ranks.
PLAN_4D=$("$VENV/bin/python" -m l3plugin plan --model "$HERE/tiny_model_4layers.json" --gpus 8 --seq-len 256 \
    --global-batch-tokens 1024 --tp 2 --pp 2 --cp 2 --cp-policy any --emit megatron | grep -v '^#' | tr -d '\\\n' | tr -d "'")
PLAN_CP1=$(echo "$PLAN_REGATHER" | sed 's/--context-parallel-size 2/--context-parallel-size 1/;
    s/--cp-comm-type l3plugin_all_gather//; s/--l3plugin-cp-kv regather//')

declare -A CMD=(
  [cp1_stock]="$RUN pretrain_gpt.py $MODEL $DOCS"
  [cp2_2cp_regather]="$LAUNCH $MODEL $DOCS $CP --l3plugin-cp-layout 2cp --l3plugin-cp-kv regather"
  [cp2_2cp_keep]="$LAUNCH $MODEL $DOCS $CP --l3plugin-cp-layout 2cp --l3plugin-cp-kv keep"
  [cp2_balanced_regather]="$LAUNCH $MODEL $DOCS $CP --l3plugin-cp-layout balanced --l3plugin-cp-kv regather"
  [cp2_balanced_keep]="$LAUNCH $MODEL $DOCS $CP --l3plugin-cp-layout balanced --l3plugin-cp-kv keep"
  [cp2_patch_2cp]="$RUN pretrain_gpt_l3plugin.py $MODEL $DOCS $CP"
  [cp2_no_documents]="$LAUNCH $MODEL ${DOCS/--reset-attention-mask /} $CP"
  [cp2_stock_refuses]="$RUN pretrain_gpt.py $MODEL $DOCS $CP"
  [idm_cp2_2cp]="$LAUNCH $MODEL $IDM $CP --l3plugin-cp-layout 2cp"
  [idm_cp2_balanced]="$LAUNCH $MODEL $IDM $CP --l3plugin-cp-layout balanced"
  [idm_cp2_patch]="$RUN pretrain_gpt_l3plugin.py $MODEL $IDM $CP"
  [tp2_cp1_stock]="$RUN pretrain_gpt.py $MODEL $DOCS --tensor-model-parallel-size 2"
  [idm_tp2_cp2]="$LAUNCH4 $MODEL $IDM $CP --tensor-model-parallel-size 2"
  [pp2_cp1_stock]="$RUN pretrain_gpt.py $MODEL $DOCS --pipeline-model-parallel-size 2"
  [pp2_cp2_2cp]="$LAUNCH4 $MODEL $DOCS $CP --pipeline-model-parallel-size 2"
  # 4D layouts. Megatron seeds each pipeline stage's weights differently, so every run starts from one checkpoint
  # (saved after an lr = 0 step) and compares with stock PP 1 (every stage is a first/last one: its dense EOD
  # mask reaches every layer; stock gives a middle stage attention_mask None, i.e. no documents).
  [init_ckpt]="$RUN pretrain_gpt.py $MODEL4 $DOCS --train-iters 1 --lr 0 --save $OUT/init_ckpt --save-interval 1"
  [ckpt_cp1_stock]="$RUN pretrain_gpt.py $MODEL4 $DOCS $INIT"
  [ckpt_pp4_cp1_stock]="$RUN4 pretrain_gpt.py $MODEL4 $DOCS $INIT --pipeline-model-parallel-size 4"
  [ckpt_pp4_cp2]="$LAUNCH8 $MODEL4 $DOCS $INIT $CP --pipeline-model-parallel-size 4"
  [ckpt_pp4_cp2_flexible]="$LAUNCH8 $MODEL4 $DOCS $INIT $CP --pipeline-model-parallel-size 4 --pipeline-schedule flexible"
  [ckpt_vp2_cp1_flexible]="$LAUNCH $MODEL4 $DOCS $INIT $VP2 --pipeline-schedule flexible"
  [ckpt_vp2_cp2_flexible]="$LAUNCH4 $MODEL4 $DOCS $INIT $CP $VP2 --pipeline-schedule flexible"
  [ckpt_vp2_cp2_idm_flexible]="$LAUNCH4 $MODEL4 $IDM $INIT $CP $VP2 --pipeline-schedule flexible"
  [ckpt_vp2_cp2_stock]="$LAUNCH4 $MODEL4 $DOCS $INIT $CP $VP2"
  [ckpt_tp2_pp2_cp1_stock]="$RUN4 pretrain_gpt.py $MODEL4 $DOCS $INIT $TP2PP2"
  [ckpt_tp2_pp2_cp2]="$LAUNCH8 $MODEL4 $DOCS $INIT $CP $TP2PP2"
  [planner_4d]="$LAUNCH8 $PLAN_4D $CPU $DOCS $INIT"
  [planner_4d_fp32]="$LAUNCH8 ${PLAN_4D/--bf16 /} $CPU $DOCS $INIT"
  [ckpt_cp1_stock_bf16]="$RUN pretrain_gpt.py $MODEL4 $DOCS $INIT --bf16 --use-distributed-optimizer --accumulate-allreduce-grads-in-fp32"
  [cp1_stock_per_rank_mean]="$RUN pretrain_gpt.py $MODEL ${DOCS/ --calculate-per-token-loss/}"
  [cp2_2cp_per_rank_mean]="$LAUNCH $MODEL ${DOCS/ --calculate-per-token-loss/} $CP"
  [planner_cp2_regather]="$LAUNCH $PLAN_REGATHER $CPU $DOCS"
  [planner_cp2_keep]="$LAUNCH $PLAN_KEEP $CPU $DOCS"
  [planner_flags_cp1_stock]="$RUN pretrain_gpt.py $PLAN_CP1 $CPU $DOCS"
  [pp2_stock]="$RUN pretrain_gpt.py $MODEL4 $PP2"
  [pp2_flexible]="$LAUNCH $MODEL4 $PP2 --pipeline-schedule flexible"
  [pp2_vp2_stock]="$RUN pretrain_gpt.py $MODEL4 $VP2"
  [pp2_vp2_flexible]="$LAUNCH $MODEL4 $VP2 --pipeline-schedule flexible"
  [pp2_vp2_patch_flexible]="$RUN pretrain_gpt_l3plugin.py $MODEL4 $VP2 --pipeline-schedule flexible"
  [pp2_vp2_k1_flexible]="$LAUNCH $MODEL4 $VP2 --microbatch-group-size-per-virtual-pipeline-stage 1 --pipeline-schedule flexible"
  [pp2_vp2_k1_stock_refuses]="$RUN pretrain_gpt.py $MODEL4 $VP2 --microbatch-group-size-per-virtual-pipeline-stage 1"
  # Zero bubble: each backward split into B and W (Megatron's local linears through l3plugin's split_linears).
  [pp2_flexible_zb]="$LAUNCH $MODEL4 $PP2 --pipeline-schedule flexible-zb"
  [pp2_vp2_flexible_zb]="$LAUNCH $MODEL4 $VP2 --pipeline-schedule flexible-zb"
  [tp2_pp2_stock]="$RUN4 pretrain_gpt.py $MODEL4 $TP2PP2"
  [tp2_pp2_flexible_zb]="$LAUNCH4 $MODEL4 $TP2PP2 --pipeline-schedule flexible-zb"
)
ORDER="cp1_stock cp2_2cp_regather cp2_2cp_keep cp2_balanced_regather cp2_balanced_keep cp2_patch_2cp cp2_no_documents cp2_stock_refuses
 idm_cp2_2cp idm_cp2_balanced idm_cp2_patch tp2_cp1_stock idm_tp2_cp2
 cp1_stock_per_rank_mean cp2_2cp_per_rank_mean pp2_cp1_stock pp2_cp2_2cp planner_cp2_regather planner_cp2_keep planner_flags_cp1_stock
 pp2_stock pp2_flexible pp2_vp2_stock pp2_vp2_flexible pp2_vp2_patch_flexible pp2_vp2_k1_flexible pp2_vp2_k1_stock_refuses
 pp2_flexible_zb pp2_vp2_flexible_zb tp2_pp2_stock tp2_pp2_flexible_zb
 init_ckpt ckpt_cp1_stock ckpt_pp4_cp1_stock ckpt_pp4_cp2 ckpt_pp4_cp2_flexible ckpt_vp2_cp1_flexible ckpt_vp2_cp2_flexible
 ckpt_vp2_cp2_idm_flexible
 ckpt_vp2_cp2_stock ckpt_tp2_pp2_cp1_stock ckpt_tp2_pp2_cp2 planner_4d planner_4d_fp32 ckpt_cp1_stock_bf16"
for name in ${@:-$ORDER}; do
  echo "== $name: ${CMD[$name]}" | tr -s ' \n' ' '; echo
  timeout 900 ${CMD[$name]} > "$OUT/$name.log" 2>&1; echo "   exit $?"
  grep -ao "lm loss: [^ ]*" "$OUT/$name.log" | awk '{printf "   %s", $3} END {print ""}'
  grep -m1 -o "AssertionError: Context parallelism[^\"']*" "$OUT/$name.log" | sed 's/^/   /'
  grep -m1 -o "ValueError: The number of contiguous micro-batches[^\"']*" "$OUT/$name.log" | sed 's/^/   /'
done
