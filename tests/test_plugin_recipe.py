"""The recipe of docs/writing-a-method.md for using a plugin from the command line without installing a
package runs as printed (the shell block after its marker, unchanged), and a name that nothing knows is
refused with where a plugin's component must be, for every kind (`Registry.not_found`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedprism.cli import main
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.store import Store

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-a-method.md"
MARKER = "<!-- this block is run as it stands by tests/test_plugin_recipe.py -->"


def recipe() -> str:
    """The fenced bash block right after the marker in the document."""
    text = DOC.read_text()
    assert text.count(MARKER) == 1
    m = re.match(r"\s*```bash\n(.*?)\n```", text.split(MARKER, 1)[1], re.S)
    assert m, "the marker is not followed by a ```bash block"
    return m.group(1)


def test_the_docs_recipe_makes_a_plugin_known_to_the_cli(tmp_path):
    work = tmp_path / "my work"                              # a path with a space: the recipe quotes it
    work.mkdir()
    shutil.copy(ROOT / "tests" / "plugins" / "fedavgm_plugin.py", work / "fedavgm.py")
    fedprism_bin = shutil.which("fedprism", path=str(Path(sys.executable).parent))
    assert fedprism_bin, "the fedprism command is not installed beside this Python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDPRISM_DB")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", recipe()], cwd=work, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fedavgm.server_momentum" in r.stdout and "arXiv:1909.06335" in r.stdout     # `fedprism methods`
    with Store(work / "study.db", readonly=True) as s:
        (row,) = s.runs()
        assert row["method"] == "fedavgm" and row["status"] == "finished"
    # the same command without the recipe's PYTHONPATH: the name is unknown, with the hint
    r = subprocess.run([fedprism_bin, "run", "--db", "other.db", "method=fedavgm"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert ("a method from a plugin must be installed or on PYTHONPATH as an entry point (group "
            "fedprism.methods; docs/writing-a-method.md)") in r.stderr


@pytest.mark.parametrize("key,value,doc,near", [
    ("dataset", "wine", "docs/adding-a-dataset.md", ""),
    ("dataset", "fminst", "docs/adding-a-dataset.md", " (did you mean fmnist?)"),
    ("method", "mynova", "docs/writing-a-method.md", " (did you mean fednova?)"),
    ("model", "lenet", "docs/adding-a-model.md", " (did you mean lenet5?)"),
    ("partition", "dirichet", "docs/adding-a-partition.md", " (did you mean dirichlet?)"),
])
def test_an_unknown_name_says_where_a_plugins_must_be(key, value, doc, near):
    with pytest.raises(ConfigError) as e:
        resolve({key: value})
    msg = str(e.value)
    assert msg.startswith(f"config key '{key}' = '{value}' is not valid: one of ")
    assert msg.endswith(f"{near}; a {key} from a plugin must be installed or on PYTHONPATH as an entry point "
                        f"(group fedprism.{key}s; {doc})")
    assert (ROOT / doc).is_file()
    if key == "model":
        assert "one of auto, " in msg                       # `auto` is a value of the key, not a model


def test_the_registry_error_and_the_listing_commands_carry_the_hint(capsys):
    from fedprism.data.base import DATASETS

    with pytest.raises(ConfigError, match=r"known|one of") as e:
        DATASETS.get("wine")
    assert "a dataset from a plugin must be installed or on PYTHONPATH" in str(e.value)
    assert main(["datasets", "wine"]) == 2
    assert ("no dataset 'wine'; the datasets: acsincome, cifar10, " in (err := capsys.readouterr().err)
            and "a dataset from a plugin must be installed or on PYTHONPATH as an entry point" in err)
