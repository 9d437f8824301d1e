"""A Flower app directory for `flwr run`: a pyproject.toml naming fedprism's ServerApp and ClientApp.

`flwr run DIR <superlink-connection>` bundles DIR into a FAB and submits it; the SuperLink's ServerApp
process and every SuperNode's ClientApp process then import `fedprism.flower.server_app:app` and
`fedprism.flower.client_app:app` from the Python environment they run in, so fedprism (with the
`flower` extra) must be installed there. The run config keys (`[tool.flwr.app.config]`) are those of
`fedprism.flower.settings.RUN_KEYS`; `flwr run -c 'key=value'` overrides them per run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedprism.flower.settings import RUN_KEYS, RunSettings


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def app_pyproject(run_config: dict[str, Any] | None = None, name: str = "fedprism-flower-app") -> str:
    """The text of the app's pyproject.toml, with every run-config key (validated) and its value."""
    rc = {k.replace("_", "-"): v for k, v in (run_config or {}).items()}
    RunSettings.from_run_config(rc)        # validate now rather than in the ServerApp
    values = {k: rc.get(k, p.default) for k, p in RUN_KEYS.items()}
    lines = [
        "# Flower app for fedprism (written by `python -m fedprism.flower app`). Run with:",
        "#   flwr run . <superlink-connection> --stream [-c 'key=value ...']",
        "[build-system]",
        'requires = ["hatchling"]',
        'build-backend = "hatchling.build"',
        "",
        "[project]",
        f'name = "{name}"',
        'version = "0.1.0"',
        'description = "fedprism (Fed-PRISM and baselines) on Flower"',
        'license = "Apache-2.0"',
        'dependencies = ["fedprism[flower]"]',
        "",
        "[tool.hatch.build.targets.wheel]",
        'packages = ["."]',
        "",
        "[tool.flwr.app]",
        'publisher = "fedprism"',
        "",
        "[tool.flwr.app.components]",
        'serverapp = "fedprism.flower.server_app:app"',
        'clientapp = "fedprism.flower.client_app:app"',
        "",
        "[tool.flwr.app.config]",
    ]
    for k, v in values.items():
        lines.append(f"# {RUN_KEYS[k].help}")
        lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def write_app(directory: str | Path, run_config: dict[str, Any] | None = None,
              name: str = "fedprism-flower-app") -> Path:
    """Write DIR/pyproject.toml (creating DIR); returns the file's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    p = d / "pyproject.toml"
    p.write_text(app_pyproject(run_config, name))
    return p
