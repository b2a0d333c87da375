"""Message search and the admin's indexes (issue 8).

* ``hermes_message_search_vector(text)``: ``to_tsvector('simple', coalesce(content, ''))`` as a
  PL/pgSQL function with its true cost (``models.MessageSearchVector`` says why), and
  ``message_content_search``, a GIN expression index on it (``models.MESSAGE_SEARCH_CONFIG`` says why
  ``simple``). PostgreSQL only: on SQLite (the embedded demo) both are skipped and
  ``selectors.message_search_filter`` falls back to ``icontains``. An expression index rather than a
  stored tsvector column: no model field SQLite could not have, no second copy of every text.
* ``notice_unacked_session``: partial index on the few unacknowledged notices.
* ``session_updated_id``: the admin's sessions list order.
"""
from typing import Any

import django.contrib.postgres.indexes
from django.db import migrations, models

import hermes_sessions.models

CREATE_FUNCTION = """
CREATE FUNCTION hermes_message_search_vector(content text) RETURNS tsvector
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE COST 1000 AS $$
BEGIN
    RETURN to_tsvector('simple'::regconfig, coalesce(content, ''));
END
$$"""
DROP_FUNCTION = "DROP FUNCTION IF EXISTS hermes_message_search_vector(text)"


def _on_postgresql(sql: str) -> Any:
    def run(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql)

    return run


class AddPostgresIndex(migrations.AddIndex):
    """``AddIndex`` that builds the index only on PostgreSQL (the state always has it)."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)


class Migration(migrations.Migration):

    dependencies = [
        ('hermes_sessions', '0003_turn_events'),
    ]

    operations = [
        migrations.RunPython(_on_postgresql(CREATE_FUNCTION), _on_postgresql(DROP_FUNCTION)),
        AddPostgresIndex(
            model_name='message',
            index=django.contrib.postgres.indexes.GinIndex(
                hermes_sessions.models.MessageSearchVector('content'), name='message_content_search'
            ),
        ),
        migrations.AddIndex(
            model_name='notice',
            index=models.Index(condition=models.Q(('acknowledged_at__isnull', True)), fields=['session'], name='notice_unacked_session'),
        ),
        migrations.AddIndex(
            model_name='session',
            index=models.Index(fields=['-updated_at', '-id'], name='session_updated_id'),
        ),
    ]
