"""viz/diffs.py: a unified diff that Jupyter shows coloured, and prints as difflib writes it."""

import difflib
import re

from minivllm_compile.viz.diffs import Diff, unified_diff

BEFORE = "a = f(x)\nb = g(a)  # <old>\nreturn b\n"
AFTER = "a = f(x)\nb = h(a) & 1\nreturn b\n"


def test_the_text_is_difflibs_unified_diff():
    d = unified_diff(BEFORE, AFTER, "before", "after", n=0)
    expected = list(difflib.unified_diff(BEFORE.splitlines(), AFTER.splitlines(),
                                         "before", "after", n=0,
                                         lineterm=""))
    assert list(d.lines) == expected
    assert str(d) == repr(d) == "\n".join(expected)
    assert d.removed == ["b = g(a)  # <old>"] and d.added == ["b = h(a) & 1"]
    # lists of lines work too, and context lines come with n
    assert unified_diff(BEFORE.splitlines(), AFTER.splitlines(),
                        n=1).lines == unified_diff(BEFORE, AFTER, n=1).lines
    assert " a = f(x)" in unified_diff(BEFORE, AFTER, n=1).lines


def test_html_colours_removed_red_added_green_and_escapes():
    page = unified_diff(BEFORE, AFTER, n=1)._repr_html_()
    spans = re.findall(r'<span style="([^"]*)">(.*?)</span>', page)
    by_text = {text: style for style, text in spans}
    assert "#ffebe9" in by_text["-b = g(a)  # &lt;old&gt;"]  # red background, the text escaped
    assert "#e6ffec" in by_text["+b = h(a) &amp; 1"]  # green
    # a header, not a removal
    assert "bold" in by_text["--- before"] and "#ffebe9" not in by_text["--- before"]
    assert "#ddf4ff" in by_text["@@ -1,3 +1,3 @@"]
    assert by_text[" a = f(x)"] == "display:block"  # context: uncoloured
    assert len(spans) == len(unified_diff(BEFORE, AFTER, n=1).lines)  # one span per line
    # inline styles only: they survive sanitizers
    assert "<style" not in page and "class=" not in page


def test_an_empty_diff_says_so():
    d = unified_diff(BEFORE, BEFORE)
    assert d == Diff(()) and not d
    assert repr(d) == "(no differences)" and "no differences" in d._repr_html_()
