#!/usr/bin/env bash
# Render an attnkit report in headless Chromium and save a screenshot of the whole page, to check by
# eye that RUN/report.html opens offline (no network: --disable-background-networking; the page
# itself loads nothing, its figures are embedded).
#
#   tools/render_report.sh REPORT.html [OUT.png] [WIDTH | WIDTHxHEIGHT]
#
# OUT.png defaults to REPORT.png next to the report; WIDTH to 1280 px. The height is measured: a
# first headless load of a temporary copy of the page (with a one-line script added) reports the
# page's scrollHeight at that width, and the screenshot is taken with a window that tall. An explicit
# WIDTHxHEIGHT skips the measurement. Pages taller than 30000 px are cut there (with a warning).
#
# Needs Debian's `chromium` (apt-get install -y chromium). Exit status 0 with the PNG's path on
# stdout; 1 with a one-line message on stderr when an argument is wrong (no report, output folder
# missing or not writable, output is a folder), Chromium is missing, or no screenshot was written.
set -euo pipefail

die() { echo "render_report.sh: $*" >&2; exit 1; }

[[ $# -ge 1 && $# -le 3 ]] || die "usage: render_report.sh REPORT.html [OUT.png] [WIDTH | WIDTHxHEIGHT]"
report=$1
out=${2:-${report%.html}.png}
size=${3:-1280}
max_height=30000

[[ -e "$report" ]] || die "report $report does not exist"
[[ -f "$report" ]] || die "report $report is not a file"
[[ -r "$report" ]] || die "report $report is not readable"
[[ -n "$out" ]] || die "the output path is empty"
[[ -d "$out" ]] && die "output $out is a folder: give a file name such as $out/report.png"
out_dir=$(dirname -- "$out")
[[ -d "$out_dir" ]] || die "output folder $out_dir does not exist"
[[ -w "$out_dir" ]] || die "output folder $out_dir is not writable"
if [[ "$size" =~ ^([0-9]+)x([0-9]+)$ ]]; then
  width=${BASH_REMATCH[1]} height=${BASH_REMATCH[2]}
elif [[ "$size" =~ ^[0-9]+$ ]]; then
  width=$size height=
else
  die "size $size is neither WIDTH nor WIDTHxHEIGHT (e.g. 1280 or 1280x4000)"
fi
(( width >= 200 && width <= 10000 )) || die "width $width is outside 200..10000 px"

browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[[ -n "$browser" ]] || die "no chromium found (apt-get install -y chromium)"

report_abs=$(cd -- "$(dirname -- "$report")" && pwd)/$(basename -- "$report")
out_abs=$(cd -- "$out_dir" && pwd)/$(basename -- "$out")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags=(--headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking
       --disable-dev-shm-usage --disable-extensions --disable-sync --hide-scrollbars
       --user-data-dir="$work/profile")

if [[ -z "$height" ]]; then
  # The copy differs from the report only by a script that, once everything (the embedded images
  # included) has loaded, writes the page height into an attribute that --dump-dom prints.
  probe='<script>addEventListener("load",function(){document.body.setAttribute("data-page-height",'
  probe+='Math.ceil(document.documentElement.scrollHeight))})</script>'
  awk -v probe="$probe" '{ line = $0; if (!done && sub(/<\/body>/, probe "</body>", line)) done = 1; print line }
                         END { if (!done) print probe }' "$report_abs" > "$work/probe.html"
  dom=$("$browser" "${flags[@]}" --window-size="$width,800" --virtual-time-budget=10000 --dump-dom \
        "file://$work/probe.html" 2>"$work/chromium.log") || true
  height=$(grep -o 'data-page-height="[0-9]*"' <<<"$dom" | head -n 1 | grep -o '[0-9]\+' || true)
  [[ -n "$height" ]] || die "could not measure the page height of $report (Chromium said: $(tail -n 1 "$work/chromium.log"))"
fi
(( height >= 1 )) || die "height $height must be positive"
if (( height > max_height )); then
  echo "render_report.sh: the page is $height px tall; the screenshot stops at $max_height px" >&2
  height=$max_height
fi

rm -f -- "$out_abs"
"$browser" "${flags[@]}" --window-size="$width,$height" --screenshot="$out_abs" "file://$report_abs" \
  2>"$work/chromium.log" >/dev/null || true
[[ -s "$out_abs" ]] || die "Chromium wrote no screenshot to $out_abs ($(tail -n 1 "$work/chromium.log"))"
echo "$out_abs"
