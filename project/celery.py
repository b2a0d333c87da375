"""The Celery application. Workers start with ``celery -A project worker -Q turns,celery``."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("hermes_sessions")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
