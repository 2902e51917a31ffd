#!/usr/bin/env bash
# One call on a lent GPU machine: the GPU check and the per-kernel profile, each under a time limit so that what they
# wrote is always packed, into at most five files under OUT_DIR (a device call brings back at most 8 files, 2 folders
# down). Made after 2026-12-04, when a check that ran into the call's limit came back with nothing but its terminal
# output. Limits: gpu-check 360 s (parts 1-3 took about 150 s on an H200), the profile's two passes 200 s (the first
# took about 60 s; the second, batched, has about 1.5 times its launches).
# Usage, from the checkout on the GPU machine: scripts/gpu-session.sh .gpu/frspec.xz "$OUT"
#   (the device call: carry .gpu, timeout_s 600; .gpu/frspec.xz comes from scripts/gpu-build.sh)
set -uo pipefail

[ $# -eq 2 ] || { echo "usage: $0 FRSPEC_BINARY[.xz] OUT_DIR" >&2; exit 2; }
here=$(dirname "$0")
out=$2
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

timeout 360 "$here/gpu-check.sh" "$1" "$work/check" 2>&1 | tee "$work/check.log"
check=${PIPESTATUS[0]}
timeout 200 "$here/gpu-profile.sh" "$1" "$work/profile" 2>&1 | tee "$work/profile.log"
profile=${PIPESTATUS[0]}
echo "gpu-check exit $check, gpu-profile exit $profile (124: stopped at its limit)" | tee "$work/exits.txt"
mkdir -p "$work/check"
mv "$work/check.log" "$work/profile.log" "$work/exits.txt" "$work/check/"
tar czf "$out/check.tgz" -C "$work" check
[ -d "$work/profile" ] && cp "$work/profile/"*summary.txt "$work/profile/"*ncu.csv.gz "$out/" 2>/dev/null
[ "$check" -eq 0 ] && [ "$profile" -eq 0 ]
