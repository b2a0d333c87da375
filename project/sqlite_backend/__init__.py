"""Django's SQLite backend, plus: the database file's folder is made on first connection.

The embedded default keeps its database under ``HERMES_VAR_DIR``, which a fresh clone does not have;
making it here (rather than when settings are imported) means importing settings touches no disk.
"""
