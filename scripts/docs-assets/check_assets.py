"""An MkDocs hook (mkdocs.yml `hooks:`): the build stops when the browser assets that `scripts/docs` vendors into
docs/javascripts/vendor/ are missing, rather than shipping a site whose formulas show as TeX source and whose search
does not work from file://. STEADYRL_DOCS_WITHOUT_ASSETS=1 builds without them, and says so on every build.
docs/internals/docs-site.md#browser-assets-offline says why they are vendored."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

VENDOR = "javascripts/vendor/"
OPT_OUT = "STEADYRL_DOCS_WITHOUT_ASSETS"


def vendored(config) -> list[str]:
    """The vendored files mkdocs.yml names: in `extra_css`, `extra_javascript` and the theme's `polyfills`."""
    named = [*config.extra_css, *map(str, config.extra_javascript), *config.extra.get("polyfills", [])]
    return [name for name in named if name.startswith(VENDOR)]


def on_config(config):
    docs = Path(config.docs_dir)
    missing = [name for name in vendored(config) if not (docs / name).is_file()]
    if not missing:
        return config
    where = os.path.relpath(docs / VENDOR, Path(config.config_file_path).parent) + "/"
    if os.environ.get(OPT_OUT) == "1":
        print(
            f"steadyrl docs: built WITHOUT the browser assets in {where} ({OPT_OUT}=1): the formulas show as TeX "
            "source and search does not work from file://. `scripts/docs build` vendors them.",
            file=sys.stderr,
        )
        return config
    files = ", ".join(name.removeprefix(VENDOR) for name in missing)
    raise PluginError(
        f"The site's browser assets are missing from {where} ({files}): without them its formulas show as TeX "
        "source and search does not work from file://. Build it with `scripts/docs build` (serve it with "
        f"`scripts/docs serve`), which vendors them with npm first; {OPT_OUT}=1 builds without them."
    )
