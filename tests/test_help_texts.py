"""What a newcomer reads first: the `--help` of the listing commands, the keys' help in `fedprism methods`,
and the one-line `fedprism run` examples of docs/systems.md, docs/datasets.md and docs/adding-a-model.md
(each must resolve as written)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from fedprism.cli import main
from fedprism.experiment.config import parse_overrides, resolve

DOCS = Path(__file__).resolve().parents[1] / "docs"


def run_lines(doc: str) -> list[str]:
    return [line.split("#")[0].strip() for line in (DOCS / doc).read_text().splitlines()
            if line.startswith("fedprism run ") and not line.rstrip().endswith("\\")]


@pytest.mark.parametrize("doc, least", [("systems.md", 2), ("datasets.md", 1), ("adding-a-model.md", 1)])
def test_the_documented_run_lines_resolve(doc, least):
    lines = [x for x in run_lines(doc) if "system." in x or "feature_noise" in x or "resnet8" in x]
    assert len(lines) >= least, doc
    for line in lines:
        items = [x for x in shlex.split(line)[2:] if "=" in x and not x.startswith("-")]
        resolve(parse_overrides(items))             # raises ConfigError on a key or value that is not valid


def test_systems_md_has_a_dropout_deadline_and_a_fedbuff_example():
    lines = run_lines("systems.md")
    assert any("system.availability=bernoulli" in x and "system.deadline=" in x for x in lines)
    assert any("system.async=fedbuff" in x for x in lines)


def test_models_help_mentions_multiply_adds(capsys):
    with pytest.raises(SystemExit):
        main(["models", "--help"])
    assert "multiply-adds" in " ".join(capsys.readouterr().out.split())


def test_the_hf_keys_point_at_the_hugging_face_page(capsys):
    assert main(["methods"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    at = out.index("data.hf.image")
    assert "docs/huggingface.md" in out[at:at + 400] and "docs/datasets.md, Hugging Face" not in out
