"""Helpers the tests share that are not fixtures (fixtures live in ``tests/conftest.py``); process
helpers shared with the dev tools are in :mod:`devtools.processes`."""
