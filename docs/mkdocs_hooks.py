"""mkdocs hook of the docs site: the navigation that docs/build_site.py wrote to _proc/nav.yml (reading order)."""
from pathlib import Path

import yaml


def on_config(config):
    nav = Path(config.config_file_path).parent / "_proc" / "nav.yml"
    if not nav.is_file():
        raise SystemExit(f"{nav} is missing: build the site with `make docs` (docs/build_site.py), not mkdocs alone")
    config.nav = yaml.safe_load(nav.read_text())
    return config
