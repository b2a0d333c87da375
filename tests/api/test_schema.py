"""The OpenAPI schema generates and names every API route."""
import pytest
from rest_framework.test import APIClient

from tests.factories import UserFactory


@pytest.mark.django_db
def test_schema_lists_the_api():
    api = APIClient()
    api.force_authenticate(UserFactory())
    response = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    for path in (
        "/api/sessions/",
        "/api/sessions/{session_id}/",
        "/api/sessions/{session_id}/turns/",
        "/api/sessions/{session_id}/messages/",
        "/api/sessions/{session_id}/notices/",
        "/api/turns/{turn_id}/",
    ):
        assert path in paths
