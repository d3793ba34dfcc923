"""The docs cannot drift: docs/config.md is the schema's reference; the README's test command is CI's."""

import re

from tests.helpers import ROOT
from trainer.config import config_reference_markdown


def test_docs_config_is_the_generated_reference():
    written = (ROOT / "docs" / "config.md").read_text()
    assert written == config_reference_markdown(), (
        "docs/config.md is stale: regenerate it with `python -m trainer.config --markdown > docs/config.md`"
    )


def test_readme_links_the_reference_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/config.md)" in readme
    assert len(readme.encode()) < 25_000, "README.md is over 25 KB: move detail into docs/"


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    assert readme.index("```bash") < readme.index("\n## ")  # the commands come before any section
    first_block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1).splitlines()
    assert first_block[0].startswith("bash quickstart.sh")
    assert first_block[1].startswith(".venv/bin/python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci and "source .venv/bin/activate" in ci
