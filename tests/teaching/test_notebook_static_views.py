"""A widget shows only in a trusted notebook with a live kernel; GitHub, nbviewer and a notebook
that is not trusted yet fall back to the output's other formats. Notebook 06's piece browser
commits a static HTML view of its first state beside the widget, so those readers see the piece,
not `VBox(children=(Dropdown(...`."""

import json
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
WIDGET = "application/vnd.jupyter.widget-view+json"


def test_notebook_06s_widget_output_carries_a_static_view_of_its_first_piece():
    (path,) = NOTEBOOKS.glob("06_*.ipynb")
    outputs = [
        o
        for c in json.loads(path.read_text())["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if WIDGET in o.get("data", {})
    ]
    assert len(outputs) == 1, f"{len(outputs)} widget outputs in notebook 06"
    html = "".join(outputs[0]["data"].get("text/html", ""))
    assert "piece: <b>submod_0</b>" in html and "def forward(" in html, html[:300]
    assert "data:image/png;base64," in html  # the piece drawn, as the widget draws it
