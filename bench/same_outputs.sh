#!/bin/bash
# Does a refactor change what trtbuild prints or writes? Runs one CLI session (tiny model, convert, AWQ + int8 KV
# quantize with its quality report, build, eval with a failing gate, diff, inspect, generate, verify, three refusals,
# two --help pages) in checkout OLD and in checkout NEW, then compares stdout, stderr, exit codes and the artifacts'
# bytes. Paths, wall times, peak memory, progress-bar rates, git commits and manifest hashes (they hold those) are
# masked; anything else that differs is printed and the script exits 1.
#
#   bench/same_outputs.sh OLD_CHECKOUT NEW_CHECKOUT     (e.g. a `git worktree add /tmp/old <commit>`)
set -u
old=$(realpath "$1"); new=$(realpath "$2")
here=$(dirname "$(realpath "$0")")
trtbuild=${TRTBUILD:-$here/../.venv/bin/trtbuild}
data=$here/../../shared/data/wikitext-2/valid.txt
[ -f "$data" ] || { echo "needs $data (shared data) for calibration" >&2; exit 2; }

session() {  # $1 checkout, $2 output folder
    local src=$1 out=$2 w=$2/work
    rm -rf "$out"; mkdir -p "$w"
    step() { local name=$1; shift; (cd "$src" && PYTHONPATH=$src TRTBUILD_HASH_CACHE=0 "$@") >"$out/$name.out" 2>"$out/$name.err"; echo $? >"$out/$name.rc"; }
    step tiny "$trtbuild" tiny-model "$w/hf" --seed 0
    step convert "$trtbuild" convert "$w/hf" -o "$w/ckpt" --json
    step quantize "$trtbuild" quantize "$w/ckpt" -o "$w/q" --method w4a16_awq --group-size 32 --kv-cache int8 \
        --calib-data "$data" --calib-samples 4 --calib-seq-len 32 --eval-data recipes/data/demo.txt --eval-tokens 400
    step build "$trtbuild" build "$w/q" -o "$w/engine" --tokens-per-block 8
    step build_fp32 "$trtbuild" build "$w/ckpt" -o "$w/engine0" --json
    step eval "$trtbuild" eval "$w/engine" --reference "$w/hf" --data recipes/data/demo.txt --max-tokens 400 \
        -o "$w/report" --gate kld_mean_max=0.0001
    step diff "$trtbuild" diff "$w/engine0" "$w/engine" --data recipes/data/demo.txt --max-tokens 300
    step diff_json "$trtbuild" diff "$w/engine0" "$w/engine" --changes-only --json
    step inspect "$trtbuild" inspect "$w/engine"
    step inspect_json "$trtbuild" inspect "$w/q" --json
    step generate "$trtbuild" generate "$w/engine" --prompt "Once upon a time" --max-new-tokens 8
    step verify "$trtbuild" verify "$w/engine"
    step bad_group_size "$trtbuild" quantize "$w/ckpt" -o "$w/q2" --method w4a16 --group-size 48
    step bad_block_size "$trtbuild" build "$w/ckpt" -o "$w/e2" --tokens-per-block 3
    step bad_backend "$trtbuild" build "$w/ckpt" -o "$w/e3" --backend foo
    step help_quantize "$trtbuild" quantize --help
    step help_build "$trtbuild" build --help
}

mask() {
    sed -E -e "s#$old#SRC#g; s#$new#SRC#g; s#$tmp/(old|new)#OUT#g" \
        -e 's/[0-9]+\.[0-9]+ s\b/T s/g; s/"wall_time_s": [0-9.]+/"wall_time_s": T/; s/[0-9.]+it\/s/R/g' \
        -e 's/"peak_rss_bytes": [0-9]+/"peak_rss_bytes": M/; s/peak RSS [0-9]+ MiB/peak RSS M MiB/' \
        -e 's/\b[0-9a-f]{40}\b/COMMIT/g; s/\(([0-9a-f]{12})\)/(COMMIT)/g' \
        -e 's/"(engine_)?manifest_sha256": "[0-9a-f]{64}"/"manifest_sha256": H/g' "$1"
}

tmp=$(mktemp -d)
session "$old" "$tmp/old"
session "$new" "$tmp/new"
status=0
for f in "$tmp"/old/*.out "$tmp"/old/*.err "$tmp"/old/*.rc; do
    name=$(basename "$f")
    if ! d=$(diff <(mask "$f") <(mask "$tmp/new/$name")); then echo "## $name"; echo "$d" | head -20; status=1; fi
done
for f in ckpt/rank0.safetensors ckpt/config.json q/rank0.safetensors q/config.json engine/model.onnx \
         engine/build_config.json engine0/model.onnx engine0/build_config.json; do
    cmp -s "$tmp/old/work/$f" "$tmp/new/work/$f" || { echo "## $f: the bytes differ"; status=1; }
done
if [ $status -eq 0 ]; then echo "same outputs: $(ls "$tmp"/old/*.rc | wc -l) commands, 8 artifacts ($tmp)"; fi
exit $status
