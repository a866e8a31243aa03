"""The notebooks' index and FAQ (notebooks/README.md) link to sections by their anchors; a renamed
heading would leave a link that opens the notebook at its top. Anchors as GitHub and JupyterLab
make them from a markdown heading: lower case, punctuation dropped, spaces to hyphens."""

import json
import re
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())  # \w keeps letters of any script
    return text.replace(" ", "-")


def headings(notebook: Path) -> set[str]:
    cells = json.loads(notebook.read_text())["cells"]
    return {anchor(m.group(1)) for c in cells if c["cell_type"] == "markdown"
            for m in re.finditer(r"^#{1,6}\s+(.+)$", "".join(c["source"]), re.M)}


def test_anchor_matches_githubs_rule():
    assert anchor("7. The `compile_fx` adaptor: Inductor's own "
                  "cache") == "7-the-compile_fx-adaptor-inductors-own-cache"
    assert anchor("1. Why: in-place ops (§1 背景)") == "1-why-in-place-ops-1-背景"


def test_every_section_link_in_the_notebooks_readme_names_a_heading():
    links = re.findall(r"\]\((\d\d_[\w]+\.ipynb)#([^)]+)\)", (NOTEBOOKS / "README.md").read_text())
    assert len(links) > 20
    broken = [f"{nb}#{a}" for nb, a in links if a not in headings(NOTEBOOKS / nb)]
    assert not broken, f"links to no heading (renamed?): {broken}"
