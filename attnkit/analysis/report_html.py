"""The HTML of the report: escaping, tables (sortable ones too), settings as nested tables, embedded figures,
feature names linked to their definitions, and the page that holds the report's CSS, data and script
(attnkit/data/report.css and report.js, embedded: the page loads nothing from elsewhere)."""
from __future__ import annotations

import base64
import html
import json
from importlib import resources
from pathlib import Path

import numpy as np

from ..features import describe_feature, feature_section


def esc(x) -> str:
    return html.escape(str(x))


def fmt(v, digits: int = 3) -> str:
    """A number as a cell shows it; '–' for None and NaN."""
    if v is None:
        return "–"
    if isinstance(v, (float, np.floating)):
        return "–" if np.isnan(v) else f"{v:.{digits}f}"
    return esc(v)


def table(header, rows, left=(0,), cls: str = "", sortable: bool = False) -> str:
    """An HTML table; the cells of `rows` are HTML already. `header` None: no header row. `sortable`: a click
    on a header sorts the rows (report.js)."""
    head = ""
    if header is not None:
        th = "".join(f'<th class="{"l" if i in left else ""}">{esc(h)}</th>' for i, h in enumerate(header))
        head = f"<thead><tr>{th}</tr></thead>"
    body = ["<tr>" + "".join(f'<td class="{"l" if i in left else ""}">{c}</td>' for i, c in enumerate(r)) + "</tr>"
            for r in rows]
    classes = " ".join(c for c in (cls, "sortable" if sortable else "") if c)
    attr = f' class="{classes}"' if classes else ""
    return f"<table{attr}>{head}<tbody>{''.join(body)}</tbody></table>"


def value_html(v) -> str:
    """A setting's value as HTML: dicts as nested two-column tables, lists of plain values joined by
    commas, lists with dicts or lists as one nested table row per item; None as a dash."""
    if isinstance(v, dict):
        if not v:
            return "–"
        return table(None, [(esc(k), value_html(x)) for k, x in v.items()], left=(0, 1), cls="nested")
    if isinstance(v, (list, tuple)):
        if not v:
            return "–"
        if any(isinstance(x, (dict, list, tuple)) for x in v):
            return table(None, [(i, value_html(x)) for i, x in enumerate(v)], left=(1,), cls="nested")
        return esc(", ".join("–" if x is None else str(x) for x in v))
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return esc(v)


def img(saved: dict, caption: str) -> str:
    b64 = base64.b64encode(saved["png_bytes"]).decode("ascii")
    return (f'<figure><img alt="{esc(caption)}" src="data:image/png;base64,{b64}">'
            f"<figcaption>{esc(caption)}</figcaption></figure>")


def docs_base() -> str | None:
    """The docs/ folder of this attnkit's source tree as a file:// URI, when it has one (an install from a
    clone); None otherwise (the report's glossary then holds the definitions)."""
    here = Path(__file__).resolve().parents[2] / "docs"
    return here.as_uri() if (here / "features.md").is_file() else None


def feature_doc(name: str, base: str | None) -> str:
    """Where a feature name links: its section of docs/features.md, or the report's glossary."""
    return f"{base}/features.md#{feature_section(name)}" if base else f"#glossary-{name}"


def feature_link(name: str, base: str | None) -> str:
    return f'<a href="{esc(feature_doc(name, base))}" title="{esc(describe_feature(name))}">{esc(name)}</a>'


def glossary(names, base: str | None) -> str:
    """Every feature of the run with its one-line definition and a link to docs/features.md."""
    rows = [(f'<span id="glossary-{esc(n)}">{feature_link(n, base)}</span>', esc(describe_feature(n)))
            for n in names]
    where = ("The full definitions: docs/features.md" + (f' (<a href="{esc(base)}/features.md">local copy</a>)'
                                                         if base else "") + ".")
    return table(["feature", "what it measures (per query row, averaged over a sample's rows)"], rows,
                 left=(0, 1)) + f'<p class="note">{where}</p>'


def _asset(name: str) -> str:
    return resources.files("attnkit").joinpath("data", name).read_text(encoding="utf-8")


def data_script(data: dict) -> str:
    """The report's data as a JSON script element (`</` escaped so no string can end the element)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return f'<script type="application/json" id="attnkit-data">{text}</script>'


def page(title: str, subtitle: str, notes: list[str], toc: list[tuple[str, str]], sections: list[str],
         data: dict | None) -> str:
    """The whole document: CSS, title, notes, table of contents, sections, then the data and the script."""
    note_html = "".join(f'<p class="note">{esc(n)}</p>' for n in notes)
    nav = ('<nav class="toc"><b>Contents</b><ol>' + "".join(f'<li><a href="#{esc(i)}">{esc(t)}</a></li>'
                                                         for i, t in toc) + "</ol></nav>") if toc else ""
    script = (data_script(data) + f"<script>{_asset('report.js')}</script>") if data is not None else ""
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{esc(title)}</title>"
            f"<style>{_asset('report.css')}</style></head><body><h1>{esc(title)}</h1><p class=\"note\">{subtitle}</p>"
            f"{note_html}{nav}" + "\n".join(s for s in sections if s) + script + "</body></html>\n")


__all__ = ["data_script", "docs_base", "esc", "feature_doc", "feature_link", "fmt", "glossary", "img", "page",
           "table", "value_html"]
