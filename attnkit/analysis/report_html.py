"""The HTML of the report, built with Jinja2 templates that escape every value (attnkit/data/templates/report*.html;
autoescape on, so a value read from a run's files is text wherever it lands: element text, an attribute, or the
JSON data of the page), and the page that holds the report's CSS, data and script (attnkit/data/report.css and
report.js, embedded: the page loads nothing from elsewhere and links nothing outside itself).

Python gathers plain values; the templates hold all markup. `part(name, **values)` renders one macro of
report_sections.html, `macros()` the building blocks (`table`, `img`, `value`, ...) of report_macros.html, and
`page(...)` the whole document.
"""
from __future__ import annotations

import base64
import json
import re
from functools import lru_cache
from importlib import resources

import numpy as np
from markupsafe import Markup

from ..features import describe_feature, feature_section_title

_COLOR = re.compile(r"^(#[0-9a-fA-F]{3,8}|rgba?\([0-9., ]+\))$")


def esc(x) -> Markup:
    """`x` as escaped HTML text, for a `Section` body that code assembles itself (prefer `part` or `table`)."""
    return Markup.escape(str(x))


def fmt(v, digits: int = 3) -> str:
    """A number as a cell shows it; '–' for None and NaN (plain text: the templates escape it)."""
    if v is None:
        return "–"
    if isinstance(v, (float, np.floating)):
        return "–" if np.isnan(v) else f"{v:.{digits}f}"
    return str(v)


def plain(v) -> str:
    """A setting's scalar as text: None as a dash, booleans as yes/no."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def anchor(name) -> str:
    """An id fragment made of safe characters only (letters, digits, '-', '_')."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", str(name))


def css_color(c) -> str:
    """A colour for a style attribute, only when it is a hex or rgb() colour (grey otherwise)."""
    return c if isinstance(c, str) and _COLOR.match(c) else "#999"


def safe_json(data) -> Markup:
    """`data` as JSON that is safe inside a <script> element: every non-ASCII character (U+2028 and U+2029
    included) as a \\u escape, and `<`, `>`, `&` and `'` as \\u003c, \\u003e, \\u0026 and \\u0027, so no string
    can end the element or open a comment; NaN refused (null is written for missing values)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=True)
    for ch, rep in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("'", "\\u0027")):
        text = text.replace(ch, rep)
    return Markup(text)


@lru_cache(maxsize=1)
def environment():
    from jinja2 import Environment, PackageLoader, StrictUndefined

    env = Environment(loader=PackageLoader("attnkit", "data/templates"), autoescape=True, undefined=StrictUndefined)
    env.filters.update(num=fmt, plain=plain, anchor=anchor, color=css_color)
    return env


def macros():
    """The building blocks of report_macros.html (table, value, img, swatch, typed, feat, doc_mark, section)."""
    return environment().get_template("report_macros.html").module


def part(name: str, **values) -> Markup:
    """One macro of report_sections.html rendered with `values` (escaped unless they are Markup)."""
    return getattr(environment().get_template("report_sections.html").module, name)(**values)


def table(header, rows, left=(0,), cls: str = "", sortable: bool = False) -> Markup:
    """An HTML table; every cell is escaped unless it is Markup. `header` None: no header row. `sortable`: a click
    on a header sorts the rows (report.js)."""
    return macros().table(header, rows, left=tuple(left), cls=cls, sortable=sortable)


def value_html(v) -> Markup:
    """A setting's value: dicts as nested two-column tables, lists of plain values joined by commas, lists with
    dicts or lists as one nested table row per item; None as a dash."""
    return macros().value(v)


def figure(saved: dict, caption: str) -> dict:
    """What the `img` macro takes: the PNG as base64 and the caption."""
    return {"b64": base64.b64encode(saved["png_bytes"]).decode("ascii"), "caption": caption}


def img(saved: dict, caption: str) -> Markup:
    f = figure(saved, caption)
    return macros().img(f["b64"], f["caption"])


def feature_link(name: str, base=None) -> Markup:
    """A feature name linked to its row of the page's glossary (`base` is ignored: the page links nothing outside
    itself)."""
    return macros().feat(name, describe_feature(name))


def glossary_rows(names) -> list[tuple[str, str, str]]:
    """(feature, one-line definition, where docs/features.md defines it) for every feature of the run."""
    return [(n, describe_feature(n), f"docs/features.md § {feature_section_title(n)}") for n in names]


def _asset(name: str) -> str:
    return resources.files("attnkit").joinpath("data", name).read_text(encoding="utf-8")


def page(title: str, subtitle: str, notes: list[str], toc: list[tuple[str, str]], sections: list,
         data: dict | None) -> str:
    """The whole document: CSS, title, notes, table of contents, sections (Markup), then the data and the script."""
    script = _asset("report.js").replace("</", "<\\/")
    return environment().get_template("report.html").render(
        title=title, subtitle=subtitle, notes=notes, toc=toc, sections=[s for s in sections if s],
        css=Markup(_asset("report.css").replace("</", "<\\/")), script=Markup(script),
        data_json=None if data is None else safe_json(data))


__all__ = ["anchor", "css_color", "environment", "esc", "feature_link", "figure", "fmt", "glossary_rows", "img",
           "macros", "page", "part", "plain", "safe_json", "table", "value_html"]
