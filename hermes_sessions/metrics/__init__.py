"""Metrics for Prometheus: what they are (``families.py``), what each process counts and reports to
PostgreSQL (``process.py``), the scrape that sums the reports and reads the state (``collector.py``) and
``GET /metrics`` (``views.py``). Why reports in PostgreSQL rather than prometheus-client's multiprocess
files: ``docs/decisions/2026-12-05-metrics-from-postgresql.md``."""
