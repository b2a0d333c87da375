"""The migrations say what the models say: a model change without its migration fails here, not on an
operator's ``manage.py migrate``."""
import io

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_no_model_change_lacks_a_migration():
    out = io.StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exc:  # --check exits 1 when a migration would be written
        pytest.fail(f"models and migrations differ (exit {exc.code}):\n{out.getvalue()}")
