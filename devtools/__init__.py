"""Development tools, kept out of the app package ``hermes_sessions``: the model stand-in, the fault
harness (``make faults``), the benchmark (``make bench``) and the process helpers they and the tests
share. Nothing here is imported by the running service."""
