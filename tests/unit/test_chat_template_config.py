"""The cluster config's `chat_template`: a file's path or the template's text, checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.deploy.app_builder import chat_template_text

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_a_template_is_its_text_or_a_files(tmp_path: Path) -> None:
    assert chat_template_text(None) is None
    assert chat_template_text(TEMPLATE) == TEMPLATE
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE + "\n")
    assert chat_template_text(str(path)) == TEMPLATE + "\n"


def test_a_template_that_is_not_jinja_is_refused() -> None:
    with pytest.raises(ValueError, match="chat_template is not a Jinja template"):
        chat_template_text("{% for m in messages %}{{ m }}")
