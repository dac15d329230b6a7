#!/usr/bin/env bash
# Render an attnkit report in headless Chromium and save a full-page-ish screenshot, to check by eye
# that RUN/report.html opens offline (no network: --disable-background-networking, and the page
# itself loads nothing: figures are embedded).
#
#   tools/render_report.sh RUN/report.html [OUT.png] [WIDTHxHEIGHT]
#
# Needs Debian's `chromium` (apt-get install -y chromium). Exit status: Chromium's, and 1 when no
# screenshot was written.
set -euo pipefail
report=${1:?usage: render_report.sh REPORT.html [OUT.png] [WIDTHxHEIGHT]}
out=${2:-${report%.html}.png}
size=${3:-1280x4000}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [[ -z "$browser" ]]; then
  echo "render_report.sh: no chromium found (apt-get install -y chromium)" >&2
  exit 1
fi
[[ -f "$report" ]] || { echo "render_report.sh: $report does not exist" >&2; exit 1; }
abs=$(cd "$(dirname "$report")" && pwd)/$(basename "$report")
out_abs=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
rm -f "$out_abs"
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
  --disable-dev-shm-usage --user-data-dir="$profile" --hide-scrollbars \
  --window-size="${size/x/,}" --screenshot="$out_abs" "file://$abs" 2>/dev/null
[[ -s "$out_abs" ]] || { echo "render_report.sh: no screenshot written" >&2; exit 1; }
echo "$out_abs"
