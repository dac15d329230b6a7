"""The report of a pruned model's run (issue 30 §1; the contract: meta.json `removed_heads`, NaN features): removed
heads are marked in the grid's data, left out of averages, findings, maps and neighbours, and the page says how
many; a NaN head that meta.json does not record is a damaged run."""
import csv
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from attnkit.analysis.report import build_report
from attnkit.errors import AttnkitError

from .synthetic import pruned_run

REMOVED = ((1, 0), (1, 1), (1, 2), (1, 3), (2, 3))  # all of layer 1 and L2H3 of 3 × 4


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    run = tmp_path_factory.mktemp("pruned") / "run"
    f, per, texts, dist = pruned_run(run, removed=REMOVED, n_samples=10)
    # the other commands' results as on a pruned model: NaN (JSON NaN or null) and "nan" for the removed heads,
    # no ablation row for them
    pat = json.loads((run / "patterns.json").read_text())
    for grid in pat["per_head"].values():
        for j, (l, h) in enumerate(REMOVED):
            grid[l][h] = None if j % 2 else float("nan")
    (run / "patterns.json").write_text(json.dumps(pat))
    rows = list(csv.DictReader(open(run / "probe.csv")))
    for r in rows:
        if (int(r["layer"]), int(r["head"])) in REMOVED:
            r["accuracy"] = "nan"
    with open(run / "probe.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    table = json.loads((run / "heads.json").read_text())
    table["rows"] = [r for r in table["rows"] if (r["layer"], r["head"]) not in REMOVED]
    (run / "heads.json").write_text(json.dumps(table))
    page = build_report(run, svg=False).read_text()
    data = json.loads(re.search(r'id="attnkit-data">(.*?)</script>', page, re.S).group(1))
    return run, f, page, data


def _text(html):
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_removed_heads_are_marked_and_have_no_neighbours(pruned):
    _, f, page, data = pruned
    H = f.n_heads
    gone = {l * H + h for l, h in REMOVED}
    assert [m for m, x in enumerate(data["removed"]) if x] == sorted(gone)
    for kind in ("feat", "js"):
        for m, near in enumerate(data["near"][kind]):
            assert (near == []) == (m in gone)
            assert not {j for j, _ in near} & gone  # nobody's neighbour
    assert all(v is None for m in gone for v in data["features"]["mean"][m])  # NaN, never 0
    for m in gone:
        assert data["examples"]["top"]["sep"][m] == []
    assert "Grey cells marked “removed” are heads pruned from the model (L1H0, L1H1, L1H2, L1H3, L2H3)" in page
    tables = _text(page.split('<section id="tables">')[1].split("</section>")[0])
    assert tables.count(" removed ") == len(REMOVED)


def test_other_commands_results_with_removed_heads_are_shown(pruned):
    run, f, page, data = pruned
    H = f.n_heads
    for m in (l * H + h for l, h in REMOVED):
        assert all(v is None for v in data["patterns"]["shares"][m])
        assert all(v is None for v in data["probe"]["acc"][m])
        assert data["ablation"][0]["delta"][m] is None
    probe = _text(page.split('<section id="probe">')[1].split("</section>")[0])
    best = re.findall(r"L(\d)H(\d)", probe)
    assert best and not {(int(l), int(h)) for l, h in best} & set(REMOVED)


def test_findings_leave_removed_heads_out_and_say_how_many(pruned):
    run, f, page, _ = pruned
    findings = _text(page.split('<section id="findings">')[1].split("</section>")[0])
    assert "5 removed (pruned) head(s) are left out of every type, average and finding" in findings
    kept = np.ones((3, 4), dtype=bool)
    for l, h in REMOVED:
        kept[l, h] = False
    sep = f.mean[..., f.names.index("sep")]
    assert f"[SEP] : {sep[kept].mean():.2f} of the weight on average over the 7 heads" in findings
    best = np.unravel_index(np.nanargmax(np.where(kept, sep, np.nan)), sep.shape)
    assert f"the strongest L{best[0]}H{best[1]} ({sep[best]:.2f})" in findings
    assert "nan" not in findings.lower().replace("nats", "")
    assert "Every head of layer(s) 1 was removed" in findings
    clusters = json.loads((run / "clusters.json").read_text())  # clustered before: every head has a label
    label = {(h["layer"], h["head"]): h["label"] for h in clusters["heads"]}
    for c in clusters["clusters"]:
        n = sum(1 for k, v in label.items() if v == c["label"] and k not in REMOVED)
        assert f" {c['type']} {n} {n / 7:.3f} " in findings
    assert "5 head(s) were removed from this model" in page.split("<nav")[0]


def test_a_whole_last_layer_removed_gives_no_finding_about_it(tmp_path):
    run = tmp_path / "run"
    pruned_run(run, removed=tuple((2, h) for h in range(4)), n_samples=6)
    page = build_report(run, svg=False, do_sweep=False).read_text()
    findings = _text(page.split('<section id="findings">')[1].split("</section>")[0])
    assert "last layer" not in findings and "Every head of layer(s) 2 was removed" in findings


def test_nan_heads_that_meta_json_does_not_record_are_a_damaged_run(tmp_path):
    from attnkit.cli.analysis import report_cmd

    run = tmp_path / "run"
    pruned_run(run, removed=((0, 1),), n_samples=6)
    meta = json.loads((run / "meta.json").read_text())
    meta["removed_heads"] = []
    (run / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(AttnkitError, match=r"NaN or infinite means for 1 head\(s\) \(L0H1\) that meta.json does not "
                                           "record as removed"):
        build_report(run, svg=False)
    meta["removed_heads"] = [[0, 1], [7, 0]]
    (run / "meta.json").write_text(json.dumps(meta))
    r = CliRunner().invoke(report_cmd, [str(run), "--no-svg", "-q", "--examples", "0"])
    assert r.exit_code == 1 and "field removed_heads[1]: L7H0 is outside the run's 3 layers × 4 heads" in r.output, r.output
    meta["removed_heads"] = [[0, "x"]]
    (run / "meta.json").write_text(json.dumps(meta))
    r = CliRunner().invoke(report_cmd, [str(run), "--no-svg", "-q", "--examples", "0"])
    assert r.exit_code == 1 and "field removed_heads[0][1]: expected an integer" in r.output, r.output
