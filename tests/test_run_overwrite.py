"""The one overwrite policy (attnkit/run/overwrite.py): refuse without overwrite, say what overwrite removed."""
import pytest

from attnkit.errors import AttnkitError
from attnkit.run.overwrite import claim_outputs


def test_nothing_in_the_way_is_a_fresh_start(tmp_path):
    (tmp_path / "report.html").write_text("old report of nothing")
    claim = claim_outputs([tmp_path / "distances.npz"], False, stale=[tmp_path / "report.html"])
    assert claim.existing == [] and claim.removed_message().startswith("note: ")  # kept, and named
    assert claim.remove_stale() == [] and (tmp_path / "report.html").exists()  # nothing replaced: kept


def test_an_existing_output_is_refused_naming_it_and_what_overwrite_removes(tmp_path):
    (tmp_path / "distances.npz").write_bytes(b"x")
    (tmp_path / "report.html").write_text("r")
    with pytest.raises(AttnkitError) as e:
        claim_outputs([tmp_path / "distances.npz", tmp_path / "other.npz"], False,
                      stale=[tmp_path / "report.html", tmp_path / "figures"])
    msg = e.value.message({"overwrite": "--overwrite"})
    assert msg == (f"{tmp_path}/distances.npz already exists: give --overwrite to replace it (it removes "
                   f"{tmp_path}/{{distances.npz, report.html}}), or write elsewhere")
    with pytest.raises(AttnkitError, match="^RUN holds distances: give overwrite=True to replace it"):
        claim_outputs([tmp_path / "distances.npz"], False, what="RUN holds distances")
    assert str(e.value).count("overwrite=True") == 1  # Python callers read the argument
    assert (tmp_path / "distances.npz").read_bytes() == b"x"


def test_overwrite_removes_stale_files_and_names_everything_it_removed(tmp_path):
    (tmp_path / "a.csv").write_text("a")
    (tmp_path / "report.html").write_text("r")
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "f.png").write_bytes(b"p")
    claim = claim_outputs([tmp_path / "a.csv", tmp_path / "b.csv"], True,
                          stale=[tmp_path / "report.html", tmp_path / "figures", tmp_path / "absent.json"])
    assert claim.replaced == [tmp_path / "a.csv"]
    assert claim.stale == [tmp_path / "report.html", tmp_path / "figures"]
    assert claim.removed_message() is not None and "report.html" not in claim.removed_message()  # not yet removed
    claim.remove_stale()
    assert not (tmp_path / "report.html").exists() and not (tmp_path / "figures").exists()
    assert (tmp_path / "a.csv").exists()  # the command itself replaces its outputs
    from attnkit.errors import spell

    assert spell(claim.removed_message(), {"overwrite": "--overwrite"}) == \
        f"--overwrite removed {tmp_path}/{{a.csv, report.html, figures}}"


def test_a_stale_file_kept_because_nothing_was_replaced_is_named(tmp_path):
    """A first probe written into a run with a report: nothing is replaced, the report stays, and the message says
    it does not show the new results and how to redraw it."""
    report = tmp_path / "report.html"
    report.write_text("old")
    claim = claim_outputs([tmp_path / "probe.json"], False, stale=[report])
    claim.remove_stale()
    assert report.exists()
    assert claim.removed_message() == (f"note: {report} was made before these results and does not show them; "
                                       f"`attnkit report {tmp_path} --overwrite` redraws the report")
    assert claim_outputs([tmp_path / "probe.json"], False).removed_message() is None
