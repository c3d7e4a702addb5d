"""Under pytest-xdist (``.ci/run`` runs two workers), each worker takes whole test files, so a file's
module-scoped fixtures and cached plans are made once; tests/inspection, whose session-scoped plans
its files share, goes to one worker as a whole."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        path = item.path.relative_to(config.rootpath)
        group = "tests/inspection" if path.parts[:2] == ("tests", "inspection") else path.as_posix()
        item.add_marker(pytest.mark.xdist_group(group))
