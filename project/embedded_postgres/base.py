"""``ENGINE = "project.embedded_postgres"``: Django's PostgreSQL backend, whose connections first start
the embedded server on the data directory that ``HOST`` names (``project/embedded_postgres/__init__.py``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from django.db.backends.postgresql import base

from project.embedded_postgres import server


class DatabaseWrapper(base.DatabaseWrapper):
    def get_connection_params(self) -> dict[str, Any]:
        server(Path(self.settings_dict["HOST"]))
        return dict(super().get_connection_params())
